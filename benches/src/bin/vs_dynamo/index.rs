//! The index rows, both sides on the same shapes:
//! - ingest through each side's event path: our scheduler's `apply_event` (its lock, the
//!   sequence check, the index) against Dynamo's `RadixTree::apply_event`, events built
//!   beforehand and cloned inside the timing on both sides, in two orders (each instance's
//!   events together, and instances taking turns), with the longest single event;
//! - match: ours behind the lock the scheduler holds it with (a `parking_lot::Mutex`), against
//!   both of Dynamo's indexes, its single-threaded `RadixTree` and its concurrent compressed
//!   tree; every query is first checked to get the same overlaps from all three.

use std::collections::{BTreeMap, HashMap};
use std::hint::black_box;
use std::time::{Duration, Instant};

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent, WorkerWithDpRank,
};
use dynamo_kv_router::radix_tree::RadixTree;
use handoff_core::BlockHash;
use handoff_discovery::Update;
use handoff_kv_index::KvIndex;
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use parking_lot::Mutex;

use crate::shapes::{Ask, Stored};
use crate::{QUERIES, median5, p50_per_call};

/// One shape's queries, as each side takes them.
pub(crate) struct Queries {
    pub(crate) ask: Ask,
    pub(crate) ours: Vec<Vec<BlockHash>>,
    pub(crate) theirs: Vec<Vec<LocalBlockHash>>,
}

impl Queries {
    pub(crate) fn new(stored: &Stored, ask: Ask, w_count: u64) -> Self {
        let raw: Vec<Vec<u64>> =
            (0..QUERIES as u64).map(|q| stored.query(ask, w_count, q)).collect();
        Queries {
            ask,
            ours: raw.iter().map(|v| v.iter().copied().map(BlockHash).collect()).collect(),
            theirs: raw.iter().map(|v| v.iter().copied().map(LocalBlockHash).collect()).collect(),
        }
    }
}

/// What one stored shape at one instance count measured, and the indexes it built.
pub(crate) struct Built {
    /// Blocks stored in all.
    pub(crate) blocks: u64,
    /// Both sides' ingest, in each order.
    pub(crate) ingests: Vec<Ingest>,
    /// Our scheduler, holding the shape (for selection).
    pub(crate) state: SchedulerState,
    /// Dynamo's concurrent tree, holding it too (for selection).
    pub(crate) concurrent: ThreadPoolIndexer<ConcurrentRadixTreeCompressed>,
    radix: RadixTree,
    ours: Mutex<KvIndex>,
}

/// Match time per query: ours (locked), Dynamo's radix tree, Dynamo's concurrent tree.
pub(crate) struct Matched {
    pub(crate) ours: Duration,
    pub(crate) radix: Duration,
    pub(crate) concurrent: Duration,
}

fn dynamo_event(stored: &Stored, w: u64, s: u64, id: u64) -> RouterEvent {
    let blocks = stored
        .sequence(w, s)
        .into_iter()
        .map(|b| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(b),
            tokens_hash: LocalBlockHash(b),
            mm_extra_info: None,
        })
        .collect();
    let data = KvCacheEventData::Stored(KvCacheStoreData {
        parent_hash: None,
        start_position: None,
        blocks,
    });
    RouterEvent::new(w, KvCacheEvent { event_id: id, data, dp_rank: 0 })
}

/// The order a shape's events arrive in.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Order {
    /// Every event of instance 0, then of instance 1, and so on.
    ByInstance,
    /// One event of each instance in turn, as a fleet publishing at once delivers them.
    RoundRobin,
}

impl Order {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Order::ByInstance => "by instance",
            Order::RoundRobin => "round robin",
        }
    }

    /// (instance, sequence) of every event, in this order.
    fn pairs(self, stored: &Stored, w_count: u64) -> Vec<(u64, u64)> {
        let (per, n) = (stored.per_worker, w_count * stored.per_worker);
        match self {
            Order::ByInstance => (0..n).map(|i| (i / per, i % per)).collect(),
            Order::RoundRobin => (0..n).map(|i| (i % w_count, i / w_count)).collect(),
        }
    }
}

/// One side's ingest of one order.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ingested {
    /// The whole build, median of five.
    pub(crate) total: Duration,
    /// The longest any one event took, in a sixth build timed event by event: how long the
    /// index is held from everything else at worst (one build's maximum: a preemption or a
    /// page fault at the wrong moment sets it).
    pub(crate) worst: Duration,
}

/// Both sides' ingest of one order.
pub(crate) struct Ingest {
    pub(crate) order: Order,
    pub(crate) ours: Ingested,
    pub(crate) theirs: Ingested,
}

/// Builds with `apply` from `fresh()`, five times timed whole and once event by event;
/// returns the last whole build, its timings, and the first error `apply` reported.
fn ingest<T, E: Clone>(
    events: &[E],
    fresh: impl Fn() -> T,
    apply: impl Fn(&mut T, E) -> Result<(), String>,
) -> (T, Ingested, Option<String>) {
    let mut failed = None;
    let mut target = fresh();
    let mut build = |target: &mut T| {
        *target = fresh();
        let t = Instant::now();
        for ev in events.iter().cloned() {
            if let Err(e) = apply(target, ev) {
                failed.get_or_insert(e);
            }
        }
        t.elapsed()
    };
    let total = median5(|| build(&mut target));
    let mut again = fresh();
    let worst = events
        .iter()
        .cloned()
        .map(|ev| {
            let t = Instant::now();
            let _ = black_box(apply(&mut again, ev));
            t.elapsed()
        })
        .max()
        .unwrap_or_default();
    (target, Ingested { total, worst }, failed)
}

/// Both sides' ingest of `stored` for `w_count` instances in `order`: the last build of
/// each, the events Dynamo's took, and the timings. `Err` when either side did not apply an
/// event (ours: a gap in an instance's sequence; Dynamo's: an error).
fn ingest_in(
    stored: &Stored,
    w_count: u64,
    order: Order,
) -> anyhow::Result<(SchedulerState, RadixTree, Vec<RouterEvent>, Ingest)> {
    let fresh_state = || {
        let state = SchedulerState::new(SchedulerConfig::default());
        state.apply_update(Update::Reset((0..w_count).map(handoff_benches::instance).collect()));
        state
    };
    let pairs = order.pairs(stored, w_count);
    let ours_events: Vec<_> = pairs.iter().map(|&(w, s)| stored.event(w, s, s + 1)).collect();
    let their_events: Vec<_> =
        pairs.iter().map(|&(w, s)| dynamo_event(stored, w, s, s + 1)).collect();
    let (state, ours, failed) =
        ingest(&ours_events, fresh_state, |state, ev| match state.apply_event(ev) {
            true => Err("an event out of sequence (a resync would start)".to_owned()),
            false => Ok(()),
        });
    if let Some(e) = failed {
        anyhow::bail!("our ingest ({}) failed: {e}", order.name());
    }
    let (radix, theirs, failed) = ingest(&their_events, RadixTree::new, |radix, ev| {
        radix.apply_event(ev).map_err(|e| format!("{e:?}"))
    });
    if let Some(e) = failed {
        anyhow::bail!("Dynamo ingest ({}) failed: {e}", order.name());
    }
    Ok((state, radix, their_events, Ingest { order, ours, theirs }))
}

/// Ingests `stored` for `w_count` instances on both sides, in each [`Order`]; the indexes
/// kept for the match and selection rows are the ones built by instance.
pub(crate) async fn build(stored: &Stored, w_count: u64) -> anyhow::Result<Built> {
    let (state, radix, their_events, by_instance) = ingest_in(stored, w_count, Order::ByInstance)?;
    let (.., round_robin) = ingest_in(stored, w_count, Order::RoundRobin)?;
    let ingests = vec![by_instance, round_robin];
    let pairs = Order::ByInstance.pairs(stored, w_count);
    let concurrent = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, 16);
    for ev in their_events {
        concurrent.apply_event_and_wait(ev).await?;
    }
    let mut ours = KvIndex::default();
    for &(w, s) in &pairs {
        let seq: Vec<BlockHash> = stored.sequence(w, s).into_iter().map(BlockHash).collect();
        ours.store(&handoff_benches::worker(w), None, &seq);
    }
    Ok(Built {
        blocks: pairs.len() as u64 * stored.depth,
        ingests,
        state,
        concurrent,
        radix,
        ours: Mutex::new(ours),
    })
}

/// Overlap per worker (`w`), workers with none left out.
type Overlaps = BTreeMap<u64, usize>;

impl Built {
    /// Checks that every query gets the same overlaps from all three indexes.
    pub(crate) fn agree(&self, w_count: u64, q: &Queries) -> anyhow::Result<()> {
        let by_key: HashMap<_, u64> =
            (0..w_count).map(|w| (handoff_benches::worker(w), w)).collect();
        let ours = self.ours.lock();
        for (i, (o, t)) in q.ours.iter().zip(&q.theirs).enumerate() {
            let mine: Overlaps = ours.overlaps(o).iter().map(|(k, n)| (by_key[k], n)).collect();
            let theirs = |scores: rustc_hash::FxHashMap<WorkerWithDpRank, u32>| -> Overlaps {
                scores
                    .into_iter()
                    .filter(|(_, n)| *n > 0)
                    .map(|(k, n)| (k.worker_id, n as usize))
                    .collect()
            };
            let radix = theirs(self.radix.find_matches(t.clone(), false).scores);
            let conc = theirs(self.concurrent.backend().find_matches(t, false).scores);
            anyhow::ensure!(
                mine == radix && radix == conc,
                "{} query {i}: the indexes disagree (ours {mine:?}, radix {radix:?}, concurrent {conc:?})",
                q.ask.name()
            );
        }
        Ok(())
    }

    /// p50 match time per query of `q`, on each index.
    pub(crate) fn match_times(&self, w_count: u64, q: &Queries) -> Matched {
        let slots: Vec<_> = {
            let ours = self.ours.lock();
            (0..w_count).map(|w| ours.slot(&handoff_benches::worker(w))).collect()
        };
        let mut run = handoff_kv_index::Run::new();
        let ours = p50_per_call(|i| {
            let index = self.ours.lock();
            index.overlaps_into(&q.ours[i], &mut run);
            black_box(slots[i % w_count as usize].map(|s| run.at(s)));
        });
        // Its API takes the query by value: each call gets one made beforehand.
        let mut owned = q.theirs.clone();
        let radix = p50_per_call(|i| {
            let seq = std::mem::take(&mut owned[i]);
            black_box(self.radix.find_matches(seq, false).scores.len());
        });
        let backend = self.concurrent.backend();
        let concurrent = p50_per_call(|i| {
            black_box(backend.find_matches(&q.theirs[i], false).scores.len());
        });
        Matched { ours, radix, concurrent }
    }
}
