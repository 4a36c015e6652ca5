//! The index rows, both sides on the same shapes:
//! - ingest through each side's event path: our scheduler's `apply_event` (its lock, the
//!   sequence check, the index) against Dynamo's `RadixTree::apply_event`, events built
//!   beforehand and cloned inside the timing on both sides;
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
    pub(crate) ingest_ours: Duration,
    pub(crate) ingest_theirs: Duration,
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

/// Ingests `stored` for `w_count` instances on both sides (median of five fresh builds each).
pub(crate) async fn build(stored: &Stored, w_count: u64) -> anyhow::Result<Built> {
    let pairs: Vec<(u64, u64)> =
        (0..w_count).flat_map(|w| (0..stored.per_worker).map(move |s| (w, s))).collect();
    let ours_events: Vec<_> = pairs.iter().map(|&(w, s)| stored.event(w, s, s + 1)).collect();
    let their_events: Vec<_> =
        pairs.iter().map(|&(w, s)| dynamo_event(stored, w, s, s + 1)).collect();
    let fresh_state = || {
        let state = SchedulerState::new(SchedulerConfig::default());
        state.apply_update(Update::Reset((0..w_count).map(handoff_benches::instance).collect()));
        state
    };
    let mut state = fresh_state();
    let ingest_ours = median5(|| {
        state = fresh_state();
        let t = Instant::now();
        for ev in ours_events.iter().cloned() {
            black_box(state.apply_event(ev));
        }
        t.elapsed()
    });
    let mut radix = RadixTree::new();
    let mut failed = None;
    let ingest_theirs = median5(|| {
        radix = RadixTree::new();
        let t = Instant::now();
        for ev in their_events.iter().cloned() {
            if let Err(e) = radix.apply_event(ev) {
                failed = Some(format!("{e:?}"));
            }
        }
        t.elapsed()
    });
    if let Some(e) = failed {
        anyhow::bail!("Dynamo ingest failed: {e}");
    }
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
        ingest_ours,
        ingest_theirs,
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
