//! Mooncake Transfer Engine's TCP wire (as captured from the wheel 0.3.13.post1; see
//! `../shared/interop/mooncake-tcp.md`).
//!
//! - Handshake port (P2P mode): one request frame and one reply frame per connection:
//!   `u64 LE length (1 + JSON) | u8 type | JSON`; the reply carries the request's type.
//! - Data port: a 24-byte header `u64 LE size | u64 LE addr | u8 opcode | 7 padding bytes`,
//!   then for a WRITE `size` bytes; v2 opcodes (flag 0x80) get an 8-byte status back.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::TransferError;

/// Handshake frame types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameType {
    /// RDMA queue-pair setup (not served over TCP).
    Connection = 0,
    /// The segment descriptor.
    Metadata = 1,
    /// A notification message.
    Notify = 2,
    /// A liveness probe.
    Probe = 3,
}

impl FrameType {
    fn from_byte(b: u8) -> Option<Self> {
        Some(match b {
            0 => FrameType::Connection,
            1 => FrameType::Metadata,
            2 => FrameType::Notify,
            3 => FrameType::Probe,
            _ => return None,
        })
    }
}

/// The largest handshake frame accepted (the wheel's default `MC_HANDSHAKE_MAX_LENGTH`).
pub const MAX_HANDSHAKE: u64 = 1 << 20;

/// Reads one handshake frame: its type and JSON body. A body whose first byte is not a type
/// is legacy JSON without one (served as `Connection`, as the wheel does).
pub async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> Result<(FrameType, Vec<u8>), TransferError> {
    let len = r.read_u64_le().await.map_err(|e| bad(format!("handshake length: {e}")))?;
    if !(1..=MAX_HANDSHAKE).contains(&len) {
        return Err(bad(format!("handshake frame of {len} bytes (1 to {MAX_HANDSHAKE})")));
    }
    let mut body = Vec::new();
    r.take(len).read_to_end(&mut body).await.map_err(|e| bad(format!("handshake body: {e}")))?;
    if body.len() as u64 != len {
        return Err(bad(format!("handshake frame cut short: {} of {len} bytes", body.len())));
    }
    Ok(match FrameType::from_byte(body[0]) {
        Some(t) => (t, body.split_off(1)),
        None => (FrameType::Connection, body),
    })
}

/// Encodes one handshake frame (`json` as given; Mooncake's writer ends it with `\n`).
pub fn encode_frame(t: FrameType, json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(9 + json.len());
    out.extend_from_slice(&(1 + json.len() as u64).to_le_bytes());
    out.push(t as u8);
    out.extend_from_slice(json);
    out
}

/// Writes one handshake frame and flushes it.
pub async fn write_frame<W: AsyncWrite + Unpin>(
    w: &mut W,
    t: FrameType,
    json: &[u8],
) -> std::io::Result<()> {
    w.write_all(&encode_frame(t, json)).await?;
    w.flush().await
}

fn bad(reason: String) -> TransferError {
    TransferError::Malformed(format!("mooncake: {reason}"))
}

/// One registered buffer of a segment descriptor.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BufferDesc {
    /// Its address in the owner's address space.
    pub addr: u64,
    /// Its length.
    pub length: u64,
    /// The segment's name.
    pub name: String,
}

/// A segment descriptor for the `tcp` protocol (unknown keys ignored, optional ones
/// defaulted, as the wheel reads them).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SegmentDesc {
    /// Registered buffers.
    #[serde(default)]
    pub buffers: Vec<BufferDesc>,
    /// The segment's name (`host:rpc_port`).
    pub name: String,
    /// `tcp`.
    pub protocol: String,
    /// Empty for tcp.
    #[serde(default)]
    pub rdma_server_name: String,
    /// The data listener's host; absent in older peers (then the segment's host).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp_data_host: Option<String>,
    /// The data listener's port.
    pub tcp_data_port: u16,
    /// 2 when the peer acks writes; absent means 1.
    #[serde(default = "v1")]
    pub tcp_proto_version: u32,
    /// When it was made (informational).
    #[serde(default)]
    pub timestamp: String,
}

fn v1() -> u32 {
    1
}

impl SegmentDesc {
    /// Parses a descriptor, refusing it whole if a buffer is empty or nameless (as the
    /// wheel's decoder does).
    pub fn parse(json: &[u8]) -> Result<Self, TransferError> {
        let d: SegmentDesc =
            serde_json::from_slice(json).map_err(|e| bad(format!("descriptor: {e}")))?;
        if d.protocol != "tcp" {
            return Err(bad(format!("descriptor protocol {:?}, not tcp", d.protocol)));
        }
        if d.buffers.iter().any(|b| b.addr == 0 || b.length == 0 || b.name.is_empty()) {
            return Err(bad("descriptor with an empty or nameless buffer".into()));
        }
        Ok(d)
    }

    /// The JSON the wheel writes (keys sorted, a trailing newline).
    pub fn to_json(&self) -> Vec<u8> {
        json_line(self)
    }
}

/// `value` as compact JSON with sorted keys and a trailing newline (Mooncake's FastWriter).
pub fn json_line<T: Serialize>(value: &T) -> Vec<u8> {
    // serde_json's Value keeps keys sorted (BTreeMap), as FastWriter does.
    let v = serde_json::to_value(value).unwrap_or(serde_json::Value::Null);
    let mut out = serde_json::to_vec(&v).unwrap_or_default();
    out.push(b'\n');
    out
}

/// A notification (`Notify` frames, both ways).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NotifyMsg {
    /// The sender's segment name (empty in replies).
    #[serde(default)]
    pub name: String,
    /// The message.
    pub notify_msg: String,
}

/// The data-path opcodes.
pub const OP_READ: u8 = 0;
/// A write.
pub const OP_WRITE: u8 = 1;
/// Flag of v2 requests (acked with a status).
pub const OP_V2: u8 = 0x80;

/// A data-path request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Payload length.
    pub size: u64,
    /// Absolute address in the target's address space.
    pub addr: u64,
    /// Opcode, with [`OP_V2`] for acked requests.
    pub opcode: u8,
}

/// Bytes of a header on the wire (the C struct with its padding).
pub const HEADER_LEN: usize = 24;

impl Header {
    /// Decodes a header; the padding is ignored.
    pub fn decode(b: &[u8; HEADER_LEN]) -> Self {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        Header { size: word(0), addr: word(8), opcode: b[16] }
    }

    /// Encodes a header, padding zeroed.
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut b = [0u8; HEADER_LEN];
        b[0..8].copy_from_slice(&self.size.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16] = self.opcode;
        b
    }

    /// Whether the request wants a status back.
    pub fn v2(&self) -> bool {
        self.opcode & OP_V2 != 0
    }

    /// Whether it is a write (anything else is a read).
    pub fn is_write(&self) -> bool {
        self.opcode & !OP_V2 == OP_WRITE
    }
}

const STATUS_MAGIC: u64 = 0x4D43_5456 << 32;
/// The status of an applied request.
pub const STATUS_OK: u64 = STATUS_MAGIC;
/// The status of a request whose address range was refused.
pub const STATUS_REJECTED: u64 = STATUS_MAGIC | 1;

/// What a status word says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    /// Applied at the destination.
    Ok,
    /// Refused (out of range, or not served).
    Rejected,
    /// Any other code, or no magic (a legacy or confused peer).
    Unknown(u64),
}

/// Decodes a status word.
pub fn status(word: u64) -> Status {
    match word {
        STATUS_OK => Status::Ok,
        STATUS_REJECTED => Status::Rejected,
        w => Status::Unknown(w),
    }
}

#[cfg(test)]
mod tests;
