//! OpenAI parameters handoff does not serve, refused by name (400) when a request asks for
//! them rather than answered as if they had not been asked (a 200 without the log
//! probabilities asked for, free text where a JSON schema was required). Read without
//! holding their values: presence is all that is kept.

use serde::Deserialize;
use serde::de::{self, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};

use super::openai::ApiError;

/// Whether a field asks for something: not null, false, 0, an empty string, list or object
/// (`.0`); and whether it was the number 0 (`.1`: a completion's `logprobs: 0` asks for
/// the sampled token's).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Asked(pub(crate) bool, bool);

struct AskedVisitor;

impl<'de> Visitor<'de> for AskedVisitor {
    type Value = Asked;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_unit<E: de::Error>(self) -> Result<Asked, E> {
        Ok(Asked(false, false))
    }

    fn visit_bool<E: de::Error>(self, b: bool) -> Result<Asked, E> {
        Ok(Asked(b, false))
    }

    fn visit_i64<E: de::Error>(self, n: i64) -> Result<Asked, E> {
        Ok(Asked(n != 0, n == 0))
    }

    fn visit_u64<E: de::Error>(self, n: u64) -> Result<Asked, E> {
        Ok(Asked(n != 0, n == 0))
    }

    fn visit_f64<E: de::Error>(self, n: f64) -> Result<Asked, E> {
        Ok(Asked(n != 0.0, n == 0.0))
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<Asked, E> {
        Ok(Asked(!s.is_empty(), false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Asked, A::Error> {
        let mut any = false;
        while seq.next_element::<IgnoredAny>()?.is_some() {
            any = true;
        }
        Ok(Asked(any, false))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Asked, A::Error> {
        let mut any = false;
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
            any = true;
        }
        Ok(Asked(any, false))
    }
}

impl<'de> Deserialize<'de> for Asked {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(AskedVisitor)
    }
}

/// `response_format`: only its type is read (none given: text).
#[derive(Debug, Clone, Deserialize)]
pub(crate) struct ResponseFormat {
    #[serde(rename = "type")]
    kind: Option<String>,
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
    tool_choice: Option<ToolChoice>,
}

/// `tool_choice`: whether it is the string `"none"` (any other value is read past).
#[derive(Debug, Clone, Copy)]
struct ToolChoice(bool);

struct ToolChoiceVisitor;

impl<'de> Visitor<'de> for ToolChoiceVisitor {
    type Value = ToolChoice;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a tool choice")
    }

    fn visit_str<E: de::Error>(self, s: &str) -> Result<ToolChoice, E> {
        Ok(ToolChoice(s == "none"))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ToolChoice, A::Error> {
        while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
        Ok(ToolChoice(false))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<ToolChoice, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(ToolChoice(false))
    }

    fn visit_bool<E: de::Error>(self, _: bool) -> Result<ToolChoice, E> {
        Ok(ToolChoice(false))
    }

    fn visit_i64<E: de::Error>(self, _: i64) -> Result<ToolChoice, E> {
        Ok(ToolChoice(false))
    }

    fn visit_u64<E: de::Error>(self, _: u64) -> Result<ToolChoice, E> {
        Ok(ToolChoice(false))
    }

    fn visit_f64<E: de::Error>(self, _: f64) -> Result<ToolChoice, E> {
        Ok(ToolChoice(false))
    }
}

impl<'de> Deserialize<'de> for ToolChoice {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(ToolChoiceVisitor)
    }
}

impl Unsupported {
    /// The first parameter asked for that is not served, as a 400; `completion`: on
    /// `/v1/completions`, where `logprobs` is a count (0 asks for the sampled token's).
    pub(crate) fn refuse(&self, completion: bool) -> Result<(), ApiError> {
        let logprobs = Asked(self.logprobs.0 || (completion && self.logprobs.1), false);
        // Tools a request says not to call (`tool_choice: "none"`) ask for nothing.
        let no_tools = self.tool_choice.is_some_and(|c| c.0);
        let tools = Asked(self.tools.0 && !no_tools, false);
        let format = self.response_format.as_ref().and_then(|f| f.kind.as_deref());
        let asked = [
            (logprobs, "logprobs"),
            (self.top_logprobs, "top_logprobs"),
            (self.echo, "echo"),
            (self.suffix, "suffix"),
            (tools, "tools"),
            (self.functions, "functions"),
            (self.logit_bias, "logit_bias"),
            (self.presence_penalty, "presence_penalty"),
            (self.frequency_penalty, "frequency_penalty"),
            (Asked(self.best_of.is_some_and(|n| n > 1), false), "best_of"),
            (Asked(format.is_some_and(|t| t != "text"), false), "response_format"),
        ];
        match asked.into_iter().find(|(a, _)| a.0) {
            Some((_, name)) => {
                Err(ApiError::invalid(format!("{name} is not supported"), Some(name)))
            }
            None => Ok(()),
        }
    }
}
