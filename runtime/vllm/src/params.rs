//! What a decode asks a vLLM prefill server and what it answers, as vLLM's disaggregated
//! proxy does (`toy_proxy_server.py`): the prompt POSTed to `/v1/completions` with
//! `kv_transfer_params` asking the server to keep its KV for a remote decode, one token, not
//! streamed; the answer's top-level `kv_transfer_params` say where the KV waits
//! (`pull_scheduler.py`'s `request_finished`).

use serde::Deserialize;
use serde_json::{Value, json};

use crate::VllmError;

/// Most blocks one request's answer may list.
const MAX_BLOCKS: usize = 1 << 20;
/// Most prefill TP ranks read from.
const MAX_RANKS: u32 = 64;
/// Longest id accepted from the prefill.
const MAX_ID: usize = 512;

/// The body POSTed to a prefill's `/v1/completions` for the prompt `tokens` (sent with the
/// header `X-Request-Id`, from which vLLM derives the id its KV waits under).
pub fn prefill_request(tokens: &[u32]) -> Value {
    json!({
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": false,
        "kv_transfer_params": {
            "do_remote_decode": true,
            "do_remote_prefill": false,
            "remote_engine_id": null,
            "remote_block_ids": null,
            "remote_host": null,
            "remote_port": null,
        },
    })
}

/// Where a request's KV waits on the prefill: its answer's `kv_transfer_params`, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvSource {
    /// The prefill engine (`remote_engine_id`).
    pub engine_id: String,
    /// The id the KV waits under (`remote_request_id`), which the notification names.
    pub request_id: String,
    /// The request's blocks, in prompt order (one KV group).
    pub block_ids: Vec<u64>,
    /// The side channel's port (`remote_port`: vLLM's base port plus the DP rank).
    pub port: u16,
    /// Prefill TP ranks, each holding its share of the KV heads.
    pub tp_size: u32,
    /// Prompt tokens whose KV the prefill computed (`remote_num_tokens`).
    pub tokens: u64,
}

#[derive(Deserialize)]
struct Params {
    do_remote_prefill: Option<bool>,
    remote_block_ids: Option<Vec<Vec<u64>>>,
    remote_engine_id: Option<String>,
    remote_request_id: Option<String>,
    remote_port: Option<u16>,
    tp_size: Option<u32>,
    pp_size: Option<u32>,
    dcp_size: Option<u32>,
    remote_num_tokens: Option<u64>,
    transfer_mode: Option<String>,
}

fn malformed(s: impl Into<String>) -> VllmError {
    VllmError::Malformed(s.into())
}

fn present<T>(v: Option<T>, name: &str) -> Result<T, VllmError> {
    v.ok_or_else(|| malformed(format!("kv_transfer_params without {name}")))
}

impl KvSource {
    /// The KV source in `answer`, the prefill's JSON answer to the request sent with
    /// `X-Request-Id: request`: vLLM's id for it is `cmpl-<request>-<prompt>-<8 hex>`, and
    /// an answer under any other is refused.
    pub fn from_answer(answer: &Value, request: &str) -> Result<Self, VllmError> {
        let params = match answer.get("kv_transfer_params") {
            None | Some(Value::Null) => {
                return Err(malformed(
                    "the prefill answered without kv_transfer_params: is it vLLM with the NixlConnector (--kv-transfer-config)?",
                ));
            }
            Some(p) => p,
        };
        let p = Params::deserialize(params)
            .map_err(|e| malformed(format!("kv_transfer_params: {e}")))?;
        if p.do_remote_prefill != Some(true) {
            return Err(malformed("kv_transfer_params do not offer the KV (do_remote_prefill)"));
        }
        let unsupported = |s: String| Err(VllmError::Unsupported(s));
        if let Some(mode) = p.transfer_mode.as_deref().filter(|m| *m != "pull") {
            return unsupported(format!("transfer_mode {mode:?} (this decode reads: pull)"));
        }
        for (name, n) in [("pp_size", p.pp_size), ("dcp_size", p.dcp_size)] {
            if let Some(n) = n.filter(|&n| n != 1) {
                return unsupported(format!("{name} {n} (this decode reads 1)"));
            }
        }
        let tp_size = present(p.tp_size, "tp_size")?;
        if !(1..=MAX_RANKS).contains(&tp_size) {
            return unsupported(format!("tp_size {tp_size} (1 to {MAX_RANKS})"));
        }
        let mut groups = present(p.remote_block_ids, "remote_block_ids")?;
        if groups.len() != 1 {
            return unsupported(format!("{} KV groups (this decode reads one)", groups.len()));
        }
        let block_ids = groups.remove(0);
        if block_ids.len() > MAX_BLOCKS {
            return Err(malformed(format!("{} blocks (at most {MAX_BLOCKS})", block_ids.len())));
        }
        let id = |v: Option<String>, name: &str| -> Result<String, VllmError> {
            let v = present(v, name)?;
            if v.is_empty() || v.len() > MAX_ID {
                return Err(malformed(format!("{name} of {} bytes", v.len())));
            }
            Ok(v)
        };
        let request_id = id(p.remote_request_id, "remote_request_id")?;
        if !request_id.starts_with(&format!("cmpl-{request}-")) {
            return Err(malformed(format!(
                "remote_request_id {request_id:?} is not for request {request:?}"
            )));
        }
        let port = present(p.remote_port, "remote_port")?;
        if port == 0 {
            return Err(malformed("remote_port 0"));
        }
        Ok(KvSource {
            engine_id: id(p.remote_engine_id, "remote_engine_id")?,
            request_id,
            block_ids,
            port,
            tp_size,
            tokens: present(p.remote_num_tokens, "remote_num_tokens")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An answer as vLLM 0.33's `request_finished` fills it (`pull_scheduler.py`).
    fn answer(extra: Value) -> Value {
        let mut params = json!({
            "do_remote_prefill": true, "do_remote_decode": false,
            "remote_block_ids": [[4, 9, 2]], "remote_engine_id": "eng-1",
            "remote_request_id": "cmpl-r42-0-1a2b3c4d", "remote_host": "localhost",
            "remote_port": 5601, "tp_size": 2, "dcp_size": 1, "pp_size": 1,
            "remote_num_tokens": 40, "remote_blocks_expiry_time": null,
            "remote_registration_generation": 0, "transfer_mode": "pull",
        });
        for (k, v) in extra.as_object().unwrap() {
            params[k] = v.clone();
        }
        json!({"id": "cmpl-r42", "choices": [{"text": "x"}], "kv_transfer_params": params})
    }

    #[test]
    fn vllms_answer_names_the_blocks_and_the_side_channel() {
        let s = KvSource::from_answer(&answer(json!({})), "r42").unwrap();
        assert_eq!(s.block_ids, vec![4, 9, 2]);
        assert_eq!((s.port, s.tp_size, s.tokens), (5601, 2, 40));
        assert_eq!((s.engine_id.as_str(), s.request_id.as_str()), ("eng-1", "cmpl-r42-0-1a2b3c4d"));
        let body = prefill_request(&[1, 2, 3]);
        assert_eq!(body["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert_eq!((body["max_tokens"].as_u64(), body["stream"].as_bool()), (Some(1), Some(false)));
    }

    #[test]
    fn answers_this_decode_cannot_use_are_refused_with_the_reason() {
        let cases = [
            (json!({"do_remote_prefill": false}), "do_remote_prefill"),
            (json!({"remote_block_ids": [[1], [2]]}), "2 KV groups"),
            (json!({"tp_size": 0}), "tp_size 0"),
            (json!({"tp_size": 1000}), "tp_size 1000"),
            (json!({"pp_size": 2}), "pp_size 2"),
            (json!({"dcp_size": 2}), "dcp_size 2"),
            (json!({"transfer_mode": "push"}), "push"),
            (json!({"remote_port": 0}), "remote_port 0"),
            (json!({"remote_port": 70000}), "kv_transfer_params"),
            (json!({"remote_request_id": "cmpl-other-0-1a2b3c4d"}), "not for request"),
            (json!({"remote_request_id": "x-cmpl-r42-0-1a2b3c4d"}), "not for request"),
            (json!({"remote_request_id": ""}), "0 bytes"),
            (json!({"remote_block_ids": "all"}), "kv_transfer_params"),
            (json!({"remote_num_tokens": null}), "remote_num_tokens"),
        ];
        for (extra, want) in cases {
            let e = KvSource::from_answer(&answer(extra.clone()), "r42").unwrap_err().to_string();
            assert!(e.contains(want), "{extra}: {e}");
        }
        let none = KvSource::from_answer(&json!({"choices": []}), "r42").unwrap_err();
        assert!(none.to_string().contains("NixlConnector"), "{none}");
    }
}
