//! Selection policies, one file each, chosen by [`PolicyKind`].

mod kv_aware;
mod power_of_two;
mod prefix_hash;
mod random;
mod round_robin;

use handoff_core::BlockHash;
use handoff_kv_index::Slot;

pub use kv_aware::KvAwareWeights;
pub(crate) use kv_aware::cost as kv_aware_cost;

/// Which policy picks the prefill.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum PolicyKind {
    /// Least cost: prefill tokens left after the cached overlap, plus queued tokens.
    #[default]
    KvAware,
    /// Each candidate in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// The less loaded of two random candidates.
    PowerOfTwo,
    /// Consistent hashing of the prompt's first block, skipping candidates loaded beyond a
    /// factor of the mean.
    PrefixHash,
}

/// One (instance, dp rank) a request could go to.
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// Where: the (instance, dp rank) in this index slot.
    pub slot: Slot,
    /// Its point on the prefix_hash ring (a hash of its instance and dp rank).
    pub ring: u64,
    /// Leading prompt blocks it holds.
    pub overlap_blocks: u32,
    /// Prefill tokens already queued on it.
    pub queued_tokens: u64,
    /// Requests in flight on it.
    pub in_flight: u32,
    /// What this request's KV would take to leave it after the compute beyond the best
    /// candidate's link and its noise (see the scheduler's selection), in prompt tokens of its
    /// compute: a slow link prices like a longer prompt.
    pub send_tokens: u64,
}

/// Everything a policy sees of one request.
#[derive(Debug)]
pub struct Request<'a> {
    /// Where it could go.
    pub candidates: &'a [Candidate],
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Tokens per block.
    pub page_size: usize,
    /// The prompt's chained block hashes.
    pub hashes: &'a [BlockHash],
    /// Advances on every request (rotation, tie-breaks).
    pub tick: usize,
}

/// Tunables of the policies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyParams {
    /// kv_aware weights and temperature.
    pub kv_aware: KvAwareWeights,
    /// prefix_hash: a candidate whose queued tokens exceed this factor of the mean (plus one
    /// prompt) is skipped for the next on the ring.
    pub load_factor: f64,
}

impl Default for PolicyParams {
    fn default() -> Self {
        PolicyParams { kv_aware: KvAwareWeights::default(), load_factor: 1.5 }
    }
}

impl PolicyKind {
    /// Picks a candidate's index, `None` when there are none.
    pub fn pick(self, req: &Request<'_>, params: &PolicyParams) -> Option<usize> {
        if req.candidates.is_empty() {
            return None;
        }
        Some(match self {
            PolicyKind::KvAware => kv_aware::pick(req, &params.kv_aware),
            PolicyKind::RoundRobin => round_robin::pick(req),
            PolicyKind::Random => random::pick(req),
            PolicyKind::PowerOfTwo => power_of_two::pick(req),
            PolicyKind::PrefixHash => prefix_hash::pick(req, params.load_factor),
        })
    }
}

#[cfg(test)]
mod tests;
