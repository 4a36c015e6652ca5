//! OpenAI wire types (the subset handoff serves) and the error body.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Json, Response};
use serde::de::{self, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::json;

use crate::input::MAX_STOP;
use crate::{Cause, FrontendError};

/// `stop`: a string or a list of at most [`MAX_STOP`] strings, read no further (a list of a
/// million took 70 MB, as generic values, before it was counted).
#[derive(Debug, Clone)]
pub(crate) struct Stop(pub(crate) Vec<String>);

struct StopVisitor;

impl<'de> Visitor<'de> for StopVisitor {
    type Value = Stop;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "a string or a list of at most {MAX_STOP} strings")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Stop, E> {
        Ok(Stop(vec![s.to_owned()]))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stop, A::Error> {
        let mut all = Vec::new();
        while let Some(s) = seq.next_element::<String>()? {
            if all.len() == MAX_STOP {
                return Err(de::Error::invalid_length(MAX_STOP + 1, &self));
            }
            all.push(s);
        }
        Ok(Stop(all))
    }
}

impl<'de> Deserialize<'de> for Stop {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(StopVisitor)
    }
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Sampling {
    pub(crate) max_tokens: Option<u32>,
    pub(crate) max_completion_tokens: Option<u32>,
    pub(crate) temperature: Option<f32>,
    pub(crate) top_p: Option<f32>,
    pub(crate) top_k: Option<u32>,
    /// Any 64-bit integer: a negative one (OpenAI's type is a signed integer; `-1` is
    /// common) is taken by its bits.
    #[serde(default, deserialize_with = "signed_or_not")]
    pub(crate) seed: Option<u64>,
    pub(crate) stop: Option<Stop>,
    pub(crate) n: Option<u32>,
    /// `null` as absent, as OpenAI takes it.
    pub(crate) stream: Option<bool>,
    pub(crate) stream_options: Option<StreamOptions>,
}

fn signed_or_not<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    struct Seed;
    impl Visitor<'_> for Seed {
        type Value = Option<u64>;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a 64-bit integer")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v as u64))
        }

        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(Seed)
}

#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct StreamOptions {
    pub(crate) include_usage: Option<bool>,
}

// The request types below are read straight from the body, never through serde's untagged
// enums or `flatten`, which first hold the whole value as generic content (32 bytes a token
// id, hundreds a content part): a 4 MiB body became 60 to 120 MB. [`Sampling`] is read from
// the same body on its own.

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ChatMessage {
    pub(crate) role: String,
    pub(crate) content: Content,
}

/// A message's `content`: a string, or a list of parts.
#[derive(Debug, Clone)]
pub(crate) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

/// One part of a message's content; only text parts are served.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ContentPart {
    #[serde(rename = "type")]
    pub(crate) kind: String,
    #[serde(default)]
    pub(crate) text: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ChatRequest {
    pub(crate) model: String,
    pub(crate) messages: Vec<ChatMessage>,
}

/// `prompt`: a string or a list of token ids.
#[derive(Debug, Clone)]
pub(crate) enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

#[derive(Debug, Clone, Deserialize)]
pub(crate) struct CompletionRequest {
    pub(crate) model: String,
    pub(crate) prompt: Prompt,
}

/// A string, or a list of `T`, read as it comes.
struct StringOrList<T>(std::marker::PhantomData<T>, &'static str);

impl<'de, T: Deserialize<'de>> Visitor<'de> for StringOrList<T> {
    type Value = Result<String, Vec<T>>;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(self.1)
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Ok(s.to_owned()))
    }

    fn visit_string<E: de::Error>(self, s: String) -> Result<Self::Value, E> {
        Ok(Ok(s))
    }

    /// `null` as empty (an assistant message's `content` may be null in OpenAI's API).
    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(Ok(String::new()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1024));
        while let Some(item) = seq.next_element()? {
            items.push(item);
        }
        Ok(Err(items))
    }
}

fn string_or_list<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
    expecting: &'static str,
) -> Result<Result<String, Vec<T>>, D::Error> {
    d.deserialize_any(StringOrList(std::marker::PhantomData, expecting))
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match string_or_list(d, "a string or a list of token ids")? {
            Ok(text) => Prompt::Text(text),
            Err(ids) => Prompt::Tokens(ids),
        })
    }
}

impl<'de> Deserialize<'de> for Content {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(match string_or_list(d, "a string or a list of content parts")? {
            Ok(text) => Content::Text(text),
            Err(parts) => Content::Parts(parts),
        })
    }
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct Usage {
    pub(crate) prompt_tokens: u32,
    pub(crate) completion_tokens: u32,
    pub(crate) total_tokens: u32,
    pub(crate) prompt_tokens_details: CachedTokens,
}

#[derive(Debug, Clone, Serialize)]
pub(crate) struct CachedTokens {
    pub(crate) cached_tokens: u32,
}

/// An error as OpenAI shapes it.
#[derive(Debug)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) kind: &'static str,
    pub(crate) message: String,
    pub(crate) param: Option<&'static str>,
    pub(crate) code: Option<&'static str>,
    /// Seconds after which a refused request may be retried (`Retry-After`).
    pub(crate) retry_after: Option<u64>,
}

impl ApiError {
    pub(crate) fn invalid(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
            code: None,
            retry_after: None,
        }
    }

    /// A failure of the server's, with its HTTP status.
    pub(crate) fn server(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            kind: "server_error",
            message: message.into(),
            param: None,
            code: None,
            retry_after: None,
        }
    }
}

impl From<FrontendError> for ApiError {
    fn from(e: FrontendError) -> Self {
        let message = e.to_string();
        let mut retry_after = None;
        let (status, kind, code) = match e {
            FrontendError::Invalid(_) => (StatusCode::BAD_REQUEST, "invalid_request_error", None),
            FrontendError::UnknownModel(_) => {
                (StatusCode::NOT_FOUND, "invalid_request_error", Some("model_not_found"))
            }
            FrontendError::Overloaded { retry_after: after, .. } => {
                retry_after = Some(after.as_millis().div_ceil(1000).max(1) as u64);
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("overloaded"))
            }
            FrontendError::Attempt { cause: Cause::Overloaded, .. } => {
                retry_after = Some(1);
                (StatusCode::TOO_MANY_REQUESTS, "rate_limit_error", Some("overloaded"))
            }
            FrontendError::Attempt { cause: Cause::Invalid, .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", None)
            }
            FrontendError::Deadline(_) | FrontendError::Attempt { cause: Cause::Deadline, .. } => {
                (StatusCode::GATEWAY_TIMEOUT, "server_error", None)
            }
            FrontendError::Unavailable(_) | FrontendError::Attempt { .. } => {
                (StatusCode::SERVICE_UNAVAILABLE, "server_error", None)
            }
            FrontendError::Decode(_) => (StatusCode::INTERNAL_SERVER_ERROR, "server_error", None),
        };
        let param = matches!(code, Some("model_not_found")).then_some("model");
        ApiError { status, kind, message, param, code, retry_after }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}});
        let mut r = (self.status, Json(body)).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut().insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}
