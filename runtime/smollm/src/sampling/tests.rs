use super::*;

/// A temperature too small to divide by samples greedily: dividing overflowed the logits to
/// infinities, every probability became NaN, and the last candidate (the least likely) won.
#[test]
fn a_vanishing_temperature_is_greedy() {
    let logits = [1.0, 5.0, 3.0, -2.0];
    for temperature in [1e-38, 1e-30, 1e-6, 0.0] {
        let s = Sampling { temperature, top_p: 1.0, top_k: 0, seed: 7 };
        for index in 0..8 {
            assert_eq!(sample(&logits, &s, index), 1, "temperature {temperature}");
        }
    }
    // A real temperature still samples (and only among the candidates).
    let s = Sampling { temperature: 1.0, top_p: 1.0, top_k: 0, seed: 7 };
    assert!((0..64).map(|i| sample(&logits, &s, i)).any(|t| t != 1));
}

/// The sampler as it was: the whole vocabulary sorted for every token. What it draws is the
/// reference for the shapes that still walk candidates most likely first (top-k, top-p).
fn full_sort_reference(logits: &[f32], s: &Sampling, index: u64) -> u32 {
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
        probs.truncate(keep.map_or(probs.len(), |k| k + 1));
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

/// Logits shaped like a model's over its 49,152 tokens: a few likely, a long flat tail.
fn vocabulary_logits(seed: u64, spread: f32) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..49_152).map(|_| rng.random::<f32>().powi(8) * spread).collect()
}

/// Top-k and top-p draw the very token the full sort drew, where the few likely tokens hold
/// most of the mass (as a model's logits mostly do). In a long flat tail the two sum the
/// same weights in another order, and a draw there may land one token over.
#[test]
fn top_k_and_top_p_draw_what_the_full_sort_drew() {
    let shapes =
        [(1.0, 1.0, 40), (0.7, 0.9, 0), (1.0, 0.99, 1000), (1.5, 0.5, 7), (1.0, 1.0, 49_151)];
    for (seed, spread) in [(1, 30.0), (2, 40.0)] {
        let logits = vocabulary_logits(seed, spread);
        for (temperature, top_p, top_k) in shapes {
            let s = Sampling { temperature, top_p, top_k, seed };
            let differ = (0..200)
                .filter(|&i| sample(&logits, &s, i) != full_sort_reference(&logits, &s, i))
                .count();
            assert!(differ <= 1, "{s:?} spread {spread}: {differ} of 200 draws differ");
        }
    }
}

/// The nucleus is the full sort's shortest prefix reaching the mass, summed in the same
/// order, whether it holds a few tokens or most of the vocabulary (the sorted prefix grown
/// several times), or the mass is never reached.
#[test]
fn the_nucleus_is_the_full_sorts_prefix() {
    for (seed, spread) in [(1, 30.0), (2, 8.0), (3, 2.0), (4, 0.0)] {
        let logits = vocabulary_logits(seed, spread);
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let all: Vec<Candidate> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| Candidate { id: i as u32, logit: l, weight: (l - max).exp() })
            .collect();
        let total: f32 = all.iter().map(|c| c.weight).sum();
        let mut sorted = all.clone();
        sorted.sort_by(likelier);
        for share in [0.1, 0.5, 0.9, 0.999, 2.0] {
            let mut cand = all.clone();
            let keep = nucleus(&mut cand, total * share);
            let mut acc = 0.0f32;
            let want = sorted
                .iter()
                .position(|c| {
                    acc += c.weight;
                    acc >= total * share
                })
                .map_or(sorted.len(), |k| k + 1);
            assert_eq!(keep, want, "spread {spread}, share {share}");
            let ids = |c: &[Candidate]| c.iter().map(|c| c.id).collect::<Vec<_>>();
            assert_eq!(ids(&cand[..keep]), ids(&sorted[..keep]), "spread {spread}, share {share}");
        }
    }
}

/// Temperature alone draws each token with its softmax probability, also when the
/// vocabulary is walked in token order.
#[test]
fn temperature_alone_draws_by_probability() {
    let logits = [0.0, 2.0, 1.0, -1.0, 2.0, 0.5];
    let s = Sampling { temperature: 0.8, top_p: 1.0, top_k: 0, seed: 11 };
    let weights: Vec<f64> = logits.iter().map(|&l| (f64::from(l) / 0.8).exp()).collect();
    let total: f64 = weights.iter().sum();
    let draws = 60_000;
    let mut counts = [0usize; 6];
    for i in 0..draws {
        counts[sample(&logits, &s, i) as usize] += 1;
    }
    for (t, &c) in counts.iter().enumerate() {
        let expected = weights[t] / total * draws as f64;
        let sd = (expected * (1.0 - weights[t] / total)).sqrt();
        assert!(
            (c as f64 - expected).abs() < 5.0 * sd,
            "token {t}: {c} draws, expected {expected:.0} ± {sd:.0}"
        );
    }
}

/// Only the nucleus is ever drawn: the most likely tokens whose mass reaches top_p.
#[test]
fn top_p_draws_only_the_nucleus() {
    // Probabilities 0.5, 0.25, 0.125, ... : top_p 0.8 keeps the first three.
    let logits: Vec<f32> = (0..12).map(|i| -(i as f32) * std::f32::consts::LN_2).collect();
    let s = Sampling { temperature: 1.0, top_p: 0.8, top_k: 0, seed: 5 };
    let mut seen = std::collections::BTreeSet::new();
    for i in 0..4_000 {
        seen.insert(sample(&logits, &s, i));
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), [0, 1, 2]);
}
