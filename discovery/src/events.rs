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
}
