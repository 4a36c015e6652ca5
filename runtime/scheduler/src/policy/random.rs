//! `random`: uniformly at random.

use super::Request;

pub(super) fn pick(req: &Request<'_>) -> usize {
    rand::random_range(0..req.candidates.len())
}
