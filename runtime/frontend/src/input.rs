//! Turning a `GenerateRequest` into a plan, rejecting bad input with a reason.

use std::sync::Arc;
use std::time::Duration;

use handoff_engine::{ChatMessage, Engine};
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, Policy, SamplingParams};
use tokio::time::Instant;

use crate::{Frontend, FrontendConfig, FrontendError};

/// Most stop strings per request.
pub const MAX_STOP: usize = 8;
/// Longest stop string, in bytes.
pub const MAX_STOP_LEN: usize = 256;
/// Longest text or chat input, in bytes.
pub const MAX_INPUT_BYTES: usize = 4 << 20;

/// A checked request.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Prompt token ids.
    pub tokens: Vec<u32>,
    /// Sampling settings, as sent to the prefill.
    pub sampling: SamplingParams,
    /// Tokens to generate, the first included.
    pub max_tokens: u32,
    /// Whether `max_tokens` is only the context's room (a chat that named none): such a
    /// request reaching its deadline ends as long enough (`Length`), not as a failure.
    pub open_ended: bool,
    /// Scheduling policy (`Unspecified` = the scheduler's).
    pub policy: Policy,
    /// Whole-request deadline.
    pub deadline: Instant,
    /// The request's trace (the caller's, or a new one), sent on to the scheduler and the
    /// prefill.
    pub trace: handoff_proto::trace::TraceContext,
}

/// Text and chat inputs longer than this are tokenized on a blocking thread, as many at once
/// as there are cores: encoding takes about 1.6 us a byte (a megabyte of digits, 1.6 s),
/// which on an async worker would stall every stream it serves. At 4 KiB an input inline
/// holds a worker about 7 ms at most (at 64 KiB, 100 ms: two such requests stalled both
/// workers of a 2-core host).
pub const TOKENIZE_APART_BYTES: usize = 4 << 10;

/// Bytes of long inputs held waiting for a turn to be tokenized, or being tokenized, at most:
/// past it a long input is refused at once (429). Each holds its text while it waits, and
/// the request's message was counted only while it arrived: 4,096 requests in progress held
/// up to 64 GiB of 16 MiB gRPC messages behind two busy turns. At about 1.6 us a byte on two
/// cores, 64 MiB is some 50 s of tokenizing: more would not be done within a request's time.
pub const TOKENIZE_HELD_BYTES: usize = 64 << 20;

/// [`plan`], with a long input tokenized apart (see [`TOKENIZE_APART_BYTES`]).
pub(crate) async fn checked(
    fe: &Arc<Frontend>,
    req: GenerateRequest,
) -> Result<Plan, FrontendError> {
    let bytes = match &req.input {
        Some(Input::Text(t)) => t.len(),
        Some(Input::Chat(c)) => c.messages.iter().map(|m| m.content.len() + m.role.len()).sum(),
        Some(Input::TokenIds(_)) | None => 0,
    };
    if bytes <= TOKENIZE_APART_BYTES {
        return plan(req, &*fe.engine, &fe.cfg);
    }
    // Refused before it is held: too long, or too much waiting already.
    if bytes > MAX_INPUT_BYTES {
        return Err(invalid(format!("the input exceeds {MAX_INPUT_BYTES} bytes")));
    }
    let held = u32::try_from(bytes)
        .ok()
        .and_then(|n| fe.tokenizing_bytes.clone().try_acquire_many_owned(n).ok());
    let Some(held) = held else {
        return Err(FrontendError::Overloaded {
            retry_after: Duration::from_secs(1),
            limit: crate::Limit::Tokenizer,
            reason: format!(
                "long inputs waiting to be tokenized hold {} MiB already",
                TOKENIZE_HELD_BYTES >> 20
            ),
        });
    };
    let arrived = Instant::now();
    // A turn within the request's time: past it, the frontend is too busy for it (429).
    let turn = tokio::time::timeout_at(arrived + budget(&req, &fe.cfg), async {
        fe.tokenizing.clone().acquire_owned().await
    });
    let turn = turn.await.map_err(|_| FrontendError::Overloaded {
        retry_after: Duration::from_secs(1),
        limit: crate::Limit::Tokenizer,
        reason: "long inputs ahead of it took the time it had to be tokenized".into(),
    })?;
    let fe = fe.clone();
    let apart = tokio::task::spawn_blocking(move || {
        let _turn = (turn, held);
        plan(req, &*fe.engine, &fe.cfg)
    });
    let mut planned =
        apart.await.map_err(|e| invalid(format!("the input could not be tokenized: {e}")))??;
    // The deadline counts from the request's arrival, its wait for a turn included.
    let waited = arrived.elapsed();
    planned.deadline = planned.deadline.checked_sub(waited).unwrap_or(planned.deadline);
    Ok(planned)
}

/// The time `req` has: its own deadline, at most the frontend's request timeout (a client
/// naming 49 days held its place that long, reading nothing), or that timeout.
fn budget(req: &GenerateRequest, cfg: &FrontendConfig) -> Duration {
    match req.deadline_ms {
        0 => cfg.request_timeout,
        ms => Duration::from_millis(u64::from(ms)).min(cfg.request_timeout),
    }
}

fn invalid(s: impl Into<String>) -> FrontendError {
    FrontendError::Invalid(s.into())
}

/// Checks `req` against the engine and the frontend's limits.
pub fn plan(
    req: GenerateRequest,
    engine: &dyn Engine,
    cfg: &FrontendConfig,
) -> Result<Plan, FrontendError> {
    let info = engine.info();
    let budget = budget(&req, cfg);
    if !req.model.is_empty() && req.model != info.name {
        return Err(FrontendError::UnknownModel(req.model));
    }
    let chat = matches!(req.input, Some(Input::Chat(_)));
    let tokens = match req.input {
        None => return Err(invalid("input is required: text, chat or token_ids")),
        Some(Input::Text(t)) => {
            if t.len() > MAX_INPUT_BYTES {
                return Err(invalid(format!("text exceeds {MAX_INPUT_BYTES} bytes")));
            }
            engine.tokenize(&t).map_err(|e| invalid(e.to_string()))?
        }
        Some(Input::Chat(c)) => {
            let bytes: usize = c.messages.iter().map(|m| m.content.len() + m.role.len()).sum();
            if bytes > MAX_INPUT_BYTES {
                return Err(invalid(format!("chat exceeds {MAX_INPUT_BYTES} bytes")));
            }
            if let Some(m) = c
                .messages
                .iter()
                .find(|m| !matches!(m.role.as_str(), "system" | "user" | "assistant"))
            {
                return Err(invalid(format!(
                    "chat role must be system, user or assistant, got {:?}",
                    m.role
                )));
            }
            let msgs: Vec<ChatMessage> = c
                .messages
                .into_iter()
                .map(|m| ChatMessage { role: m.role, content: m.content })
                .collect();
            engine.tokenize_chat(&msgs).map_err(|e| invalid(e.to_string()))?
        }
        Some(Input::TokenIds(t)) => {
            if let Some(bad) = t.ids.iter().find(|&&i| i >= info.vocab) {
                return Err(invalid(format!(
                    "token id {bad} outside the vocabulary of {}",
                    info.vocab
                )));
            }
            t.ids
        }
    };
    if tokens.is_empty() {
        return Err(invalid("the prompt is empty"));
    }
    let mut sampling = req.sampling.unwrap_or_default();
    if sampling.seed.is_none() {
        // A fresh seed, so that sampled outputs differ from call to call; below 2^63, as
        // engines that keep seeds in a signed 64-bit integer (SGLang) need.
        sampling.seed = Some(rand::random::<u64>() >> 1);
    }
    if !sampling.temperature.is_finite() || !(0.0..=2.0).contains(&sampling.temperature) {
        return Err(invalid(format!(
            "temperature must be in [0, 2], got {}",
            sampling.temperature
        )));
    }
    if !sampling.top_p.is_finite() || !(0.0..=1.0).contains(&sampling.top_p) {
        return Err(invalid(format!("top_p must be in [0, 1], got {}", sampling.top_p)));
    }
    if sampling.stop.len() > MAX_STOP
        || sampling.stop.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_LEN)
    {
        return Err(invalid(format!(
            "at most {MAX_STOP} stop strings of 1 to {MAX_STOP_LEN} bytes"
        )));
    }
    let open_ended = chat && sampling.max_tokens == 0;
    let max_tokens = match sampling.max_tokens {
        // A chat goes on until it ends or fills the context (OpenAI's chat default).
        0 if open_ended => {
            let room = info.max_context.saturating_sub(tokens.len());
            if room == 0 {
                return Err(invalid(format!(
                    "prompt of {} tokens fills the context of {}",
                    tokens.len(),
                    info.max_context
                )));
            }
            u32::try_from(room).unwrap_or(u32::MAX)
        }
        0 => cfg.default_max_tokens,
        n => n,
    };
    if tokens.len() + max_tokens as usize > info.max_context {
        return Err(invalid(format!(
            "prompt of {} tokens plus max_tokens {max_tokens} exceeds the context of {}",
            tokens.len(),
            info.max_context
        )));
    }
    let policy = Policy::try_from(req.policy)
        .map_err(|_| invalid(format!("unknown policy {}", req.policy)))?;
    Ok(Plan {
        tokens,
        sampling,
        max_tokens,
        open_ended,
        policy,
        deadline: Instant::now() + budget,
        trace: Default::default(),
    })
}

#[cfg(test)]
mod tests;
