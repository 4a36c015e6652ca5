//! Choosing the next token: greedy, or seeded temperature / top-k / top-p. The random draw
//! for the i-th generated token is seeded by (seed, i), so a token is the same whichever
//! process samples it (both running this code).
//!
//! Nothing sorts the whole vocabulary: top-k selects its k candidates in linear time and
//! sorts only those; top-p sorts a prefix of the most likely tokens, growing it until it
//! holds the nucleus's mass; temperature alone, and a top-k of the whole vocabulary or
//! more, draw over the vocabulary in token order (any fixed order draws each token with its
//! probability). The sampler before this one sorted the vocabulary: under top-k or top-p
//! the same seed draws the same token where a few tokens hold most of the mass (the total is
//! summed in another order, so a nucleus's edge or a draw in a long flat tail may fall a
//! token over); temperature alone draws from the same distribution in another order, so the
//! same seed may draw another token than it did.

use std::cmp::Ordering;

use handoff_engine::{GREEDY_BELOW, Sampling};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// A candidate token: its id, its logit over the temperature (what orders candidates) and
/// its weight (unnormalized probability, what draws them).
#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    logit: f32,
    weight: f32,
}

/// The first sorted prefix top-p tries, and the factor it grows by while short of the mass.
const NUCLEUS_FIRST: usize = 64;
const NUCLEUS_GROWTH: usize = 8;

/// The `index`-th generated token from `logits`.
pub(crate) fn sample(logits: &[f32], s: &Sampling, index: u64) -> u32 {
    if s.temperature <= GREEDY_BELOW || logits.is_empty() {
        return argmax(logits);
    }
    let mut cand: Vec<Candidate> = logits
        .iter()
        .enumerate()
        .map(|(i, &l)| Candidate { id: i as u32, logit: l / s.temperature, weight: 0.0 })
        .collect();
    let top_k = s.top_k as usize;
    if top_k > 0 && top_k < cand.len() {
        cand.select_nth_unstable_by(top_k - 1, likelier);
        cand.truncate(top_k);
        cand.sort_unstable_by(likelier);
    }
    let max = cand.iter().map(|c| c.logit).fold(f32::NEG_INFINITY, f32::max);
    for c in &mut cand {
        let w = (c.logit - max).exp();
        c.weight = if w.is_nan() { 0.0 } else { w };
    }
    let mut total: f32 = cand.iter().map(|c| c.weight).sum();
    if s.top_p > 0.0 && s.top_p < 1.0 {
        let keep = nucleus(&mut cand, total * s.top_p);
        cand.truncate(keep);
        total = cand.iter().map(|c| c.weight).sum();
    }
    if !(total > 0.0 && total.is_finite()) {
        return argmax(logits);
    }
    let mut rng = StdRng::seed_from_u64(s.seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let mut x: f32 = rng.random::<f32>() * total;
    for c in &cand {
        if x < c.weight {
            return c.id;
        }
        x -= c.weight;
    }
    // Rounding left a sliver of `x`: the last candidate with any weight.
    cand.iter().rev().find(|c| c.weight > 0.0).map_or_else(|| argmax(logits), |c| c.id)
}

/// Sorts the shortest prefix of `cand`, most likely first, whose weights reach `mass`, and
/// returns its length (all of `cand` if they never do). The prefix grows geometrically,
/// each step a linear-time selection of the rest and a sort of only what it selected.
fn nucleus(cand: &mut [Candidate], mass: f32) -> usize {
    let (mut sorted, mut step, mut acc) = (0, NUCLEUS_FIRST, 0.0f32);
    while sorted < cand.len() {
        let rest = &mut cand[sorted..];
        let take = step.min(rest.len());
        if take < rest.len() {
            rest.select_nth_unstable_by(take - 1, likelier);
        }
        rest[..take].sort_unstable_by(likelier);
        let end = sorted + take;
        for (i, c) in cand[sorted..end].iter().enumerate() {
            acc += c.weight;
            if acc >= mass {
                return sorted + i + 1;
            }
        }
        sorted = end;
        step *= NUCLEUS_GROWTH;
    }
    cand.len()
}

/// The more likely candidate first; equal ones by token id, so the order is total.
fn likelier(a: &Candidate, b: &Candidate) -> Ordering {
    b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id))
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
