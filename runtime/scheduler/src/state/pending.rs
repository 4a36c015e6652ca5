//! Prompts routed but not yet cached: a prefix the scheduler just sent to an instance is
//! priced there as cached before the instance reports storing it, so the next requests
//! sharing it queue behind it (the prefill serves a dp rank in order, and finds the pages
//! stored by then) instead of each computing its own cold copy elsewhere.
//!
//! An entry lives until its booking ends (reported, expired, or its instance gone), or its
//! TTL passes. Other replicas' routed prompts (from their load reports) are noted too, with
//! a shorter TTL. At most
//! [`MAX_PENDING_BLOCKS`] hashes are held; beyond that new prompts are not noted.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

use handoff_core::BlockHash;
use handoff_kv_index::{FoldMap, Run, Slot};

/// Most block hashes held over all pending prompts.
pub const MAX_PENDING_BLOCKS: usize = 1 << 20;

/// How long an unreported prompt is presumed in progress.
pub(super) const TTL: Duration = Duration::from_secs(30);

/// How long a prompt another replica routed is presumed in progress (its booking's end is
/// not heard of here; by then the instance's KV events have told where it is cached).
pub(super) const REMOTE_TTL: Duration = Duration::from_secs(10);

/// Most pending prompts compared per selection (the most recent sharing the first block).
const SCAN: usize = 256;

/// Leading hashes `a` and `b` share, by binary search: hashes are chained, so equal hashes
/// at one position mean equal prefixes up to it. (Hashes that are not chained only misprice
/// their own request.)
fn shared_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    let (mut lo, mut hi) = (0, a.len().min(b.len()));
    while lo < hi {
        let mid = lo + (hi - lo).div_ceil(2);
        if a[mid - 1] == b[mid - 1] {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    lo
}

#[derive(Debug)]
struct Entry {
    /// Its prompt's first block, where its [`Prompt`] is listed.
    first: BlockHash,
    until: Instant,
}

/// A pending prompt as a selection reads it: listed under its first block, so the overlay
/// walks one vector instead of looking each entry up.
#[derive(Debug)]
struct Prompt {
    id: u64,
    slot: Slot,
    hashes: Box<[BlockHash]>,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Pending {
    entries: FoldMap<u64, Entry>,
    /// The prompts by their first block, oldest first: keyed hashing, since a caller of the
    /// scheduler names the blocks (one lookup per selection; the ids below are ours).
    by_first: HashMap<BlockHash, Vec<Prompt>>,
    /// Entry ids by slot, oldest first.
    by_slot: FoldMap<Slot, VecDeque<u64>>,
    next: u64,
    blocks: usize,
}

impl Pending {
    /// Notes that a prompt with `hashes` was routed to `slot`, presumed in progress for
    /// `ttl`; returns the entry's id, or `None` when nothing was noted (no full page, or the
    /// table is full).
    pub(super) fn note(
        &mut self,
        slot: Slot,
        hashes: &[BlockHash],
        now: Instant,
        ttl: Duration,
    ) -> Option<u64> {
        let &first = hashes.first()?;
        if self.blocks + hashes.len() > MAX_PENDING_BLOCKS {
            self.expire(now);
            if self.blocks + hashes.len() > MAX_PENDING_BLOCKS {
                return None;
            }
        }
        let id = self.next;
        self.next += 1;
        self.blocks += hashes.len();
        self.entries.insert(id, Entry { first, until: now + ttl });
        let prompt = Prompt { id, slot, hashes: hashes.into() };
        self.by_first.entry(first).or_default().push(prompt);
        self.by_slot.entry(slot).or_default().push_back(id);
        Some(id)
    }

    /// Takes entry `id` out of the entries and its prompt's list; returns the prompt.
    fn unlink(&mut self, id: u64) -> Option<Prompt> {
        let e = self.entries.remove(&id)?;
        let v = self.by_first.get_mut(&e.first)?;
        let prompt = v.iter().position(|p| p.id == id).map(|at| v.remove(at));
        if v.is_empty() {
            self.by_first.remove(&e.first);
        }
        let prompt = prompt?;
        self.blocks -= prompt.hashes.len();
        Some(prompt)
    }

    /// Entry `id` is done (its booking ended); nothing if it already expired.
    pub(super) fn remove(&mut self, id: u64) {
        if let Some(p) = self.unlink(id) {
            self.unqueue(p.slot, id);
        }
    }

    fn unqueue(&mut self, slot: Slot, id: u64) {
        if let Some(q) = self.by_slot.get_mut(&slot) {
            q.retain(|&x| x != id);
            if q.is_empty() {
                self.by_slot.remove(&slot);
            }
        }
    }

    /// Drops every prompt routed to `slots` (their instance left or went silent).
    pub(super) fn forget(&mut self, slots: &[Slot]) {
        for s in slots {
            for id in self.by_slot.remove(s).unwrap_or_default() {
                self.unlink(id);
            }
        }
    }

    /// Drops entries past their TTL.
    pub(super) fn expire(&mut self, now: Instant) {
        let old: Vec<u64> =
            self.entries.iter().filter(|(_, e)| e.until <= now).map(|(&id, _)| id).collect();
        for id in old {
            self.remove(id);
        }
    }

    /// Raises `run[slot]` to the leading blocks of `hashes` pending on each slot, looking at
    /// the [`SCAN`] most recent prompts that share the first block.
    pub(super) fn overlay(&self, hashes: &[BlockHash], run: &mut Run) {
        let Some(prompts) = hashes.first().and_then(|f| self.by_first.get(f)) else { return };
        for p in prompts.iter().rev().take(SCAN) {
            run.raise(p.slot, shared_prefix(&p.hashes, hashes) as u32);
        }
    }

    /// Hashes held (for tests).
    #[cfg(test)]
    pub(super) fn blocks(&self) -> usize {
        self.blocks
    }
}

#[cfg(test)]
mod tests {
    use handoff_core::InstanceId;
    use handoff_kv_index::{KvIndex, WorkerKey};

    use super::*;

    /// Prompts past their TTL leave the table and stop drawing selections; younger ones stay.
    #[test]
    fn expired_prompts_stop_counting_as_pending() {
        let mut index = KvIndex::default();
        let key =
            |s: &str| WorkerKey { instance: s.parse::<InstanceId>().expect("an id"), dp_rank: 0 };
        let (a, b) = (index.register(&key("a")), index.register(&key("b")));
        let prompt: Vec<BlockHash> = (1..=4).map(BlockHash).collect();
        let mut pending = Pending::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        pending.note(a, &prompt, t0, ttl).expect("noted");
        pending.note(b, &prompt[..2], t0 + Duration::from_secs(5), ttl).expect("noted");
        let overlay = |pending: &Pending| {
            let mut run = Run::new();
            index.overlaps_into(&[], &mut run);
            pending.overlay(&prompt, &mut run);
            (run.at(a), run.at(b))
        };
        assert_eq!(overlay(&pending), (4, 2));
        pending.expire(t0 + ttl);
        assert_eq!((overlay(&pending), pending.blocks()), ((0, 2), 2), "a's prompt expired");
        pending.expire(t0 + 2 * ttl);
        assert_eq!((overlay(&pending), pending.blocks()), ((0, 0), 0));
        assert!(pending.by_first.is_empty() && pending.by_slot.is_empty(), "nothing left");
    }
}
