//! Choosing the next token: greedy, or seeded temperature / top-k / top-p. The random draw
//! for the i-th generated token is seeded by (seed, i), so a token is the same whichever
//! process samples it.

use handoff_engine::{GREEDY_BELOW, Sampling};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The `index`-th generated token from `logits`.
pub(crate) fn sample(logits: &[f32], s: &Sampling, index: u64) -> u32 {
    if s.temperature <= GREEDY_BELOW {
        return argmax(logits);
    }
    let mut cand: Vec<(u32, f32)> =
        logits.iter().enumerate().map(|(i, &l)| (i as u32, l / s.temperature)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if s.top_k > 0 {
        cand.truncate(s.top_k as usize);
    }
    let max = cand[0].1;
    let mut probs: Vec<f32> = cand.iter().map(|c| (c.1 - max).exp()).collect();
    let sum: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|p| *p /= sum);
    if s.top_p > 0.0 && s.top_p < 1.0 {
        let mut acc = 0.0;
        let keep = probs.iter().position(|p| {
            acc += p;
            acc >= s.top_p
        });
        let keep = keep.map_or(probs.len(), |k| k + 1);
        probs.truncate(keep);
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|p| *p /= sum);
    }
    let mut rng = StdRng::seed_from_u64(s.seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut x: f32 = rng.random();
    for (i, p) in probs.iter().enumerate() {
        if x < *p {
            return cand[i].0;
        }
        x -= p;
    }
    cand[probs.len() - 1].0
}

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &l) in logits.iter().enumerate() {
        if l > logits[best] {
            best = i;
        }
    }
    best as u32
}

#[cfg(test)]
mod tests;
