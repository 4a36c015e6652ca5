//! `round_robin`: each candidate in turn, blind to cache and load.

use super::Candidate;

pub(super) fn pick(candidates: &[Candidate], tick: usize) -> usize {
    tick % candidates.len()
}
