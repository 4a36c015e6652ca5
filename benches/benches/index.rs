//! The KV index and selection on the shapes of the Dynamo comparison: W instances each
//! storing sequences of D blocks that share a P-block prefix; queries are such sequences.
//!
//! ```text
//! cargo bench -p handoff-benches --bench index
//! ```

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use handoff_benches::{DEPTH, PAGE, PER_WORKER, fleet, sequence, worker};
use handoff_kv_index::KvIndex;
use handoff_scheduler::{Ask, Outcome};

fn filled(workers: u64, blocks: u64) -> KvIndex {
    let mut idx = KvIndex::default();
    let per = (blocks / workers / DEPTH).max(1);
    for w in 0..workers {
        for s in 0..per {
            idx.store(&worker(w), None, &sequence(w, s));
        }
    }
    idx
}

fn ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("index_ingest");
    for blocks in [10_000u64, 100_000, 1_000_000] {
        g.throughput(Throughput::Elements(blocks));
        g.bench_with_input(BenchmarkId::from_parameter(blocks), &blocks, |b, &n| {
            b.iter(|| black_box(filled(16, n).len()))
        });
    }
    g.finish();
}

fn matching(c: &mut Criterion) {
    let mut g = c.benchmark_group("index_match");
    for workers in [16u64, 128, 512, 1024] {
        let idx = filled(workers, (workers * DEPTH * PER_WORKER).min(1_000_000));
        let queries: Vec<_> =
            (0..20_000u64).map(|q| sequence(q % workers, q % PER_WORKER)).collect();
        let (mut q, mut run) = (0, handoff_kv_index::Run::new());
        g.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            b.iter(|| {
                q = (q + 1) % queries.len();
                idx.overlaps_into(&queries[q], &mut run);
                black_box(run.held().count())
            })
        });
    }
    g.finish();
}

fn selection(c: &mut Criterion) {
    let mut g = c.benchmark_group("select_kv_aware");
    for workers in [16u64, 128, 512, 1024] {
        let state = fleet(workers);
        let query = sequence(0, 0);
        let tokens = DEPTH as u32 * PAGE;
        g.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            b.iter(|| {
                let s = state.select(&Ask::new(&query, tokens)).unwrap();
                state.report(s.booking, Outcome::Success);
                black_box(s.dp_rank)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, ingest, matching, selection);
criterion_main!(benches);
