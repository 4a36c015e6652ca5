//! `kv_aware`: cost = (prefill tokens left after the cached overlap + the KV's time to leave
//! after the compute, in tokens of compute) x `prefill` weight + queued prefill tokens x
//! `load` weight. With `temperature` 0 the cheapest wins (ties: fewest in
//! flight, then rotation); above 0, a candidate is drawn with probability
//! softmax(-cost / (temperature x prompt tokens)), spreading load among near-equals.

use super::{Candidate, Request};

/// Weights of the kv_aware cost.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvAwareWeights {
    /// Weight of the tokens this request would compute there.
    pub prefill: f64,
    /// Weight of the tokens already queued there.
    pub load: f64,
    /// Softmax temperature, relative to the prompt length; 0 picks the cheapest.
    pub temperature: f64,
}

impl Default for KvAwareWeights {
    fn default() -> Self {
        // Load at half the weight of uncached tokens: a cached but busy instance beats a
        // cold idle one until its queue is twice the tokens the request would compute cold.
        // Measured best of 1.0 / 0.5 / 0.25 on two multi-turn shapes (the loadgen note).
        KvAwareWeights { prefill: 1.0, load: 0.5, temperature: 0.0 }
    }
}

/// A token count as a float: one signed conversion (counts past `i64::MAX` saturate), where
/// an unsigned one is several instructions on baseline x86-64 and the scan does two per
/// candidate.
fn tokens(n: u64) -> f64 {
    n.min(i64::MAX as u64) as i64 as f64
}

/// A candidate's cost for a `prompt`-token prompt with pages of `page` tokens.
#[inline]
pub(crate) fn cost(w: &KvAwareWeights, prompt: u64, page: u64, c: &Candidate) -> f64 {
    let left = prompt.saturating_sub(u64::from(c.overlap_blocks) * page);
    tokens(left.saturating_add(c.send_tokens)) * w.prefill + tokens(c.queued_tokens) * w.load
}

pub(super) fn pick(req: &Request<'_>, w: &KvAwareWeights) -> usize {
    let (prompt, page) = (req.prompt_tokens as u64, req.page_size as u64);
    let cost = |c: &Candidate| cost(w, prompt, page, c);
    let n = req.candidates.len();
    if w.temperature > 0.0 {
        let scale = w.temperature * req.prompt_tokens.max(1) as f64;
        let costs: Vec<f64> = req.candidates.iter().map(cost).collect();
        let min = costs.iter().copied().fold(f64::INFINITY, f64::min);
        let weights: Vec<f64> = costs.iter().map(|c| (-(c - min) / scale).exp()).collect();
        let total: f64 = weights.iter().sum();
        let mut x = rand::random::<f64>() * total;
        for (i, wt) in weights.iter().enumerate() {
            if x < *wt {
                return i;
            }
            x -= wt;
        }
        return n - 1;
    }
    // Scan from a rotating start so exact ties spread; strict improvement keeps the first.
    let start = req.tick % n;
    let cands = req.candidates;
    let first = &cands[start];
    let (mut best, mut best_cost, mut best_flight) = (start, cost(first), first.in_flight);
    let mut consider = |i: usize, c: &Candidate| {
        let ca = cost(c);
        if ca < best_cost || (ca == best_cost && c.in_flight < best_flight) {
            (best, best_cost, best_flight) = (i, ca, c.in_flight);
        }
    };
    for (i, c) in cands.iter().enumerate().skip(start + 1) {
        consider(i, c);
    }
    for (i, c) in cands[..start].iter().enumerate() {
        consider(i, c);
    }
    best
}
