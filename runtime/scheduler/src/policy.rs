//! Selection policies, one file each, chosen by [`PolicyKind`].

mod kv_aware;
mod round_robin;

use handoff_kv_index::WorkerKey;

pub use kv_aware::KvAwareWeights;

/// Which policy picks the prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least cost: prefill tokens left after the cached overlap, plus queued tokens.
    #[default]
    KvAware,
    /// Each candidate in turn.
    RoundRobin,
}

/// One (instance, dp rank) a request could go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Where.
    pub key: WorkerKey,
    /// Leading prompt blocks it holds.
    pub overlap_blocks: usize,
    /// Prefill tokens already queued on it.
    pub queued_tokens: u64,
    /// Requests in flight on it.
    pub in_flight: u32,
}

impl PolicyKind {
    /// Picks a candidate's index. `tick` advances on every call (for rotation and ties).
    pub fn pick(
        self,
        candidates: &[Candidate],
        prompt_tokens: usize,
        page_size: usize,
        weights: &KvAwareWeights,
        tick: usize,
    ) -> Option<usize> {
        if candidates.is_empty() {
            return None;
        }
        Some(match self {
            PolicyKind::KvAware => {
                kv_aware::pick(candidates, prompt_tokens, page_size, weights, tick)
            }
            PolicyKind::RoundRobin => round_robin::pick(candidates, tick),
        })
    }
}
