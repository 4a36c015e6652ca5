//! Attempts on SGLang prefill servers (protocol `sglang`): the frontend is SGLang's decode for
//! the request. As SGLang's own router does, it POSTs the prompt to the server's `/generate`
//! with the bootstrap fields (the host and port of the server's bootstrap directory, and the
//! room minted here); meanwhile [`SglangReceiver`] registers with the rank the room maps to,
//! receives the pages and the metadata row over Mooncake, and checks that the row names the
//! room. The KV is then the engine's, as from a handoff prefill.
//!
//! The receiver (a Mooncake target and a ZMQ PULL socket on the frontend's transfer address)
//! starts with the first such attempt: a frontend routed only to handoff prefills opens no
//! port for it.

use std::net::IpAddr;
use std::sync::Arc;

use handoff_core::{Room, Tasks};
use handoff_engine::Engine;
use handoff_proto::v1::SamplingParams;
use handoff_sglang::{SglangError, SglangLayout, SglangReceiver};
use handoff_transfer::{InboxConfig, TransferKind};
use serde_json::{Value, json};
use tokio::sync::OnceCell;
use tokio::time::Instant;

use crate::attempt::{Prefilled, Stages, within};
use crate::engine_http::{self, EngineHttp, post_json};
use crate::{Cause, FrontendError};

/// Where an SGLang attempt goes.
#[derive(Debug, Clone)]
pub struct SglangTarget {
    /// The server's HTTP address (`host:port`).
    pub url: String,
    /// Its bootstrap directory (`host:port`).
    pub bootstrap_addr: String,
}

/// The frontend's side of SGLang's PD protocol (see the module docs).
pub(crate) struct SglangPrefills {
    engine: Arc<dyn Engine>,
    bind_ip: IpAddr,
    advertise_ip: Option<String>,
    inbox: InboxConfig,
    tasks: Tasks,
    receiver: OnceCell<SglangReceiver>,
    http: EngineHttp,
}

impl SglangPrefills {
    /// Receives `engine`'s KV on `transfer`'s addresses (once started), within `inbox`'s
    /// bounds, its tasks on `tasks`.
    pub(crate) fn new(
        engine: Arc<dyn Engine>,
        transfer: &TransferKind,
        inbox: InboxConfig,
        tasks: &Tasks,
    ) -> Self {
        SglangPrefills {
            engine,
            bind_ip: transfer.bind_ip(),
            advertise_ip: transfer.advertise_ip(),
            inbox,
            tasks: tasks.clone(),
            receiver: OnceCell::new(),
            http: engine_http::client(),
        }
    }

    async fn receiver(&self) -> Result<&SglangReceiver, SglangError> {
        self.receiver
            .get_or_try_init(|| async {
                let info = self.engine.info();
                let layout = SglangLayout::for_kv(info.shape, info.page_size);
                let r = SglangReceiver::start(
                    layout,
                    self.bind_ip,
                    self.advertise_ip.clone(),
                    self.inbox.clone(),
                    &self.tasks,
                )
                .await?;
                tracing::info!(receiver = ?r, "SGLang decode side started");
                Ok(r)
            })
            .await
    }

    /// Runs one attempt with `room` on the SGLang prefill server `target`.
    pub(crate) async fn attempt(
        &self,
        target: &SglangTarget,
        room: Room,
        tokens: &[u32],
        sampling: &SamplingParams,
        deadline: Instant,
        stages: &mut Stages,
    ) -> Result<Prefilled, FrontendError> {
        // The receiver is ours: its failing to start is the decode's, not the server's.
        let receiver = self
            .receiver()
            .await
            .map_err(|e| FrontendError::because("register", Cause::Decode, e))?;
        stages.timings.register_us = stages.mark();
        let (host, port) = split_host_port(&target.bootstrap_addr).ok_or_else(|| {
            FrontendError::at(
                "resolve-topology",
                format!("bootstrap address {:?} is not HOST:PORT", target.bootstrap_addr),
            )
        })?;
        let body = json!({
            "input_ids": tokens,
            "sampling_params": sampling_params(sampling),
            "bootstrap_host": host,
            "bootstrap_port": port,
            "bootstrap_room": room.get(),
            "stream": false,
        });
        let shape = self.engine.info().shape;
        // Bounded as a whole: its directory reads have no deadline of their own, and a
        // server answering `/generate` while its directory hangs would hold it.
        let receive = within(deadline, "verify", async {
            receiver
                .receive(&target.bootstrap_addr, room, tokens.len(), shape, deadline)
                .await
                .map_err(|e| failure("verify", e))
        });
        let generate = within(
            deadline,
            "prefill",
            post_json(&self.http, &target.url, "/generate", &[], &body),
        );
        let (answer, got) = tokio::try_join!(generate, receive)?;
        // The server's answer, when it names its first token, must name the row's.
        if let Some(first) = answer["output_ids"].get(0).and_then(Value::as_u64)
            && first != u64::from(got.first_token)
        {
            return Err(FrontendError::at(
                "verify",
                format!(
                    "the server answered first token {first}, the metadata row says {}",
                    got.first_token
                ),
            ));
        }
        stages.timings.verify_us = stages.mark();
        let cached = answer["meta_info"]["cached_tokens"].as_u64().unwrap_or(0);
        Ok(Prefilled {
            kv_bytes: got.layout.len,
            kv: got.kv,
            first_token: got.first_token,
            cached_tokens: cached.min(tokens.len() as u64) as u32,
        })
    }
}

/// SGLang's `sampling_params` for ours: only what is set (SGLang's defaults otherwise).
fn sampling_params(s: &SamplingParams) -> Value {
    let mut p = serde_json::Map::new();
    p.insert("max_new_tokens".into(), json!(s.max_tokens.max(1)));
    p.insert("temperature".into(), json!(s.temperature));
    if s.top_p > 0.0 {
        p.insert("top_p".into(), json!(s.top_p));
    }
    if s.top_k > 0 {
        p.insert("top_k".into(), json!(s.top_k));
    }
    // Only where it matters; SGLang keeps seeds in a signed 64-bit integer.
    if let Some(seed) = s.seed
        && s.temperature > handoff_engine::GREEDY_BELOW
    {
        p.insert("sampling_seed".into(), json!(seed & i64::MAX as u64));
    }
    if s.ignore_eos {
        p.insert("ignore_eos".into(), json!(true));
    }
    Value::Object(p)
}

/// `host:port` (IPv6 hosts in brackets), the port parsed.
pub(crate) fn split_host_port(addr: &str) -> Option<(&str, u16)> {
    let (host, port) = addr.rsplit_once(':')?;
    let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
    Some((host, port.parse().ok()?)).filter(|(h, _)| !h.is_empty())
}

/// An SGLang failure as the attempt's, at `stage` unless the error says where it belongs.
fn failure(stage: &'static str, e: SglangError) -> FrontendError {
    match e {
        SglangError::Timeout(_) => FrontendError::because(stage, Cause::Deadline, e),
        SglangError::Full(_) => FrontendError::because("register", Cause::Overloaded, e),
        SglangError::Transfer(t) => FrontendError::transfer(stage, t),
        SglangError::Engine(_) => FrontendError::because("consume", Cause::Decode, e),
        SglangError::Bootstrap(_) | SglangError::Unsupported(_) => {
            FrontendError::at("resolve-topology", e)
        }
        SglangError::Zmq(_) => FrontendError::at("connect", e),
        SglangError::Malformed(_)
        | SglangError::PrefillFailed { .. }
        | SglangError::RoomMismatch { .. } => FrontendError::at(stage, e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bootstrap_addresses_split_and_bad_ones_do_not() {
        assert_eq!(split_host_port("10.0.0.5:8998"), Some(("10.0.0.5", 8998)));
        assert_eq!(split_host_port("[fd00::1]:8998"), Some(("fd00::1", 8998)));
        assert_eq!(split_host_port("host"), None);
        assert_eq!(split_host_port(":8998"), None);
        assert_eq!(split_host_port("h:99999"), None);
    }

    #[test]
    fn only_the_sampling_asked_for_is_sent() {
        let greedy = SamplingParams { max_tokens: 8, seed: Some(3), ..Default::default() };
        assert_eq!(sampling_params(&greedy), json!({"max_new_tokens": 8, "temperature": 0.0}));
        let s = SamplingParams { top_k: 5, seed: Some(7), temperature: 1.0, ..Default::default() };
        let p = sampling_params(&s);
        assert_eq!((p["top_k"].as_u64(), p["sampling_seed"].as_u64()), (Some(5), Some(7)));
        // A seed past 2^63 would overflow SGLang's signed 64-bit seeds.
        let s = SamplingParams { seed: Some(u64::MAX), temperature: 1.0, ..Default::default() };
        assert_eq!(sampling_params(&s)["sampling_seed"].as_u64(), Some(i64::MAX as u64));
    }
}
