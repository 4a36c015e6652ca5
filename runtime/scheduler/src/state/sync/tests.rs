use std::collections::{BTreeSet, VecDeque};

use handoff_core::BlockHash;
use handoff_discovery::snapshot::Taken;
use handoff_discovery::{SnapshotAsk, Snapshots, Update};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::state::tests::inst;
use crate::{SchedulerConfig, SchedulerState};

/// A fake instance's prefix caches (named as such: the real one is the prefill's): blocks
/// per dp rank, numbered events, and real [`Snapshots`] paging them.
struct FakeCaches {
    id: InstanceId,
    dps: Vec<BTreeSet<u64>>,
    seq: u64,
    snapshots: Snapshots,
}

impl FakeCaches {
    fn new(dp: usize, page_blocks: usize) -> Self {
        let id: InstanceId = "p".parse().unwrap();
        let snapshots = Snapshots::with_page_blocks(id.clone(), page_blocks);
        FakeCaches { id, dps: vec![BTreeSet::new(); dp], seq: 0, snapshots }
    }

    /// A random change, as the event that announces it.
    fn change(&mut self, rng: &mut StdRng) -> KvEvent {
        let dp = rng.random_range(0..self.dps.len());
        let kind = match rng.random_range(0..20) {
            0 => {
                self.dps[dp].clear();
                KvEventKind::Cleared
            }
            1..=7 if !self.dps[dp].is_empty() => {
                let held: Vec<u64> = self.dps[dp].iter().copied().collect();
                let blocks: Vec<u64> = (0..rng.random_range(1..4))
                    .map(|_| held[rng.random_range(0..held.len())])
                    .collect();
                blocks.iter().for_each(|b| {
                    self.dps[dp].remove(b);
                });
                KvEventKind::Removed { blocks: blocks.into_iter().map(BlockHash).collect() }
            }
            _ => {
                let blocks: Vec<u64> =
                    (0..rng.random_range(1..6)).map(|_| rng.random_range(0..400)).collect();
                self.dps[dp].extend(&blocks);
                KvEventKind::Stored {
                    parent: None,
                    blocks: blocks.into_iter().map(BlockHash).collect(),
                }
            }
        };
        self.seq += 1;
        KvEvent {
            instance: self.id.clone(),
            dp_rank: dp as u32,
            seq: self.seq,
            incarnation: 0,
            kind,
        }
    }

    fn page(&self, ask: SnapshotAsk) -> KvSnapshot {
        let take = || Taken {
            seq: self.seq,
            incarnation: 0,
            dp_blocks: self.dps.iter().map(|d| d.iter().map(|&b| BlockHash(b)).collect()).collect(),
            dp_parents: self.dps.iter().map(|d| vec![None; d.len()]).collect(),
        };
        self.snapshots.page(ask, self.seq, take).unwrap()
    }

    fn held(&self, dp: usize) -> BTreeSet<BlockHash> {
        self.dps[dp].iter().map(|&b| BlockHash(b)).collect()
    }
}

/// Event `seq` of `id`: block `seq` stored on dp rank 0.
fn stored(id: &InstanceId, seq: u64) -> KvEvent {
    let kind = KvEventKind::Stored { parent: None, blocks: vec![BlockHash(seq)] };
    KvEvent { instance: id.clone(), dp_rank: 0, seq, incarnation: 0, kind }
}

fn indexed(s: &SchedulerState, id: &InstanceId, dp: usize) -> BTreeSet<BlockHash> {
    s.indexed_blocks(id, dp as u32).into_iter().collect()
}

#[test]
fn a_resync_under_traffic_ends_equal_to_the_instance() {
    for seed in 0..40 {
        let mut rng = StdRng::seed_from_u64(seed);
        let s = SchedulerState::new(SchedulerConfig::default());
        s.apply_update(Update::Reset(vec![inst("p", 2)]));
        let mut caches = FakeCaches::new(2, rng.random_range(1..40));
        // Events travel in order but late: some published before a page was taken arrive
        // after it.
        let mut wire: VecDeque<KvEvent> = VecDeque::new();
        for _ in 0..rng.random_range(0..200) {
            caches.change(&mut rng);
        }
        // The scheduler knows nothing: the first event it hears (not number 1) starts a resync.
        wire.push_back(caches.change(&mut rng));
        let deliver = |s: &SchedulerState, wire: &mut VecDeque<KvEvent>, n: usize| {
            let mut started = false;
            for ev in wire.drain(..n.min(wire.len())) {
                started |= s.apply_event(ev);
            }
            started
        };
        assert!(deliver(&s, &mut wire, 1), "seed {seed}: a resync starts");
        let mut ask = SnapshotAsk::default();
        let mut rounds = 0;
        loop {
            for _ in 0..rng.random_range(0..30) {
                wire.push_back(caches.change(&mut rng));
            }
            let n = rng.random_range(0..=wire.len());
            assert!(!deliver(&s, &mut wire, n), "no second resync while one is in progress");
            match s.apply_snapshot(caches.page(ask)) {
                Resynced::Next(next) => ask = next,
                Resynced::Done => break,
                Resynced::Again => ask = SnapshotAsk::default(),
                Resynced::Dropped => panic!("seed {seed}: page dropped"),
            }
            rounds += 1;
            assert!(rounds < 10_000);
        }
        // The rest of the wire, and more traffic: the scheduler stays in step, no new resync.
        for _ in 0..50 {
            wire.push_back(caches.change(&mut rng));
        }
        let n = wire.len();
        assert!(!deliver(&s, &mut wire, n), "seed {seed}: in sync after the resync");
        for dp in 0..2 {
            assert_eq!(indexed(&s, &caches.id, dp), caches.held(dp), "seed {seed} dp {dp}");
        }
        // Clears among the replayed events were finished in steps, never by the next store.
        assert_eq!(s.lock().index.forced_clears(), 0, "seed {seed}: a clear finished at once");
    }
}

#[test]
fn events_lost_from_a_full_buffer_start_the_resync_again() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let mut rng = StdRng::seed_from_u64(7);
    let mut caches = FakeCaches::new(1, 1000);
    caches.change(&mut rng);
    let ev = caches.change(&mut rng);
    assert!(s.apply_event(ev), "a gap starts a resync");
    let first = caches.page(SnapshotAsk::default());
    for _ in 0..MAX_BUFFERED_EVENTS + 1 {
        s.apply_event(caches.change(&mut rng));
    }
    assert_eq!(s.apply_snapshot(first), Resynced::Again);
    s.apply_event(caches.change(&mut rng)); // buffered by the fresh resync
    assert_eq!(s.apply_snapshot(caches.page(SnapshotAsk::default())), Resynced::Done);
    assert_eq!(indexed(&s, &caches.id, 0), caches.held(0));
}

#[test]
fn pages_that_do_not_fit_the_resync_change_nothing_and_end_it() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let mut rng = StdRng::seed_from_u64(3);
    let mut caches = FakeCaches::new(1, 2);
    for _ in 0..20 {
        caches.change(&mut rng);
    }
    let p0 = caches.page(SnapshotAsk::default());
    assert!(p0.pages > 2, "{}", p0.pages);
    let Resynced::Next(next) = s.apply_snapshot(p0.clone()) else { panic!("page 0 applies") };
    // A page out of order, from another snapshot, past the end, or with too many ranks.
    let skipped = SnapshotAsk { page: next.page + 1, ..next };
    let mut bad = vec![caches.page(skipped)];
    bad.push(KvSnapshot { snapshot: next.snapshot + 1, ..caches.page(next) });
    bad.push(KvSnapshot { page: 5, pages: 5, ..p0.clone() });
    bad.push(KvSnapshot { pages: MAX_SNAPSHOT_PAGES + 1, ..p0.clone() });
    bad.push(KvSnapshot { dp_blocks: vec![vec![], vec![BlockHash(1)]], ..p0.clone() });
    for page in bad {
        let before = indexed(&s, &caches.id, 0);
        // Restart a resync at page 1 of the current snapshot, then feed the bad page.
        assert_eq!(s.apply_snapshot(p0.clone()), Resynced::Next(next));
        let wrong = page.page != 0;
        assert_eq!(s.apply_snapshot(page), Resynced::Dropped);
        if wrong {
            assert_eq!(indexed(&s, &caches.id, 0), before, "nothing stored from a wrong page");
        }
        // Ended as failed; the next event asks for a new one.
        assert!(s.apply_event(caches.change(&mut rng)), "resync asked again");
        s.resync_failed(&caches.id);
    }
    // An instance that leaves mid-resync: its pages are dropped.
    assert_eq!(s.apply_snapshot(p0.clone()), Resynced::Next(next));
    s.apply_update(Update::Remove(caches.id.clone()));
    assert_eq!(s.apply_snapshot(caches.page(next)), Resynced::Dropped);
}

/// Found in review: a resync whose instance went silent (or left and came back smaller)
/// mid-snapshot must end, not linger and block the next one, nor write into the new slots.
#[test]
fn a_stale_resync_neither_blocks_the_next_nor_writes_into_it() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 2)]));
    let mut rng = StdRng::seed_from_u64(11);
    let mut caches = FakeCaches::new(2, 3);
    for _ in 0..30 {
        caches.change(&mut rng);
    }
    assert!(s.apply_event(caches.change(&mut rng)), "a resync starts");
    let old = s.resync_generation(&caches.id).unwrap();
    let p0 = caches.page(SnapshotAsk::default());
    let Resynced::Next(next) = s.apply_snapshot_as(old, p0) else { panic!("page 0 applies") };
    // Silenced mid-snapshot: the resync is over; the next trigger starts a new one at once.
    s.lock().silence(&caches.id);
    assert_eq!(s.apply_snapshot_as(old, caches.page(next)), Resynced::Dropped);
    assert_eq!(s.resync_generation(&caches.id), None);
    // It leaves and comes back with one dp rank; a new resync begins.
    s.apply_update(Update::Remove(caches.id.clone()));
    s.apply_update(Update::Add(inst("p", 1)));
    assert!(s.apply_event(KvEvent { dp_rank: 0, ..caches.change(&mut rng) }), "a new resync");
    let new = s.resync_generation(&caches.id).unwrap();
    assert_ne!(new, old);
    // The old task's pages (two dp ranks' worth) change nothing and do not end the new one.
    for page in [caches.page(SnapshotAsk::default()), caches.page(next)] {
        assert_eq!(s.apply_snapshot_as(old, page), Resynced::Dropped);
    }
    assert_eq!(s.resync_generation(&caches.id), Some(new));
    s.resync_failed_as(&caches.id, old, std::time::Instant::now());
    assert_eq!(s.resync_generation(&caches.id), Some(new), "only the owner ends it");
}

/// A page without parents (an older sender's) lists several prompts' blocks in one run:
/// every prompt it lists is matched, wherever in the list it begins.
#[test]
fn a_page_without_parents_matches_every_prompt_it_lists() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let mut rng = StdRng::seed_from_u64(3);
    let mut caches = FakeCaches::new(1, 1000);
    caches.change(&mut rng);
    assert!(s.apply_event(caches.change(&mut rng)), "a gap starts a resync");
    let (p, q) = ([101, 102, 103].map(BlockHash), [201, 202, 203].map(BlockHash));
    let mut page = caches.page(SnapshotAsk::default());
    page.dp_blocks = vec![vec![p[0], q[0], p[1], q[1], p[2], q[2]]];
    page.dp_parents = Vec::new();
    assert_eq!(s.apply_snapshot(page), Resynced::Done);
    for prompt in [&p, &q] {
        let sel = s.select(&crate::Ask::new(prompt, 48)).unwrap();
        assert_eq!(sel.cached_blocks, 3, "{prompt:?}");
    }
}

/// A failed resync is asked again at the next heartbeat three times in a row, then only
/// after a backoff (about 2 s, then 4 s, ...).
#[test]
fn a_failed_resync_is_asked_again_after_a_growing_wait() {
    use handoff_discovery::Heartbeat;
    use std::time::{Duration, Instant};
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let id: InstanceId = "p".parse().unwrap();
    let beat = |at| s.heartbeat_at(&Heartbeat::fixture(id.clone()), at);
    let t0 = Instant::now();
    assert!(beat(t0), "first heard: a resync");
    let mut failed_at = t0;
    for failure in 1..=3 {
        s.resync_failed_as(&id, s.resync_generation(&id).unwrap(), failed_at);
        assert!(beat(failed_at), "failure {failure}: asked again at once");
    }
    for (failure, wait) in [(4, 2.0), (5, 4.0), (6, 8.0)] {
        s.resync_failed_as(&id, s.resync_generation(&id).unwrap(), failed_at);
        let early = failed_at + Duration::from_secs_f64(wait * 0.7);
        assert!(!beat(early), "failure {failure}: not asked again at {:?}", early - failed_at);
        let due = failed_at + Duration::from_secs_f64(wait * 1.3);
        assert!(beat(due), "failure {failure}: asked again by {:?}", due - failed_at);
        failed_at = due;
    }
}

/// Found in review: a resync abandoned for a page that does not fit (an engine of more dp
/// ranks than its registration) is a failure, and backs off as others do: before, it was
/// asked again at every heartbeat, for good.
#[test]
fn a_resync_abandoned_for_a_bad_page_backs_off() {
    use handoff_discovery::Heartbeat;
    use std::time::{Duration, Instant};
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let caches = FakeCaches::new(2, 100);
    let id = caches.id.clone();
    let mut at = Instant::now();
    for failure in 1..=4 {
        assert!(s.heartbeat_at(&Heartbeat::fixture(id.clone()), at), "failure {failure}: asked");
        let generation = s.resync_generation(&id).unwrap();
        let page = caches.page(SnapshotAsk::default());
        assert_eq!(s.apply_snapshot_as(generation, page), Resynced::Dropped);
        // As the resync's task does on `Dropped`.
        s.resync_failed_as(&id, generation, at);
        at += Duration::from_millis(100);
    }
    assert!(!s.heartbeat_at(&Heartbeat::fixture(id), at), "the fifth waits");
}

/// At most [`MAX_RESYNCS`] resyncs run at once: a scheduler starting beside a large fleet
/// asks the others at their next heartbeats, as earlier ones end.
#[test]
fn resyncs_at_once_are_bounded() {
    use handoff_discovery::Heartbeat;
    let s = SchedulerState::new(SchedulerConfig::default());
    let n = MAX_RESYNCS + 3;
    s.apply_update(Update::Reset((0..n).map(|i| inst(&format!("p{i}"), 1)).collect()));
    let now = std::time::Instant::now();
    let started = (0..n)
        .filter(|i| s.heartbeat_at(&Heartbeat::fixture(format!("p{i}").parse().unwrap()), now))
        .count();
    assert_eq!(started, MAX_RESYNCS);
    let first: InstanceId = "p0".parse().unwrap();
    s.resync_failed_as(&first, s.resync_generation(&first).unwrap(), now);
    let late: InstanceId = format!("p{}", n - 1).parse().unwrap();
    assert!(s.heartbeat_at(&Heartbeat::fixture(late), now), "a place freed: the next asks");
}

/// An instance in step whose gap comes while the resyncs are all taken is asked again at its
/// next heartbeat, as one never synced: before, only its next event (another gap, refused
/// the same way while busy) could, and an instance gone quiet kept a stale index.
#[test]
fn a_gap_refused_while_resyncs_are_taken_is_asked_again_by_heartbeats() {
    use handoff_discovery::Heartbeat;
    let s = SchedulerState::new(SchedulerConfig::default());
    let mut all: Vec<_> = (0..MAX_RESYNCS).map(|i| inst(&format!("p{i}"), 1)).collect();
    all.push(inst("late", 1));
    s.apply_update(Update::Reset(all));
    let late: InstanceId = "late".parse().unwrap();
    let event = |seq| stored(&late, seq);
    assert!(!s.apply_event(event(1)), "in step from its first event");
    let now = std::time::Instant::now();
    for i in 0..MAX_RESYNCS {
        assert!(s.heartbeat_at(&Heartbeat::fixture(format!("p{i}").parse().unwrap()), now));
    }
    assert!(!s.apply_event(event(3)), "a gap, every resync taken");
    let first: InstanceId = "p0".parse().unwrap();
    s.resync_failed_as(&first, s.resync_generation(&first).unwrap(), now);
    assert!(s.heartbeat_at(&Heartbeat::fixture(late), now), "its heartbeat asks again");
}

/// Found in review: an instance restarted under its id while this scheduler never saw it
/// leave numbers its events from 1 again; they were taken as old and dropped, the index
/// keeping its predecessor's cache. A first event after others asks for a resync.
#[test]
fn events_numbered_afresh_ask_for_a_resync() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    let id: InstanceId = "p".parse().unwrap();
    let event = |seq| stored(&id, seq);
    for seq in 1..=5 {
        assert!(!s.apply_event(event(seq)), "in step");
    }
    assert!(!s.apply_event(event(4)), "an old one is dropped");
    assert!(s.apply_event(event(1)), "numbered afresh: a resync");
}

/// Event `seq` of `id` numbered by process `incarnation`.
fn stored_by(id: &InstanceId, seq: u64, incarnation: u64) -> KvEvent {
    KvEvent { incarnation, ..stored(id, seq) }
}

/// A one-page snapshot of `id` at `seq` by process `incarnation`, holding nothing.
fn empty_snapshot(id: &InstanceId, seq: u64, incarnation: u64) -> KvSnapshot {
    KvSnapshot {
        instance: id.clone(),
        seq,
        incarnation,
        dp_blocks: vec![vec![]],
        dp_parents: vec![],
        snapshot: 0,
        page: 0,
        pages: 1,
    }
}

/// Found in review: a new instance's snapshot, answered as of its first event before that
/// event (queued behind its heartbeats) arrived, made the event look numbered afresh: a
/// second resync, and a restart warned of, for an instance starting under traffic. The
/// process that numbered an event tells them apart: its own event at or below the snapshot
/// is old; another process's is a restart, whatever its number (one numbered past this
/// one's was applied as the next).
#[test]
fn the_process_that_numbered_an_event_tells_old_from_restarted() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("p", 1), inst("q", 1)]));
    // In step from a first event, as from a snapshot.
    let q: InstanceId = "q".parse().unwrap();
    assert!(!s.apply_event(stored_by(&q, 1, 5)), "in step from its first event");
    assert!(!s.apply_event(stored_by(&q, 2, 5)), "in step");
    assert!(s.apply_event(stored_by(&q, 3, 6)), "another process's next number: a restart");
    let id: InstanceId = "p".parse().unwrap();
    assert!(s.apply_event(stored_by(&id, 2, 7)), "nothing known and not its first: a resync");
    assert_eq!(s.apply_snapshot(empty_snapshot(&id, 1, 7)), Resynced::Done);
    assert!(!s.apply_event(stored_by(&id, 1, 7)), "its own first event, behind the snapshot");
    assert!(!s.apply_event(stored_by(&id, 2, 7)), "in step");
    assert!(s.apply_event(stored_by(&id, 3, 9)), "another process's next number: a restart");
    // Replayed after a snapshot: another process's event buffered meanwhile starts it again.
    assert!(!s.apply_event(stored_by(&id, 4, 9)), "buffered while it resyncs");
    assert_eq!(s.apply_snapshot(empty_snapshot(&id, 5, 11)), Resynced::Again);
}
