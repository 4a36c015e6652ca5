//! `prefix_hash`: consistent hashing. Candidates sit on a ring at the hash of their (instance,
//! dp rank); a prompt goes to the first candidate at or after the hash of its first block, so
//! prompts sharing a first block share a candidate while the fleet changes little. A
//! candidate loaded beyond `load_factor` x the mean queued tokens (plus one prompt) is passed
//! over for the next on the ring. Prompts shorter than a block hash their length instead.

use super::Request;

pub(super) fn pick(req: &Request<'_>, load_factor: f64) -> usize {
    let key = req.hashes.first().map_or(req.prompt_tokens as u64, |h| h.0);
    let mut ring: Vec<(u64, usize)> =
        req.candidates.iter().enumerate().map(|(i, c)| (c.ring, i)).collect();
    ring.sort_unstable();
    let start = ring.partition_point(|(h, _)| *h < key) % ring.len();
    let mean =
        req.candidates.iter().map(|c| c.queued_tokens as f64).sum::<f64>() / ring.len() as f64;
    let limit = load_factor * mean + req.prompt_tokens as f64;
    (0..ring.len())
        .map(|k| ring[(start + k) % ring.len()].1)
        .find(|&i| req.candidates[i].queued_tokens as f64 <= limit)
        .unwrap_or(ring[start].1)
}
