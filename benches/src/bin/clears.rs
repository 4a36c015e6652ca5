//! Clearing many workers' index entries at once (a fleet's resyncs after a NATS outage, a
//! rack gone): the same clears one after another (each a scan of the whole tree, as before
//! the twenty-ninth session) and begun together (sharing their scans), over one index
//! built afresh for each, stepping 512 nodes at a time as the scheduler does. Prints the
//! time of each, their ratio, and the steps taken.
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

/// Clears the first `cleared` workers of `idx`: one after another, or begun together.
/// Returns the seconds taken and the steps.
fn clear(mut idx: KvIndex, cleared: u64, together: bool) -> (f64, u64) {
    let slots: Vec<_> = (0..cleared).filter_map(|w| idx.slot(&worker(w))).collect();
    let started = Instant::now();
    let mut steps = 0u64;
    if together {
        slots.iter().for_each(|s| idx.begin_clear_at(*s));
        loop {
            steps += 1;
            if idx.clean_some(STEP) {
                break;
            }
        }
    } else {
        for s in &slots {
            idx.begin_clear_at(*s);
            loop {
                steps += 1;
                if idx.clean_some(STEP) {
                    break;
                }
            }
        }
    }
    let took = started.elapsed().as_secs_f64();
    assert!(slots.iter().all(|s| idx.held_at(*s) == 0), "every cleared worker holds nothing");
    (took, steps)
}

fn main() -> anyhow::Result<()> {
    let mut out = handoff_benches::record::Report::new("clears");
    writeln!(
        out,
        "clearing workers' index entries, {STEP} nodes a step (one build of the index per cell)"
    )?;
    writeln!(
        out,
        "| workers | sequences each | cleared | one after another ms | together ms | ratio | steps one by one | steps together |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    for (workers, per_worker, cleared) in
        [(1024, 64, 1), (1024, 64, 16), (1024, 64, 1024), (4096, 16, 64), (4096, 16, 4096)]
    {
        let (apart, steps_apart) = clear(index(workers, per_worker), cleared, false);
        let (shared, steps_shared) = clear(index(workers, per_worker), cleared, true);
        writeln!(
            out,
            "| {workers} | {per_worker} | {cleared} | {:.2} | {:.2} | {:.3} | {steps_apart} | {steps_shared} |",
            apart * 1e3,
            shared * 1e3,
            shared / apart,
        )?;
    }
    out.finish()?;
    Ok(())
}
