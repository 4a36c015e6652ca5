//! `power_of_two`: two distinct candidates at random, the less loaded wins (queued tokens,
//! then requests in flight).

use super::Request;

pub(super) fn pick(req: &Request<'_>) -> usize {
    let n = req.candidates.len();
    if n == 1 {
        return 0;
    }
    let a = rand::random_range(0..n);
    let b = (a + rand::random_range(1..n)) % n;
    let load = |i: usize| (req.candidates[i].queued_tokens, req.candidates[i].in_flight);
    if load(b) < load(a) { b } else { a }
}
