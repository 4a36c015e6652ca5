//! `kv_aware`: cost = prefill tokens left after the cached overlap x `prefill` weight + queued
//! prefill tokens x `load` weight. Ties go to the fewest requests in flight, then rotate.

use super::Candidate;

/// Weights of the kv_aware cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvAwareWeights {
    /// Weight of the tokens this request would compute there.
    pub prefill: f64,
    /// Weight of the tokens already queued there.
    pub load: f64,
}

impl Default for KvAwareWeights {
    fn default() -> Self {
        KvAwareWeights { prefill: 1.0, load: 1.0 }
    }
}

pub(super) fn pick(
    candidates: &[Candidate],
    prompt_tokens: usize,
    page_size: usize,
    w: &KvAwareWeights,
    tick: usize,
) -> usize {
    let cost = |c: &Candidate| {
        let left = prompt_tokens.saturating_sub(c.overlap_blocks * page_size) as f64;
        left * w.prefill + c.queued_tokens as f64 * w.load
    };
    let n = candidates.len();
    let mut best = tick % n;
    for off in 1..n {
        let i = (tick + off) % n;
        let (a, b) = (&candidates[i], &candidates[best]);
        let (ca, cb) = (cost(a), cost(b));
        if ca < cb || (ca == cb && a.in_flight < b.in_flight) {
            best = i;
        }
    }
    best
}
