//! handoff's KV index and selection against `dynamo-kv-router` 1.6.1 in the same run, on the
//! same shapes: W instances each storing sequences of D blocks that share a P-block prefix;
//! 20k queries. Match: ours vs Dynamo's concurrent compressed radix tree (its fastest);
//! ingest: ours vs its single-threaded radix tree; selection: see [`selection`]. Prints
//! per-operation times and ratios.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin vs_dynamo
//! ```

use std::hint::black_box;
use std::io::Write;
use std::time::{Duration, Instant};

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::indexer::{SyncIndexer, ThreadPoolIndexer};
use dynamo_kv_router::protocols::{
    ExternalSequenceBlockHash, KvCacheEvent, KvCacheEventData, KvCacheStoreData,
    KvCacheStoredBlockData, LocalBlockHash, RouterEvent,
};
use dynamo_kv_router::radix_tree::RadixTree;
use handoff_benches::{DEPTH, PER_WORKER, PREFIX, block, worker};
use handoff_core::BlockHash;
use handoff_kv_index::KvIndex;

mod selection;

const QUERIES: usize = 20_000;

fn dynamo_event(w: u64, s: u64, id: u64) -> RouterEvent {
    let blocks = (0..DEPTH)
        .map(|d| KvCacheStoredBlockData {
            block_hash: ExternalSequenceBlockHash(block(w, s, d)),
            tokens_hash: LocalBlockHash(block(w, s, d)),
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

/// Median of five timings.
fn median5(mut f: impl FnMut() -> Duration) -> Duration {
    let mut t: Vec<Duration> = (0..5).map(|_| f()).collect();
    t.sort();
    t[2]
}

/// Median over batches of the mean time per call.
fn p50_per_call(mut f: impl FnMut(usize)) -> Duration {
    let batch = 100;
    let mut samples: Vec<Duration> = (0..QUERIES / batch)
        .map(|b| {
            let t = Instant::now();
            for q in 0..batch {
                f(b * batch + q);
            }
            t.elapsed() / batch as u32
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut out = handoff_benches::record::Report::new("vs_dynamo");
    writeln!(
        out,
        "shapes: W workers x {PER_WORKER} sequences of {DEPTH} blocks sharing a {PREFIX}-block prefix; {QUERIES} queries\n"
    )?;
    writeln!(
        out,
        "| W | match: handoff | match: Dynamo concurrent | ratio | ingest: handoff | ingest: Dynamo radix | ratio |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut selections = Vec::new();
    for w_count in [16u64, 128, 512, 1024] {
        // Ingest, ours (median of 5 fresh builds; the last one is kept for matching).
        let mut ours = KvIndex::default();
        let ours_ingest = median5(|| {
            let t = Instant::now();
            ours = KvIndex::default();
            for w in 0..w_count {
                let key = worker(w);
                for s in 0..PER_WORKER {
                    ours.store(&key, None, &handoff_benches::sequence(w, s));
                }
            }
            t.elapsed()
        });
        // Ingest, Dynamo's single-threaded radix tree (events cloned inside, as ours builds
        // its sequences inside).
        let events: Vec<RouterEvent> = (0..w_count)
            .flat_map(|w| (0..PER_WORKER).map(move |s| dynamo_event(w, s, s + 1)))
            .collect();
        let mut failed = None;
        let dyn_ingest = median5(|| {
            let t = Instant::now();
            let mut tree = RadixTree::new();
            for ev in events.clone() {
                if let Err(e) = tree.apply_event(ev) {
                    failed = Some(format!("{e:?}"));
                }
            }
            t.elapsed()
        });
        if let Some(e) = failed {
            anyhow::bail!("Dynamo ingest failed: {e}");
        }
        let blocks = (w_count * PER_WORKER * DEPTH) as f64;
        // Dynamo's concurrent compressed tree, fed through its thread-pool indexer.
        let concurrent = ThreadPoolIndexer::new(ConcurrentRadixTreeCompressed::new(), 1, 16);
        for ev in events {
            concurrent.apply_event_and_wait(ev).await?;
        }
        let queries: Vec<(Vec<BlockHash>, Vec<LocalBlockHash>)> = (0..QUERIES as u64)
            .map(|q| {
                let (w, s) = (q % w_count, q % PER_WORKER);
                let ours = handoff_benches::sequence(w, s);
                let theirs = (0..DEPTH).map(|d| LocalBlockHash(block(w, s, d))).collect();
                (ours, theirs)
            })
            .collect();
        let backend = concurrent.backend();
        // Same answer first: the full-depth match for the query's own worker.
        let (o, d) = (ours.overlaps(&queries[0].0), backend.find_matches(&queries[0].1, false));
        let theirs_best = d.scores.values().map(|s| *s as usize).max().unwrap_or(0);
        anyhow::ensure!(
            o.get(&worker(0)) == DEPTH as usize && theirs_best == DEPTH as usize,
            "indexes disagree"
        );
        // The scheduler's way: one reused buffer, read by slot.
        let slots: Vec<_> = (0..w_count).map(|w| ours.slot(&worker(w))).collect();
        let mut run = Vec::new();
        let ours_match = p50_per_call(|q| {
            ours.overlaps_into(&queries[q].0, &mut run);
            black_box(slots[q % w_count as usize].map(|s| run[s.index()]));
        });
        let dyn_match = p50_per_call(|q| {
            black_box(backend.find_matches(&queries[q].1, false).scores.len());
        });
        let ours_state = handoff_benches::fleet(w_count);
        let ours_queries: Vec<Vec<BlockHash>> = queries.iter().map(|q| q.0.clone()).collect();
        let their_queries: Vec<Vec<LocalBlockHash>> = queries.iter().map(|q| q.1.clone()).collect();
        selections.push((
            w_count,
            selection::time_ours(&ours_state, &ours_queries),
            selection::time_dynamo(backend, w_count, &their_queries),
        ));
        writeln!(
            out,
            "| {w_count} | {:.2} us | {:.2} us | {:.2}x | {:.1} M blocks/s | {:.1} M blocks/s | {:.2}x |",
            ours_match.as_secs_f64() * 1e6,
            dyn_match.as_secs_f64() * 1e6,
            ours_match.as_secs_f64() / dyn_match.as_secs_f64(),
            blocks / ours_ingest.as_secs_f64() / 1e6,
            blocks / dyn_ingest.as_secs_f64() / 1e6,
            (blocks / ours_ingest.as_secs_f64()) / (blocks / dyn_ingest.as_secs_f64()),
        )?;
    }
    writeln!(
        out,
        "\nmatch ratio < 1: handoff faster (target <= 0.5); ingest ratio > 1: handoff faster (target >= 1)"
    )?;
    writeln!(out, "\n| W | select: handoff | select: Dynamo | ratio |")?;
    writeln!(out, "|---:|---:|---:|---:|")?;
    for (w, ours, theirs) in selections {
        writeln!(
            out,
            "| {w} | {:.2} us | {:.2} us | {:.2}x |",
            ours.as_secs_f64() * 1e6,
            theirs.as_secs_f64() * 1e6,
            ours.as_secs_f64() / theirs.as_secs_f64()
        )?;
    }
    writeln!(out, "\nselect: handoff target <= 10 us at 1024 instances")?;
    out.finish()?;
    Ok(())
}
