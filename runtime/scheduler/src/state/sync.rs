//! Keeping the index equal to each instance's prefix caches. KV events apply in sequence. A
//! gap, or an instance first heard or heard again, starts a resync: its snapshot is fetched
//! page by page, and events that arrive meanwhile are buffered (bounded) and replayed past
//! the snapshot's sequence number once the last page is in, so a resync under traffic ends
//! in sync instead of at the next gap. Pages are stored a chunk of blocks per hold of the
//! lock, so selections never wait behind a whole page.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use handoff_core::InstanceId;
use handoff_discovery::{KvEvent, KvEventKind, KvSnapshot, SnapshotAsk};
use handoff_kv_index::KvIndex;
use tracing::{debug, info, warn};

use super::member::Member;
use super::{Inner, SchedulerState};
use crate::rejects::Reject;

/// Events buffered per instance while its snapshot is fetched; beyond that the resync
/// starts again once its snapshot is in.
pub const MAX_BUFFERED_EVENTS: usize = 4096;

/// Most pages a snapshot may have (10^8 blocks in pages of 16 Ki).
pub const MAX_SNAPSHOT_PAGES: u32 = 8192;

/// Blocks stored per hold of the state lock while a page is applied.
const CHUNK_BLOCKS: usize = 64;

/// A resync in progress.
#[derive(Debug, Default)]
pub(super) struct Resync {
    /// Which resync of the instance this is: only the task that started it applies pages.
    generation: u64,
    /// Events heard since it began, in arrival order.
    buffered: Vec<KvEvent>,
    /// Events were lost for want of room.
    overflowed: bool,
    /// The snapshot being applied, and the page expected next.
    applying: Option<(u64, u32)>,
}

/// Resyncs in progress, by instance.
#[derive(Debug, Default)]
pub(super) struct Resyncs {
    map: HashMap<InstanceId, Resync>,
    next: u64,
    /// Instances whose last resyncs failed: how many in a row, and when the next may start.
    backoff: HashMap<InstanceId, (u32, Instant)>,
}

/// Failed resyncs in a row asked again at the next heartbeat, as before (an instance's bus
/// connection coming back a few seconds after the scheduler's); past them, a wait of
/// [`RESYNC_BACKOFF`], doubled at each failure, up to [`RESYNC_BACKOFF_MAX`]. Before, every
/// failure was asked again at the next heartbeat (a second): a scheduler starting beside a
/// thousand prefills, its snapshot pages late on a busy bus, asked all of them again every
/// second, never catching up.
const RESYNC_FREE_FAILURES: u32 = 3;
const RESYNC_BACKOFF: Duration = Duration::from_secs(2);
const RESYNC_BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Resyncs in progress at once, at most; an instance's next heartbeat asks again. A
/// scheduler starting beside a thousand prefills asked all their snapshots in its first
/// second (up to 700 MB of pages on one connection, most late, all asked again).
pub(crate) const MAX_RESYNCS: usize = 64;

impl Resyncs {
    /// Starts a resync of `id` unless one is in progress, or its last failed too recently (as
    /// of `now`); says whether it started.
    pub(super) fn start(&mut self, id: &InstanceId, now: Instant) -> bool {
        if self.map.contains_key(id)
            || self.map.len() >= MAX_RESYNCS
            || self.backoff.get(id).is_some_and(|b| now < b.1)
        {
            return false;
        }
        self.next += 1;
        self.map.insert(id.clone(), Resync { generation: self.next, ..Resync::default() });
        true
    }

    /// Forgets `id`'s resync, whoever runs it, and its failures.
    pub(super) fn remove(&mut self, id: &InstanceId) {
        self.map.remove(id);
        self.backoff.remove(id);
    }

    /// Notes that `id`'s resync failed at `now`: past three in a row, the next waits (2 s,
    /// doubling, up to 30 s; each instance's wait stretched by its own factor of 0.75 to
    /// 1.25, so a fleet that failed together does not ask again together).
    fn failed(&mut self, id: &InstanceId, now: Instant) {
        let failures = self.backoff.get(id).map_or(0, |b| b.0).saturating_add(1);
        let Some(over) = failures.checked_sub(RESYNC_FREE_FAILURES + 1) else {
            self.backoff.insert(id.clone(), (failures, now));
            return;
        };
        let wait = RESYNC_BACKOFF.saturating_mul(1 << over.min(5)).min(RESYNC_BACKOFF_MAX);
        let mut h = std::hash::DefaultHasher::new();
        std::hash::Hash::hash(id.as_str(), &mut h);
        let spread = 0.75 + (std::hash::Hasher::finish(&h) % 512) as f64 / 1024.0;
        self.backoff.insert(id.clone(), (failures, now + wait.mul_f64(spread)));
    }

    /// `id`'s resync if it is generation `generation`.
    fn owned(&mut self, id: &InstanceId, generation: u64) -> Option<&mut Resync> {
        self.map.get_mut(id).filter(|r| r.generation == generation)
    }

    /// Forgets `id`'s resync if it is generation `generation`.
    fn end(&mut self, id: &InstanceId, generation: u64) {
        if self.owned(id, generation).is_some() {
            self.map.remove(id);
        }
    }
}

/// Starts a resync of `id` unless one is in progress (or its last failed too recently); says
/// whether it started.
pub(super) fn start(resyncs: &mut Resyncs, id: &InstanceId, now: Instant) -> bool {
    resyncs.start(id, now)
}

/// What to do after a snapshot page.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resynced {
    /// Ask for this page next.
    Next(SnapshotAsk),
    /// The index is in sync with the instance.
    Done,
    /// Events were lost while the snapshot was fetched: ask for a new one.
    Again,
    /// Not applied: the instance left or went silent meanwhile, or the page is not the one
    /// expected. Its resync's owner ends it as failed
    /// ([`SchedulerState::resync_failed_as`]): a page that does not fit is a failure that
    /// backs off.
    Dropped,
}

/// What one event did.
enum Step {
    Applied,
    Old,
    Gap,
}

/// Applies `ev` to `m`'s slots if it is the next in sequence. One for a dp rank the instance
/// does not have takes its place in the sequence and changes nothing (were it not counted,
/// the next event would look like a gap and cost a resync).
fn apply_in_sequence(m: &mut Member, index: &mut KvIndex, ev: KvEvent) -> Step {
    let last = match m.seq {
        // Another process's numbering: not comparable; a snapshot of that one is needed.
        Some(_) if numbered_apart(m, &ev) => return Step::Gap,
        Some(l) => l,
        // Nothing known yet: a first event applies as is, anything later needs a snapshot.
        None if ev.seq == 1 => {
            m.incarnation = ev.incarnation;
            0
        }
        None => return Step::Gap,
    };
    if ev.seq <= last {
        return Step::Old;
    }
    if ev.seq != last + 1 {
        return Step::Gap;
    }
    m.seq = Some(ev.seq);
    let Some(&slot) = m.slots.get(ev.dp_rank as usize) else {
        debug!(instance = %ev.instance, dp_rank = ev.dp_rank, "KV event for a dp rank the instance does not have");
        return Step::Old;
    };
    match ev.kind {
        KvEventKind::Stored { parent, blocks } => index.store_at(slot, parent, &blocks),
        KvEventKind::Removed { blocks } => index.remove_at(slot, &blocks),
        KvEventKind::Cleared => index.begin_clear_at(slot),
    }
    Step::Applied
}

/// Whether `ev` was numbered by another process under `m`'s id than the one `m` is synced
/// with (restarted while this scheduler's view of etcd was stale, so never seen to leave),
/// by its incarnation, when both say.
fn numbered_apart(m: &Member, ev: &KvEvent) -> bool {
    ev.incarnation != 0 && m.incarnation != 0 && ev.incarnation != m.incarnation
}

/// As [`numbered_apart`], also for an older version's events (no incarnation): a first event
/// after others. Not on a resync's replay, which cannot tell that from a new instance's
/// first events at or below its snapshot (a restart's first event buffered meanwhile is
/// missed then).
fn another_process(m: &Member, ev: &KvEvent) -> bool {
    match (ev.incarnation, m.incarnation) {
        (0, _) | (_, 0) => ev.seq == 1 && m.seq.is_some_and(|l| l >= 1),
        _ => numbered_apart(m, ev),
    }
}

impl SchedulerState {
    /// Applies a KV event from an instance (or buffers it while the instance resyncs).
    /// Returns whether a resync must start (a gap in its sequence numbers, or nothing known
    /// of it yet).
    pub fn apply_event(&self, ev: KvEvent) -> bool {
        let mut inner = self.lock();
        let Inner { members, index, resyncing, .. } = &mut *inner;
        let Some(m) = members.get_mut(&ev.instance) else {
            debug!(instance = %ev.instance, "KV event from an unknown instance dropped");
            return false;
        };
        if !m.routable() {
            return false;
        }
        if let Some(r) = resyncing.map.get_mut(&ev.instance) {
            if r.buffered.len() < MAX_BUFFERED_EVENTS {
                r.buffered.push(ev);
            } else {
                r.overflowed = true;
            }
            return false;
        }
        let (id, seq, last) = (ev.instance.clone(), ev.seq, m.seq);
        // Taken as old, another process's events were dropped and the index kept its
        // predecessor's cache.
        let restarted = another_process(m, &ev);
        let step = if restarted { Step::Gap } else { apply_in_sequence(m, index, ev) };
        match step {
            Step::Applied if index.is_cleaning() => {
                drop(inner);
                self.settle_index();
                false
            }
            Step::Applied | Step::Old => false,
            Step::Gap => {
                if let Some(last) = last {
                    let again = if restarted { " (numbered afresh: restarted)" } else { "" };
                    let gap = format_args!("{id}: event {seq} after {last}{again}; resyncing");
                    self.rejects().note(Reject::SequenceGap, &gap);
                }
                let started = start(resyncing, &id, Instant::now());
                if !started {
                    // Not now (too many at once, or its last failed lately): its heartbeats
                    // ask again, as for an instance never synced; its next events are gaps.
                    m.seq = None;
                }
                started
            }
        }
    }

    /// Which resync of `id` is in progress, if any: the task fetching its snapshot applies
    /// pages as that generation ([`SchedulerState::apply_snapshot_as`]).
    pub fn resync_generation(&self, id: &InstanceId) -> Option<u64> {
        self.lock().resyncing.map.get(id).map(|r| r.generation)
    }

    /// Applies one page of an instance's snapshot as the resync in progress (page 0 starts
    /// one if none is), ending it as failed when the page is dropped (no task owns it).
    pub fn apply_snapshot(&self, page: KvSnapshot) -> Resynced {
        let generation = {
            let mut inner = self.lock();
            let id = &page.instance;
            if page.page == 0 && inner.members.contains_key(id) {
                inner.resyncing.start(id, Instant::now());
            }
            match inner.resyncing.map.get(id) {
                Some(r) => r.generation,
                None => return Resynced::Dropped,
            }
        };
        let id = page.instance.clone();
        let r = self.apply_snapshot_as(generation, page);
        if r == Resynced::Dropped {
            self.resync_failed_as(&id, generation, Instant::now());
        }
        r
    }

    /// Applies one page of an instance's snapshot, for its resync `generation`. Page 0
    /// replaces what the index holds of the instance; after the last page the events
    /// buffered meanwhile are replayed. A page for a resync that is no longer `generation`
    /// (the instance left, went silent, or another resync began) changes nothing.
    pub fn apply_snapshot_as(&self, generation: u64, page: KvSnapshot) -> Resynced {
        let id = page.instance.clone();
        let Some(at) = self.begin_page(generation, &page) else {
            return Resynced::Dropped;
        };
        // Page 0 began clearing the instance: done before its blocks are stored.
        self.settle_index();
        for (dp, blocks) in page.dp_blocks.iter().enumerate() {
            let parents = page.dp_parents.get(dp).filter(|p| p.len() == blocks.len());
            for from in (0..blocks.len()).step_by(CHUNK_BLOCKS) {
                let to = (from + CHUNK_BLOCKS).min(blocks.len());
                let mut inner = self.lock();
                let Inner { members, index, resyncing, .. } = &mut *inner;
                // Checked again at every chunk: the lock was let go in between.
                let Some(r) = resyncing.owned(&id, generation) else {
                    return Resynced::Dropped;
                };
                let slot = members
                    .get(&id)
                    .filter(|m| !m.silent && r.applying == Some(at))
                    .and_then(|m| m.slots.get(dp).copied());
                let Some(slot) = slot else {
                    resyncing.end(&id, generation);
                    return Resynced::Dropped;
                };
                match parents {
                    // Each block under its parent (listed first): the tree comes out compressed.
                    Some(parents) => {
                        for (parent, block) in parents[from..to].iter().zip(&blocks[from..to]) {
                            index.store_at(slot, *parent, std::slice::from_ref(block));
                        }
                    }
                    // No parents (an older sender): each block alone, so that the prompt
                    // starts among them are known as such (the index finds a prompt's first
                    // block only where a run with no parent began with it).
                    None => {
                        for block in &blocks[from..to] {
                            index.store_at(slot, None, std::slice::from_ref(block));
                        }
                    }
                }
                // Handed to a waiting selection, not taken straight back.
                parking_lot::MutexGuard::unlock_fair(inner);
            }
        }
        if page.is_last() {
            let done = self.finish_resync(generation, &id, page.seq, at);
            self.settle_index();
            done
        } else {
            let mut inner = self.lock();
            match inner.resyncing.owned(&id, generation) {
                Some(r) if r.applying == Some(at) => {
                    let next = (at.0, at.1 + 1);
                    r.applying = Some(next);
                    Resynced::Next(SnapshotAsk { snapshot: next.0, page: next.1 })
                }
                _ => Resynced::Dropped,
            }
        }
    }

    /// Checks a page against resync `generation` (page 0 starts applying a snapshot, which
    /// also begins clearing the instance's entries). Returns the (snapshot, page) it is.
    fn begin_page(&self, generation: u64, page: &KvSnapshot) -> Option<(u64, u32)> {
        let mut inner = self.lock();
        let Inner { members, index, resyncing, .. } = &mut *inner;
        let id = &page.instance;
        resyncing.owned(id, generation)?;
        let Some(m) = members.get_mut(id).filter(|m| !m.silent) else {
            resyncing.end(id, generation);
            return None;
        };
        let valid = page.dp_blocks.len() <= m.slots.len()
            && page.pages.max(1) <= MAX_SNAPSHOT_PAGES
            && page.page < page.pages.max(1);
        let r = resyncing.owned(id, generation)?;
        let at = (page.snapshot, page.page);
        let expected = page.page == 0 || r.applying == Some(at);
        if !valid || !expected {
            // Left to its task, which ends it as failed (`resync_failed_as`): ended here, it
            // was no failure, and an instance whose pages never fit (an engine of more dp
            // ranks than it registered) was asked again at every heartbeat, for good.
            debug!(instance = %id, snapshot = page.snapshot, page = page.page, pages = page.pages, "snapshot page not expected; resync abandoned");
            m.seq = None;
            return None;
        }
        if page.page == 0 {
            r.applying = Some(at);
            m.seq = None;
            m.incarnation = page.incarnation;
            for slot in &m.slots {
                index.begin_clear_at(*slot);
            }
        }
        Some(at)
    }

    /// Ends resync `generation` of `id` at snapshot sequence `seq`: replays what was
    /// buffered since it began, past `seq`.
    fn finish_resync(
        &self,
        generation: u64,
        id: &InstanceId,
        seq: u64,
        at: (u64, u32),
    ) -> Resynced {
        let mut pending: Vec<KvEvent> = Vec::new();
        let (mut first, mut gap) = (true, false);
        loop {
            let mut inner = self.lock();
            let Inner { members, index, resyncing, .. } = &mut *inner;
            let Some(r) = resyncing.owned(id, generation) else {
                return Resynced::Dropped;
            };
            let Some(m) = members.get_mut(id).filter(|m| !m.silent && r.applying == Some(at))
            else {
                resyncing.end(id, generation);
                return Resynced::Dropped;
            };
            // With those heard while the last clear was finished, in order (popped from the end).
            pending.append(&mut r.buffered);
            pending.sort_by_key(|e| std::cmp::Reverse(e.seq));
            if std::mem::take(&mut first) {
                m.seq = Some(seq);
            }
            // Up to a clear, which is then finished a step per hold of the lock before the
            // next event: a store into a slot being cleared would finish it in one hold.
            let mut clearing = false;
            while let Some(ev) = pending.pop() {
                let clears = matches!(ev.kind, KvEventKind::Cleared);
                gap |= matches!(apply_in_sequence(m, index, ev), Step::Gap);
                if clears && index.is_cleaning() {
                    clearing = true;
                    break;
                }
            }
            if clearing {
                drop(inner);
                self.settle_index();
                continue;
            }
            if std::mem::take(&mut r.overflowed) || gap {
                // Start again, as the same generation: buffering goes on meanwhile.
                *r = Resync { generation, ..Resync::default() };
                warn!(instance = %id, "KV events lost during a resync; resyncing again");
                return Resynced::Again;
            }
            resyncing.end(id, generation);
            resyncing.backoff.remove(id);
            info!(instance = %id, seq = m.seq.unwrap_or(seq), "KV index resynced from snapshot");
            return Resynced::Done;
        }
    }

    /// Forgets resync `generation` of `id` (it failed or was dropped at `now`), if it is
    /// still that one, so a trigger asks again once its backoff is over.
    pub fn resync_failed_as(&self, id: &InstanceId, generation: u64, now: Instant) {
        let mut inner = self.lock();
        if inner.resyncing.owned(id, generation).is_none() {
            return;
        }
        inner.resyncing.end(id, generation);
        inner.resyncing.failed(id, now);
        if let Some(m) = inner.members.get_mut(id) {
            m.seq = None;
        }
    }

    /// Forgets `id`'s resync, whichever it is, so the next trigger asks again.
    pub fn resync_failed(&self, id: &InstanceId) {
        let mut inner = self.lock();
        inner.resyncing.remove(id);
        if let Some(m) = inner.members.get_mut(id) {
            m.seq = None;
        }
    }
}

#[cfg(test)]
mod tests;
