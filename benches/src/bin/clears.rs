//! Clearing many workers' index entries at once (a fleet's resyncs after a NATS outage, a
//! rack gone): the same clears one after another (each a scan of the whole tree, as before
//! the twenty-ninth session) and begun together (sharing their scans), over one index
//! built afresh for each, stepping 512 nodes at a time as the scheduler does. Prints the
//! time of each, their ratio, the steps taken and the longest step (the scheduler's
//! longest hold of its lock for them).
//!
//! ```text
//! cargo run --release -p handoff-benches --bin clears
//! ```

use std::io::Write;
use std::time::Instant;

use handoff_benches::{sequence, worker};
use handoff_kv_index::KvIndex;

/// Nodes scanned per step (the scheduler's `CLEAN_NODES`).
const STEP: usize = 512;

/// An index of `workers` workers, each holding `per_worker` sequences behind the shared
/// prefix: about `workers * per_worker` nodes.
fn index(workers: u64, per_worker: u64) -> KvIndex {
    let mut idx = KvIndex::default();
    for w in 0..workers {
        for s in 0..per_worker {
            idx.store(&worker(w), None, &sequence(w, s));
        }
    }
    idx
}

/// What clearing took: seconds in all, steps, and the longest step (the lock's longest hold
/// in the scheduler) in µs.
struct Took {
    seconds: f64,
    steps: u64,
    longest_us: f64,
}

/// Steps `idx`'s clears until none is left, into `took`.
fn settle(idx: &mut KvIndex, took: &mut Took) {
    loop {
        let step = Instant::now();
        let done = idx.clean_some(STEP);
        took.longest_us = took.longest_us.max(step.elapsed().as_secs_f64() * 1e6);
        took.steps += 1;
        if done {
            return;
        }
    }
}

/// Clears the first `cleared` workers of `idx`: one after another, or begun together.
fn clear(mut idx: KvIndex, cleared: u64, together: bool) -> Took {
    let slots: Vec<_> = (0..cleared).filter_map(|w| idx.slot(&worker(w))).collect();
    let started = Instant::now();
    let mut took = Took { seconds: 0.0, steps: 0, longest_us: 0.0 };
    if together {
        slots.iter().for_each(|s| idx.begin_clear_at(*s));
        settle(&mut idx, &mut took);
    } else {
        for s in &slots {
            idx.begin_clear_at(*s);
            settle(&mut idx, &mut took);
        }
    }
    took.seconds = started.elapsed().as_secs_f64();
    assert!(slots.iter().all(|s| idx.held_at(*s) == 0), "every cleared worker holds nothing");
    took
}

fn main() -> anyhow::Result<()> {
    let mut out = handoff_benches::record::Report::new("clears");
    writeln!(
        out,
        "clearing workers' index entries, {STEP} nodes a step (one build of the index per cell)"
    )?;
    writeln!(
        out,
        "| workers | sequences each | cleared | one after another ms | together ms | ratio | steps one by one | steps together | longest step one by one µs | longest step together µs |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for (workers, per_worker, cleared) in
        [(1024, 64, 1), (1024, 64, 16), (1024, 64, 1024), (4096, 16, 64), (4096, 16, 4096)]
    {
        let apart = clear(index(workers, per_worker), cleared, false);
        let shared = clear(index(workers, per_worker), cleared, true);
        writeln!(
            out,
            "| {workers} | {per_worker} | {cleared} | {:.2} | {:.2} | {:.3} | {} | {} | {:.0} | {:.0} |",
            apart.seconds * 1e3,
            shared.seconds * 1e3,
            shared.seconds / apart.seconds,
            apart.steps,
            shared.steps,
            apart.longest_us,
            shared.longest_us,
        )?;
    }
    out.finish()?;
    Ok(())
}
