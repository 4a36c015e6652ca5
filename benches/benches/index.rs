//! The KV index and selection on the shapes of the Dynamo comparison: W instances each
//! storing sequences of D blocks that share a P-block prefix; queries are such sequences.
//!
//! ```text
//! cargo bench -p handoff-benches --bench index
//! ```

use std::hint::black_box;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use handoff_core::{BlockHash, InstanceId};
use handoff_discovery::{Instance, KvEvent, KvEventKind, Role, Topology, Update};
use handoff_kv_index::{KvIndex, WorkerKey};
use handoff_scheduler::{SchedulerConfig, SchedulerState, Work};

const DEPTH: usize = 64;
const PREFIX: usize = 32;

fn key(i: usize) -> WorkerKey {
    WorkerKey { instance: InstanceId::try_from(format!("p{i}")).unwrap(), dp_rank: 0 }
}

/// Sequence `s` of worker `w`: the shared prefix, then blocks of its own.
fn sequence(w: usize, s: usize) -> Vec<BlockHash> {
    (0..DEPTH as u64)
        .map(|d| {
            if (d as usize) < PREFIX {
                BlockHash(d)
            } else {
                BlockHash((w as u64) << 40 | (s as u64) << 16 | d)
            }
        })
        .collect()
}

fn filled(workers: usize, blocks: usize) -> KvIndex {
    let mut idx = KvIndex::default();
    let per = (blocks / workers / DEPTH).max(1);
    for w in 0..workers {
        for s in 0..per {
            idx.store(&key(w), None, &sequence(w, s));
        }
    }
    idx
}

fn ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("index_ingest");
    for blocks in [10_000usize, 100_000, 1_000_000] {
        g.throughput(Throughput::Elements(blocks as u64));
        g.bench_with_input(BenchmarkId::from_parameter(blocks), &blocks, |b, &n| {
            b.iter(|| black_box(filled(16, n).len()))
        });
    }
    g.finish();
}

fn matching(c: &mut Criterion) {
    let mut g = c.benchmark_group("index_match");
    for workers in [16usize, 128, 512, 1024] {
        let blocks = (workers * DEPTH * 16).min(1_000_000);
        let idx = filled(workers, blocks);
        let queries: Vec<Vec<BlockHash>> =
            (0..20_000).map(|q| sequence(q % workers, q % 16)).collect();
        let mut q = 0;
        g.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            b.iter(|| {
                q = (q + 1) % queries.len();
                black_box(idx.overlaps(&queries[q]).len())
            })
        });
    }
    g.finish();
}

fn selection(c: &mut Criterion) {
    let mut g = c.benchmark_group("select_kv_aware");
    for workers in [16usize, 128, 512, 1024] {
        let state = SchedulerState::new(SchedulerConfig::default());
        let all = (0..workers)
            .map(|i| Instance {
                id: key(i).instance,
                role: Role::Prefill,
                model: "m".into(),
                bootstrap_addr: "127.0.0.1:1".into(),
                grpc_addr: "127.0.0.1:2".into(),
                topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
                page_size: 16,
                version: 1,
            })
            .collect();
        state.apply_update(Update::Reset(all));
        // The same shapes as the match bench: every instance holds 16 sequences.
        for w in 0..workers {
            for s in 0..16 {
                state.apply_event(KvEvent {
                    instance: key(w).instance,
                    dp_rank: 0,
                    seq: s as u64 + 1,
                    kind: KvEventKind::Stored { parent: None, blocks: sequence(w, s) },
                });
            }
        }
        let query = sequence(0, 0);
        g.bench_with_input(BenchmarkId::from_parameter(workers), &workers, |b, _| {
            b.iter(|| {
                let s = state.select(&query, (DEPTH * 16) as u32, None, &[]).unwrap();
                state.report(
                    &s.instance.id,
                    s.dp_rank,
                    Work::new((DEPTH * 16) as u32, s.cached_blocks),
                    Some(true),
                );
                black_box(s.dp_rank)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, ingest, matching, selection);
criterion_main!(benches);
