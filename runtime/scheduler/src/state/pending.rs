//! Prompts routed but not yet cached: a prefix the scheduler just sent to an instance is
//! priced there as cached before the instance reports storing it, so the next requests
//! sharing it queue behind it (the prefill serves a dp rank in order, and finds the pages
//! stored by then) instead of each computing its own cold copy elsewhere.
//!
//! An entry lives until its booking ends (reported, expired, or its instance gone), or its
//! TTL passes. Other replicas' routed prompts (from their load reports) are noted too, with
//! a shorter TTL. At most
//! [`MAX_PENDING_BLOCKS`] hashes are held; beyond that new prompts are not noted.
//!
//! Every change is cheap under the scheduler's lock however many prompts share a first block
//! (a chat system prompt: nearly all of them): an entry ending is found by binary search in
//! its first block's list (ids only grow) and marked, the list compacted once half of it is
//! marked; expiry takes entries in order of their end, at most [`EXPIRE_STEP`] a call.

use std::collections::{BTreeSet, HashMap, VecDeque};
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

/// Most entries one [`Pending::expire`] takes out (the rest wait for the next).
pub(super) const EXPIRE_STEP: usize = 4096;

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
    slot: Slot,
}

/// A pending prompt as a selection reads it: listed under its first block, so the overlay
/// walks one vector instead of looking each entry up.
#[derive(Debug)]
struct Prompt {
    id: u64,
    slot: Slot,
    /// Empty once the entry ended (its list not yet compacted).
    hashes: Box<[BlockHash]>,
}

/// The prompts sharing a first block, oldest (lowest id) first, some of them ended.
#[derive(Debug, Default)]
struct Prompts {
    all: Vec<Prompt>,
    ended: usize,
}

impl Prompts {
    /// Marks `id` ended; returns its hashes.
    fn end(&mut self, id: u64) -> Option<Box<[BlockHash]>> {
        let at = self.all.binary_search_by_key(&id, |p| p.id).ok()?;
        let hashes = std::mem::take(&mut self.all[at].hashes);
        if hashes.is_empty() {
            return None;
        }
        self.ended += 1;
        if self.ended * 2 > self.all.len() {
            self.all.retain(|p| !p.hashes.is_empty());
            self.ended = 0;
        }
        Some(hashes)
    }

    fn is_empty(&self) -> bool {
        self.ended == self.all.len()
    }
}

/// See the module docs.
#[derive(Debug, Default)]
pub(super) struct Pending {
    entries: FoldMap<u64, Entry>,
    /// The prompts by their first block, oldest first: keyed hashing, since a caller of the
    /// scheduler names the blocks (one lookup per selection; the ids below are ours).
    by_first: HashMap<BlockHash, Prompts>,
    /// Entry ids by slot, oldest first; ids of ended entries leave from the front.
    by_slot: FoldMap<Slot, VecDeque<u64>>,
    /// Entries by the end of their TTL.
    by_end: BTreeSet<(Instant, u64)>,
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
        let until = now + ttl;
        self.entries.insert(id, Entry { first, until, slot });
        self.by_end.insert((until, id));
        let prompt = Prompt { id, slot, hashes: hashes.into() };
        self.by_first.entry(first).or_default().all.push(prompt);
        self.by_slot.entry(slot).or_default().push_back(id);
        Some(id)
    }

    /// Takes entry `id` out of the entries, the expiry order and its prompt's list.
    fn unlink(&mut self, id: u64) -> Option<Entry> {
        let e = self.entries.remove(&id)?;
        self.by_end.remove(&(e.until, id));
        if let Some(prompts) = self.by_first.get_mut(&e.first) {
            if let Some(hashes) = prompts.end(id) {
                self.blocks -= hashes.len();
            }
            if prompts.is_empty() {
                self.by_first.remove(&e.first);
            }
        }
        Some(e)
    }

    /// Entry `id` is done (its booking ended); nothing if it already expired.
    pub(super) fn remove(&mut self, id: u64) {
        if let Some(e) = self.unlink(id) {
            self.trim_slot(e.slot);
        }
    }

    /// Lets the ids of ended entries at the front of `slot`'s queue go (entries mostly end
    /// in the order they were noted; one that lives long holds those behind it until it
    /// ends or expires, within its TTL).
    fn trim_slot(&mut self, slot: Slot) {
        if let Some(q) = self.by_slot.get_mut(&slot) {
            while q.front().is_some_and(|id| !self.entries.contains_key(id)) {
                q.pop_front();
            }
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

    /// Drops entries past their TTL, the earliest first, at most [`EXPIRE_STEP`].
    pub(super) fn expire(&mut self, now: Instant) {
        for _ in 0..EXPIRE_STEP {
            match self.by_end.first() {
                Some(&(until, id)) if until <= now => {
                    self.by_end.pop_first();
                    self.remove(id);
                }
                _ => break,
            }
        }
    }

    /// Raises `run[slot]` to the leading blocks of `hashes` pending on each slot, looking at
    /// the [`SCAN`] most recent live prompts that share the first block (among the `4 * SCAN`
    /// most recent).
    pub(super) fn overlay(&self, hashes: &[BlockHash], run: &mut Run) {
        let Some(prompts) = hashes.first().and_then(|f| self.by_first.get(f)) else { return };
        // At most half of a list is ended, but those may be its newest: the walk is bounded
        // too.
        let recent = prompts.all.iter().rev().take(4 * SCAN);
        for p in recent.filter(|p| !p.hashes.is_empty()).take(SCAN) {
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

    /// Thousands of prompts under one first block (a shared system prompt): entries ending
    /// leave their list compacted (at most half of it ended), the slots' queues keep only
    /// what lives from their front, expiry takes a bounded step a call, and an ended prompt
    /// stops drawing selections at once.
    #[test]
    fn many_prompts_on_one_first_block_end_cheaply_and_leave_nothing() {
        let mut index = KvIndex::default();
        let key = |i: u32| WorkerKey { instance: "a".parse::<InstanceId>().unwrap(), dp_rank: i };
        let (a, b) = (index.register(&key(0)), index.register(&key(1)));
        let mut pending = Pending::default();
        let t0 = Instant::now();
        let ttl = Duration::from_secs(10);
        let prompt = |i: u64| [BlockHash(1), BlockHash(100 + i)];
        let ids: Vec<u64> = (0..10_000)
            .map(|i| pending.note(if i % 2 == 0 { a } else { b }, &prompt(i), t0, ttl).unwrap())
            .collect();
        for &id in &ids[..9_900] {
            pending.remove(id);
        }
        let list = &pending.by_first[&BlockHash(1)];
        assert!(list.all.len() <= 200, "{} listed for 100 live", list.all.len());
        let queued: usize = pending.by_slot.values().map(VecDeque::len).sum();
        assert_eq!((queued, pending.blocks()), (100, 200));
        let newest = prompt(9_999);
        let overlay = |pending: &Pending| {
            let mut run = Run::new();
            index.overlaps_into(&[], &mut run);
            pending.overlay(&newest, &mut run);
            run.at(b)
        };
        assert_eq!(overlay(&pending), 2);
        pending.remove(ids[9_999]);
        assert_eq!(overlay(&pending), 1, "only the shared first block is pending on b now");
        for i in 10_000..20_000 {
            pending.note(a, &prompt(i), t0, ttl).unwrap();
        }
        pending.expire(t0 + ttl);
        assert_eq!(pending.entries.len(), 10_099 - EXPIRE_STEP, "one step a call");
        while !pending.entries.is_empty() {
            pending.expire(t0 + ttl);
        }
        assert_eq!(pending.blocks(), 0);
        assert!(
            pending.by_first.is_empty() && pending.by_slot.is_empty() && pending.by_end.is_empty()
        );
    }

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
