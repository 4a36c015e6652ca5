//! The side channel: a vLLM prefill worker's ZMQ ROUTER (`VLLM_NIXL_SIDE_CHANNEL_HOST`,
//! port `VLLM_NIXL_SIDE_CHANNEL_PORT` + dp index). The decode asks over a REQ socket with
//! `[b"get_meta_msg", pp_rank, tp_rank]` in msgpack; the answer is two frames: the encoded
//! `NixlHandshakePayload` and the prefill's `perf_counter()` (for a clock-offset estimate;
//! not used here).

use std::time::Duration;

use bytes::Bytes;
use handoff_core::zmtp::Connection;
use handoff_transfer::nixl::NixlReader;
use rmpv::Value;

use crate::{Handshake, VllmError};

/// vLLM's `GET_META_MSG`.
const GET_META_MSG: &[u8] = b"get_meta_msg";

/// A prefill worker this decode's NIXL agent can read from.
#[derive(Debug, Clone)]
pub struct Peer {
    /// The prefill worker's NIXL agent name, as loaded into ours.
    pub agent: String,
    /// What its handshake said.
    pub handshake: Handshake,
}

/// The request frame for (`pp_rank`, `tp_rank`).
pub fn request(pp_rank: u32, tp_rank: u32) -> Vec<u8> {
    let msg =
        Value::Array(vec![Value::Binary(GET_META_MSG.to_vec()), pp_rank.into(), tp_rank.into()]);
    let mut out = Vec::new();
    // Writing into a Vec cannot fail.
    let _ = rmpv::encode::write_value(&mut out, &msg);
    out
}

/// Asks the side channel at `host:port` for worker (`pp_rank`, `tp_rank`)'s metadata.
pub async fn ask(
    host: &str,
    port: u16,
    pp_rank: u32,
    tp_rank: u32,
    timeout: Duration,
) -> Result<Handshake, VllmError> {
    let addr = handoff_core::net::host_port(host, port);
    let side = |reason: String| VllmError::SideChannel { addr: addr.clone(), reason };
    let exchange = async {
        let mut sock = Connection::connect(&addr, b"REQ", b"ROUTER")
            .await
            .map_err(|e| side(format!("connect: {e}")))?;
        // A REQ's message opens with an empty delimiter frame, and so does the answer.
        let ask = [Bytes::new(), Bytes::from(request(pp_rank, tp_rank))];
        sock.send(&ask).await.map_err(|e| side(format!("send: {e}")))?;
        let frames = sock.recv().await.map_err(|e| side(format!("receive: {e}")))?;
        match frames.as_slice() {
            [delimiter, payload, _clock] if delimiter.is_empty() => Handshake::decode(payload),
            other => Err(VllmError::Malformed(format!(
                "{} frames (a delimiter and 2 expected)",
                other.len()
            ))),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(r) => r,
        Err(_) => Err(side(format!("no answer within {timeout:?}"))),
    }
}

/// Handshakes with worker (`pp_rank`, `tp_rank`) of the prefill at `host:port` and loads its
/// agent's metadata into `nixl`'s agent.
pub async fn connect(
    nixl: &NixlReader,
    host: &str,
    port: u16,
    pp_rank: u32,
    tp_rank: u32,
    timeout: Duration,
) -> Result<Peer, VllmError> {
    let handshake = ask(host, port, pp_rank, tp_rank, timeout).await?;
    let agent = nixl.load_peer(&handshake.metadata.agent_metadata)?;
    Ok(Peer { agent, handshake })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_request_is_the_bytes_vllm_sends() {
        // Captured from vLLM 0.33's decoder (../shared/interop/nixl.md, section 5).
        let mut want = vec![0x93, 0xc4, 0x0c];
        want.extend_from_slice(b"get_meta_msg");
        want.extend_from_slice(&[0x00, 0x00]);
        assert_eq!(request(0, 0), want);
    }
}
