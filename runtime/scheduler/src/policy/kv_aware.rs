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

pub(super) fn pick(req: &Request<'_>, w: &KvAwareWeights) -> usize {
    let cost = |c: &Candidate| {
        let left = req.prompt_tokens.saturating_sub(c.overlap_blocks * req.page_size) as f64;
        (left + c.send_tokens as f64) * w.prefill + c.queued_tokens as f64 * w.load
    };
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
    let (mut best, mut best_cost) = (start, cost(&req.candidates[start]));
    for i in (start + 1..n).chain(0..start) {
        let c = &req.candidates[i];
        let ca = cost(c);
        if ca < best_cost || (ca == best_cost && c.in_flight < req.candidates[best].in_flight) {
            (best, best_cost) = (i, ca);
        }
    }
    best
}
