//! The control wire between handoff's nixl agents: one JSON message per TCP connection to a
//! peer's advertised address, `[u32 LE length][JSON]`, answered by one [`Reply`]. It carries
//! what NIXL does not: the handshake (where a room's KV lands, and the receiver's NIXL
//! metadata) and the completion notice, whose answer is the receiver's verdict.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::{AgentAddr, ConnectRequest, Notice, RegionId, TransferError};

/// Longest control message: a receiver's metadata grows by a few dozen bytes per open region.
pub(super) const MAX_MESSAGE: usize = 4 << 20;

/// A request on the control wire.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "handoff", rename_all = "snake_case")]
pub(super) enum Control {
    /// Receiver to sender: where a room's KV must land: `req.region_len` bytes from `addr` in
    /// the memory of the agent `introduction` (hex: its address, no memory) names, reached by
    /// the key in `metadata` (hex: the staging arena's). `ticket` is this sender's alone.
    Connect { req: ConnectRequest, introduction: String, metadata: String, addr: u64, ticket: u64 },
    /// Sender to receiver, after its WRITEs completed: its notice, the (offset, length) of
    /// every segment it wrote into the region, and the ticket its handshake gave it.
    Notice {
        region: RegionId,
        ticket: u64,
        notice: Notice,
        segments: Vec<(u64, u64)>,
        token: Option<String>,
    },
}

impl Control {
    /// The cluster token the message carries.
    pub(super) fn token(&self) -> Option<&str> {
        match self {
            Control::Connect { req, .. } => req.token.as_deref(),
            Control::Notice { token, .. } => token.as_deref(),
        }
    }
}

/// The answer to a [`Control`] message.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub(super) enum Reply {
    /// Accepted (a handshake) or verified (a notice).
    Done,
    /// Refused, and why.
    Refused { reason: String },
}

impl From<Result<(), TransferError>> for Reply {
    fn from(r: Result<(), TransferError>) -> Self {
        match r {
            Ok(()) => Reply::Done,
            Err(e) => Reply::Refused { reason: e.to_string() },
        }
    }
}

pub(super) async fn write_message<W: AsyncWrite + Unpin, T: Serialize>(
    w: &mut W,
    msg: &T,
) -> std::io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(std::io::Error::other)?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).await
}

pub(super) async fn read_message<R: AsyncRead + Unpin, T: for<'de> Deserialize<'de>>(
    r: &mut R,
) -> Result<T, TransferError> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)
        .await
        .map_err(|e| TransferError::Malformed(format!("nixl control: {e}")))?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MESSAGE {
        return Err(TransferError::Malformed(format!(
            "nixl control message of {len} bytes (at most {MAX_MESSAGE})"
        )));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body)
        .await
        .map_err(|e| TransferError::Malformed(format!("nixl control: {e}")))?;
    serde_json::from_slice(&body)
        .map_err(|e| TransferError::Malformed(format!("nixl control: {e}")))
}

/// Sends `msg` to `peer` and reads its answer, all within `timeout`.
pub(super) async fn call(
    peer: &AgentAddr,
    msg: &Control,
    timeout: std::time::Duration,
) -> Result<(), TransferError> {
    let io = |reason: String| TransferError::Io { peer: peer.clone(), reason };
    let exchange = async {
        let mut st = TcpStream::connect((peer.ip.as_str(), peer.port))
            .await
            .map_err(|e| io(format!("connect: {e}")))?;
        let _ = st.set_nodelay(true);
        write_message(&mut st, msg).await.map_err(|e| io(format!("send: {e}")))?;
        read_message::<_, Reply>(&mut st).await
    };
    match tokio::time::timeout(timeout, exchange).await {
        Err(_) => Err(TransferError::Timeout(format!("nixl control exchange with {peer}"))),
        Ok(Err(e)) => Err(e),
        Ok(Ok(Reply::Done)) => Ok(()),
        Ok(Ok(Reply::Refused { reason })) => Err(TransferError::refused(reason)),
    }
}

/// Bytes as lowercase hex.
pub(super) fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 15)] as char);
    }
    s
}

/// Hex back into bytes.
pub(super) fn unhex(s: &str) -> Result<Vec<u8>, TransferError> {
    let digit = |c: u8| -> Result<u8, TransferError> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            _ => Err(TransferError::Malformed("nixl metadata is not lowercase hex".into())),
        }
    };
    let s = s.as_bytes();
    if !s.len().is_multiple_of(2) {
        return Err(TransferError::Malformed("nixl metadata of odd hex length".into()));
    }
    s.chunks(2).map(|p| Ok(digit(p[0])? << 4 | digit(p[1])?)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hex_round_trips_and_refuses_bad_digits() {
        let bytes: Vec<u8> = (0..=255).collect();
        assert_eq!(unhex(&hex(&bytes)).unwrap(), bytes);
        assert!(unhex("0g").is_err());
        assert!(unhex("abc").is_err());
        assert!(unhex("AB").is_err());
    }

    #[tokio::test]
    async fn an_oversized_message_is_refused_before_it_is_read() {
        let mut wire = Vec::new();
        wire.extend_from_slice(&((MAX_MESSAGE + 1) as u32).to_le_bytes());
        let got = read_message::<_, Reply>(&mut wire.as_slice()).await;
        assert!(matches!(got, Err(TransferError::Malformed(m)) if m.contains("at most")));
    }
}
