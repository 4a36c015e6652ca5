//! OpenAI parameters handoff does not serve, refused by name (400) when a request asks for
//! them rather than answered as if they had not been asked (a 200 without the log
//! probabilities asked for, free text where a JSON schema was required). Read without
//! holding their values: presence is all that is kept.

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::openai::ApiError;

/// Whether a field asks for something: not null, false, 0, an empty string, list or object.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Asked(pub(crate) bool);

struct AskedVisitor;

impl<'de> Visitor<'de> for AskedVisitor {
    type Value = Asked;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Asked, E> {
        Ok(Asked(false))
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Asked, E> {
        Ok(Asked(b))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Asked, E> {
        Ok(Asked(n != 0))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Asked, E> {
        Ok(Asked(n != 0))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Asked, E> {
        Ok(Asked(n != 0.0))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Asked, E> {
        Ok(Asked(!s.is_empty()))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Asked, A::Error> {
        let mut any = false;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            any = true;
        }
        Ok(Asked(any))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Asked, A::Error> {
        let mut any = false;
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            any = true;
        }
        Ok(Asked(any))
    }
}

impl<'de> Deserialize<'de> for Asked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(AskedVisitor)
    }
}

/// `response_format`: only its type is read.
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ResponseFormat {
    #[serde(rename = "type")]
    kind: String,
}

/// The parameters refused when asked for, read from the request's body on their own.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct Unsupported {
    #[serde(default)]
    logprobs: Asked,
    #[serde(default)]
    top_logprobs: Asked,
    #[serde(default)]
    echo: Asked,
    #[serde(default)]
    suffix: Asked,
    #[serde(default)]
    tools: Asked,
    #[serde(default)]
    functions: Asked,
    #[serde(default)]
    logit_bias: Asked,
    #[serde(default)]
    presence_penalty: Asked,
    #[serde(default)]
    frequency_penalty: Asked,
    best_of: Option<u32>,
    response_format: Option<ResponseFormat>,
}

impl Unsupported {
    /// The first parameter asked for that is not served, as a 400.
    pub(crate) fn refuse(&self) -> Result<(), ApiError> {
        let asked = [
            (self.logprobs, "logprobs"),
            (self.top_logprobs, "top_logprobs"),
            (self.echo, "echo"),
            (self.suffix, "suffix"),
            (self.tools, "tools"),
            (self.functions, "functions"),
            (self.logit_bias, "logit_bias"),
            (self.presence_penalty, "presence_penalty"),
            (self.frequency_penalty, "frequency_penalty"),
            (Asked(self.best_of.is_some_and(|n| n > 1)), "best_of"),
            (
                Asked(self.response_format.as_ref().is_some_and(|f| f.kind != "text")),
                "response_format",
            ),
        ];
        match asked.into_iter().find(|(a, _)| a.0) {
            Some((_, name)) => {
                Err(ApiError::invalid(format!("{name} is not supported"), Some(name)))
            }
            None => Ok(()),
        }
    }
}
