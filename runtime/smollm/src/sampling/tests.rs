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
