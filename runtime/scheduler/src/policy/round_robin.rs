//! `round_robin`: each candidate in turn, blind to cache and load.

use super::Request;

pub(super) fn pick(req: &Request<'_>) -> usize {
    req.tick % req.candidates.len()
}
