//! KV events: what a prefill instance tells the schedulers about the blocks it holds, and
//! the subjects they travel on.

use handoff_core::{BlockHash, InstanceId};
use serde::{Deserialize, Serialize};

/// Subject prefix of KV events; an instance publishes on `{prefix}{instance_id}`.
pub const KV_SUBJECT_PREFIX: &str = "handoff.v1.kv.";

/// The subject of an instance's KV events.
pub fn kv_subject(id: &InstanceId) -> String {
    format!("{KV_SUBJECT_PREFIX}{id}")
}

/// What changed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum KvEventKind {
    /// These blocks (chained hashes, in prefix order) are now cached.
    Stored {
        /// The block before the first one, when it is not the first of its prompt (lets the
        /// index hang the run under its prefix; optional on the wire).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parent: Option<BlockHash>,
        /// The blocks.
        blocks: Vec<BlockHash>,
    },
    /// These blocks were evicted.
    Removed {
        /// The blocks.
        blocks: Vec<BlockHash>,
    },
    /// Everything this dp rank held is gone.
    Cleared,
}

/// One KV event of one (instance, dp rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEvent {
    /// The instance.
    pub instance: InstanceId,
    /// Its dp rank.
    pub dp_rank: u32,
    /// Per-instance sequence number, from 1, without gaps.
    pub seq: u64,
    /// What changed.
    pub kind: KvEventKind,
    /// Which process under the instance's id numbered it: random, fixed for the process's
    /// life, never 0, so another process under the same id (a restart a scheduler never saw
    /// leave) numbers its events apart. Optional on the wire (0: not said, an older version).
    #[serde(default, skip_serializing_if = "is_unsaid")]
    pub incarnation: u64,
}

/// A fresh [`KvEvent::incarnation`] for a process: random, never 0.
pub fn new_incarnation() -> u64 {
    rand::random::<u64>().max(1)
}

fn is_unsaid(incarnation: &u64) -> bool {
    *incarnation == 0
}

/// Subject prefix of heartbeats; an instance publishes on `{prefix}{instance_id}`.
pub const LIVENESS_PREFIX: &str = "handoff.v1.liveness.";

/// The subject of an instance's heartbeats.
pub fn liveness_subject(id: &InstanceId) -> String {
    format!("{LIVENESS_PREFIX}{id}")
}

/// The subject an instance answers KV snapshot requests on.
pub fn snapshot_subject(id: &InstanceId) -> String {
    format!("handoff.v1.kvsnapshot.{id}")
}

/// A heartbeat, with load.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Heartbeat {
    /// The instance.
    pub instance: InstanceId,
    /// Prompt tokens (cached or not) of the requests it serves: waiting, computing or
    /// sending their KV.
    pub queued_tokens: u64,
    /// Requests being served.
    pub running: u32,
    /// Bytes held by the prefix caches.
    pub kv_bytes: u64,
    /// Measured prefill cost, in nanoseconds per computed token (0: not measured yet). The
    /// scheduler prices queue waits with it. Optional on the wire.
    #[serde(default)]
    pub prefill_ns_per_token: u64,
    /// Measured time its KV takes to reach the decodes after the compute, in nanoseconds per
    /// prompt token (0: not measured, or nothing left after the compute). A slow link shows
    /// here. Optional on the wire.
    #[serde(default)]
    pub send_ns_per_token: u64,
    /// Uncached prompt tokens waiting for or in compute, per dp rank (the work ahead of a
    /// request routed there; a prefix pending in an earlier request counted once; empty: not
    /// said). A scheduler adds what of it no replica booked to the bookings, so work it did
    /// not book (a replica's that died, every replica's when this one started) is priced.
    /// Optional on the wire.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dp_queued_tokens: Vec<u64>,
}

impl Heartbeat {
    /// A fixture for tests and benches: `id` idle (nothing queued or running, nothing
    /// cached, costs not measured). Change fields with struct update syntax.
    pub fn fixture(id: InstanceId) -> Heartbeat {
        Heartbeat {
            instance: id,
            queued_tokens: 0,
            running: 0,
            kv_bytes: 0,
            prefill_ns_per_token: 0,
            send_ns_per_token: 0,
            dp_queued_tokens: Vec::new(),
        }
    }
}

/// One page of everything an instance's prefix caches hold, as of KV event `seq`. A
/// snapshot is cut into pages of at most [`crate::snapshot::PAGE_BLOCKS`] blocks, so one
/// holding 10^5..10^6 blocks still travels through a stock nats-server (1 MiB payloads);
/// an unpaged snapshot is page 0 of 1.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvSnapshot {
    /// The instance.
    pub instance: InstanceId,
    /// The last KV event sequence number the snapshot includes.
    pub seq: u64,
    /// The process that numbered those events ([`KvEvent::incarnation`]). Optional on the
    /// wire.
    #[serde(default, skip_serializing_if = "is_unsaid")]
    pub incarnation: u64,
    /// This page's blocks per dp rank, parents before children (ranks with none on this
    /// page are empty; the pages concatenated per rank give the whole list).
    pub dp_blocks: Vec<Vec<BlockHash>>,
    /// The block before each one in its prompt, per dp rank (parallel to `dp_blocks`; lets
    /// the index rebuild its tree compressed). Optional on the wire.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub dp_parents: Vec<Vec<Option<BlockHash>>>,
    /// Which snapshot the page belongs to (ask for the next page by it; 0: unpaged).
    #[serde(default)]
    pub snapshot: u64,
    /// This page's number, from 0.
    #[serde(default)]
    pub page: u32,
    /// How many pages the snapshot has (0 on the wire means 1).
    #[serde(default)]
    pub pages: u32,
}

impl KvSnapshot {
    /// Whether this is the snapshot's last page.
    pub fn is_last(&self) -> bool {
        self.page.saturating_add(1) >= self.pages.max(1)
    }

    /// Blocks on this page.
    pub fn len(&self) -> usize {
        self.dp_blocks.iter().map(Vec::len).sum()
    }

    /// Whether the page holds no block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A scheduler's request for one page of an instance's KV snapshot (the request's payload
/// on [`snapshot_subject`]; an empty payload asks for page 0 of a new snapshot).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotAsk {
    /// The snapshot (from its page 0), or 0 for a new one.
    #[serde(default)]
    pub snapshot: u64,
    /// The page wanted.
    #[serde(default)]
    pub page: u32,
}

/// Subject prefix of scheduler load reports; a replica publishes on `{prefix}{replica}`.
pub const LOAD_PREFIX: &str = "handoff.v1.load.";

/// The subject of a scheduler replica's load reports.
pub fn load_subject(replica: &str) -> String {
    format!("{LOAD_PREFIX}{replica}")
}

/// What one scheduler replica has in flight, so replicas routing the same fleet do not pile
/// onto one instance. Absolute values, not deltas: a lost report is healed by the next.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    /// The replica (random per process).
    pub replica: String,
    /// Its in-flight load per (instance, dp rank); workers it has nothing on are left out.
    pub loads: Vec<WorkerLoad>,
    /// Prompts it routed since its last report, so the others price them as cached where
    /// they went (and do not send the same new prefix to a second cold instance). Optional
    /// on the wire.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub routed: Vec<RoutedPrefix>,
}

/// A prompt routed to an (instance, dp rank) and not yet known to be cached there.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedPrefix {
    /// The instance.
    pub instance: InstanceId,
    /// Its dp rank.
    pub dp_rank: u32,
    /// The prompt's leading block hashes (chained).
    pub blocks: Vec<BlockHash>,
}

/// One replica's load on one (instance, dp rank).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLoad {
    /// The instance.
    pub instance: InstanceId,
    /// Its dp rank.
    pub dp_rank: u32,
    /// Requests in flight.
    pub in_flight: u32,
    /// Prefill tokens queued (uncached work).
    pub queued_tokens: u64,
}

#[cfg(test)]
mod tests;
