//! The KV transfer seam, shaped like NIXL and Mooncake.
//!
//! A receiver (the decode) registers a memory region per room and tells each sender rank (a
//! prefill rank) where the room's KV must land ([`ConnectRequest`], the handshake). The
//! sender posts a write: a list of (source bytes, destination offset) pairs followed by a
//! completion [`Notice`] that carries the room, first token, token counts and a checksum.
//! The receiver verifies every notice's room and checksum against what it registered and
//! received before the region reaches [`KvPoll::Success`]; nothing else is handed on.
//!
//! - [`TransferBackend`] (this file): the seam a backend implements: move a handshake and a
//!   write to a peer. A new backend (real NIXL, Mooncake) is one file implementing it.
//! - [`inbox`] — the receiving side every backend delivers into: regions, verification,
//!   states, and the sender's table of pending handshakes. Bounded.
//! - [`agent`] — [`Agent`], a backend plus its inbox: what ranks and the frontend use.
//! - [`stream`] — [`WriteStream`]: one write posted in parts as they are computed, one notice
//!   over them all.
//! - [`tcp`] — real bytes over TCP sockets, pooled connections, length-prefixed frames.
//! - [`mooncake`] — Mooncake Transfer Engine's TCP wire, compatible with its wheel.
//! - [`nixl`] — NIXL WRITEs through its C API (UCX underneath), a control wire beside them.
//! - [`fake`] — in-process, no sockets: for control-plane tests and single-process setups.
//! - [`faulty`] — a wrapper that injects faults into any backend (wrong room, flipped byte,
//!   truncated frame, sender gone mid-transfer).

pub mod agent;
mod error;
pub mod fake;
pub mod faulty;
pub(crate) mod idle;
pub mod inbox;
mod listen;
pub mod mooncake;
pub mod nixl;
pub mod stream;
pub mod tcp;

use std::fmt;

use async_trait::async_trait;
use bytes::Bytes;
use handoff_core::Room;
use serde::{Deserialize, Serialize};

pub use agent::{Agent, TransferKind};
pub use error::TransferError;
pub use fake::{FakeNetwork, FakeTransfer};
pub use faulty::{Fault, FaultSwitch, FaultyTransfer};
pub use inbox::{Inbox, InboxConfig, Received};
pub use stream::{MAX_SEGMENT, NoticeSums, StreamConn, WriteStream};
pub use tcp::TcpTransfer;

/// A transfer endpoint, as a bootstrap directory publishes it (`rank_ip`, `rank_port`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct AgentAddr {
    /// IP address.
    pub ip: String,
    /// Port.
    pub port: u16,
}

impl fmt::Display for AgentAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.ip.contains(':') {
            write!(f, "[{}]:{}", self.ip, self.port)
        } else {
            write!(f, "{}:{}", self.ip, self.port)
        }
    }
}

/// State of a room's transfer, numbered as SGLang's `KVPoll`. Only moves forward; `Failed`
/// is terminal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum KvPoll {
    /// Terminal failure.
    Failed = 0,
    /// Registered, no handshake yet.
    Bootstrapping = 1,
    /// Handshake done, waiting for bytes.
    WaitingForInput = 2,
    /// Bytes arriving.
    Transferring = 3,
    /// Every expected notice arrived and verified.
    Success = 4,
}

/// A receive region's id, minted by the receiver: 64 random bits, told only to the region's
/// senders in their (authenticated) handshakes, so nobody else can name the region.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RegionId(pub u64);

/// The connection (or in-process peer) a write or notice arrived over. A region's sender is
/// bound to the connection of its first write; anything it sends over another is refused.
/// Each backend numbers its own (an inbox serves one backend): tcp counts from 1 and sets
/// bit 63 on its shared-memory connections; mooncake's and nixl's peer ids set bit 63 too.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ConnId(pub u64);

/// Which rank of a prefill instance sent something: its (tp, pp) ranks packed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SenderId(pub u32);

impl SenderId {
    /// The id of prefill rank (`tp`, `pp`).
    pub fn new(tp: u16, pp: u16) -> Self {
        SenderId(u32::from(pp) << 16 | u32::from(tp))
    }
}

/// Where a room's KV must land: sent by the receiver to each sender rank it reads from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectRequest {
    /// The room this destination belongs to.
    pub room: Room,
    /// The receiver's endpoint.
    pub receiver: AgentAddr,
    /// The receiver's region for this room.
    pub region: RegionId,
    /// Region size in bytes.
    pub region_len: u64,
    /// Receiver (decode) tp size.
    pub dst_tp_size: u32,
    /// Receiver (decode) tp rank this region belongs to.
    pub dst_tp_rank: u32,
    /// Prompt tokens the region holds.
    pub tokens: u32,
    /// Bearer token, required by senders that are configured with one.
    pub token: Option<String>,
}

/// The completion notice of one sender's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Notice {
    /// The room the sender computed this KV for.
    pub room: Room,
    /// Which sender rank.
    pub sender: SenderId,
    /// First generated token.
    pub first_token: u32,
    /// Prompt tokens the KV covers.
    pub tokens: u32,
    /// Of those, tokens that came from the sender's prefix cache.
    pub cached_tokens: u32,
    /// Bytes written before this notice.
    pub bytes: u64,
    /// The wrapping sum of each written segment's xxh3-64 over its offset, length and bytes
    /// ([`inbox::placement::segment_digest`]): it binds where bytes landed as well as what
    /// they are, in any arrival order.
    pub checksum: u64,
}

/// A write: (source bytes, destination offset) pairs into `region`, then `notice`.
#[derive(Debug, Clone)]
pub struct WriteRequest {
    /// Destination region.
    pub region: RegionId,
    /// The sending rank.
    pub sender: SenderId,
    /// Source bytes and where each lands in the region, each at most [`MAX_SEGMENT`] bytes
    /// (as [`WriteRequest::new`] makes them): tcp refuses to send a pair its frames cannot
    /// hold.
    pub pairs: Vec<(Bytes, u64)>,
    /// Sent after every pair; `None` posts bytes without a notification.
    pub notice: Option<Notice>,
}

impl WriteRequest {
    /// Builds a write and its notice, computing bytes and checksum over `pairs` in order (as
    /// the receiver hashes them: offset, length, bytes), a pair longer than [`MAX_SEGMENT`]
    /// split into several segments first.
    pub fn new(
        region: RegionId,
        pairs: Vec<(Bytes, u64)>,
        room: Room,
        sender: SenderId,
        first_token: u32,
        tokens: u32,
        cached_tokens: u32,
    ) -> Self {
        let pairs = stream::segments(pairs);
        let mut sums = NoticeSums::default();
        sums.add_pairs(&pairs);
        let NoticeSums { bytes, checksum } = sums;
        let notice = Notice { room, sender, first_token, tokens, cached_tokens, bytes, checksum };
        WriteRequest { region, sender, pairs, notice: Some(notice) }
    }
}

/// Whether `got` is the token `want` asks for (anything, when `want` is `None`), compared in
/// time independent of where they differ.
pub(crate) fn token_accepted(want: Option<&str>, got: Option<&[u8]>) -> bool {
    let Some(want) = want.map(str::as_bytes) else { return true };
    let got = got.unwrap_or_default();
    got.len() == want.len() && got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
}

/// A transfer backend: moves handshakes and writes to peers' inboxes.
#[async_trait]
pub trait TransferBackend: Send + Sync + 'static {
    /// Short name for logs (`tcp`, `fake`, ...).
    fn name(&self) -> &'static str;

    /// This agent's endpoint, as published in a directory.
    fn local_addr(&self) -> AgentAddr;

    /// The handshake: tells the sender at `peer` where a room's KV must land. Returns once
    /// the peer accepted it (or refused it: bad token, table full).
    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError>;

    /// Writes every pair, then the notice (if any), to the receiver at `peer`. With a notice,
    /// returns once the receiver has verified it (or rejected the write).
    async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError>;

    /// Whether a streamed write's parts may go as writes of their own (each part at once, the
    /// notice alone at the end): true where a receiver binds a sender to its peer rather than
    /// to one connection (mooncake, nixl, fake).
    fn posts_parts(&self) -> bool {
        false
    }

    /// Whether a handshake is nothing more than its [`ConnectRequest`], so that it may ride
    /// in the prefill call instead of [`TransferBackend::connect`] (tcp, fake); false where
    /// connecting also lends or exposes memory (mooncake, nixl).
    fn handshake_in_call(&self) -> bool {
        false
    }

    /// A connection to `peer` dedicated to one streamed write ([`WriteStream`]); `None` (the
    /// default): the parts go as writes of their own when [`TransferBackend::posts_parts`],
    /// else they are held and posted in one write at the stream's end.
    async fn open_stream(
        &self,
        _peer: &AgentAddr,
    ) -> Result<Option<Box<dyn StreamConn>>, TransferError> {
        Ok(None)
    }
}
