//! Selection while the index changes: one thread selects (and reports) as fast as it can over
//! a fleet of instances, first alone, then while another thread churns the state flat out:
//! KV events storing and evicting whole sequences, resyncs of an instance from a snapshot
//! (clearing and restoring its blocks), an instance leaving and joining again, and expiry
//! sweeps. Prints selection latency p50/p99/p99.9/max of both phases, and the churn done.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin churn
//! cargo run --release -p handoff-benches --bin churn -- --instances 1024 --seconds 5 --seed 2
//! cargo run --release -p handoff-benches --bin churn -- --mix events   # no resyncs or rejoins
//! cargo run --release -p handoff-benches --bin churn -- --rate 20000   # paced selections
//! ```

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff_benches::{DEPTH, PAGE, PER_WORKER, fleet, instance, parse_flags, sequence, worker};
use handoff_core::BlockHash;
use handoff_discovery::{KvEvent, KvEventKind, KvSnapshot, Update};
use handoff_scheduler::{Ask, Outcome, SchedulerState};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

struct Args {
    instances: u64,
    seconds: f64,
    seed: u64,
    /// Selections per second (0: as fast as one thread goes).
    rate: f64,
    /// Resyncs and leave-and-rejoins in the churn (`--mix events`: KV events and sweeps only).
    clears: bool,
}

/// What the churn thread knows of each instance: its live sequences and last event number.
struct Held {
    sequences: Vec<u64>,
    next_sequence: u64,
    seq: u64,
}

#[derive(Default, Debug)]
struct Churned {
    events: u64,
    resyncs: u64,
    rejoins: u64,
    sweeps: u64,
    /// Longest single operation of each kind (event, resync, rejoin, sweep), in µs.
    longest: [f64; 4],
}

fn event(w: u64, seq: u64, kind: KvEventKind) -> KvEvent {
    KvEvent { instance: worker(w).instance, dp_rank: 0, seq, incarnation: 0, kind }
}

fn stored(w: u64, s: u64) -> KvEventKind {
    KvEventKind::Stored { parent: None, blocks: sequence(w, s) }
}

/// A snapshot of what `h` holds, with parents.
fn snapshot(w: u64, h: &Held) -> KvSnapshot {
    let mut blocks: Vec<BlockHash> = Vec::new();
    let mut parents = Vec::new();
    for &s in &h.sequences {
        let seq = sequence(w, s);
        for (i, b) in seq.iter().enumerate() {
            blocks.push(*b);
            parents.push(i.checked_sub(1).map(|p| seq[p]));
        }
    }
    KvSnapshot {
        instance: worker(w).instance,
        seq: h.seq,
        incarnation: 0,
        dp_blocks: vec![blocks],
        dp_parents: vec![parents],
        snapshot: 0,
        page: 0,
        pages: 1,
    }
}

/// Changes the state flat out until `stop`.
fn churn(state: &SchedulerState, n: u64, seed: u64, clears: bool, stop: &AtomicBool) -> Churned {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut held: Vec<Held> = (0..n)
        .map(|_| Held {
            sequences: (0..PER_WORKER).collect(),
            next_sequence: PER_WORKER,
            seq: PER_WORKER,
        })
        .collect();
    let mut done = Churned::default();
    let mut round = 0u64;
    while !stop.load(Ordering::Relaxed) {
        round += 1;
        let w = rng.random_range(0..n);
        let h = &mut held[w as usize];
        let started = Instant::now();
        let kind = match round % 1000 {
            // A resync: a gap, then the instance's snapshot.
            0..=9 if clears => {
                h.seq += 2;
                state.apply_event(event(w, h.seq, KvEventKind::Cleared));
                state.apply_snapshot(snapshot(w, h));
                done.resyncs += 1;
                1
            }
            // The instance leaves and joins again, its sequences stored anew.
            10 if clears => {
                state.apply_update(Update::Remove(worker(w).instance));
                state.apply_update(Update::Add(instance(w)));
                h.seq = 0;
                for &s in &h.sequences {
                    h.seq += 1;
                    state.apply_event(event(w, h.seq, stored(w, s)));
                }
                done.rejoins += 1;
                2
            }
            11 => {
                state.sweep_at(Instant::now());
                done.sweeps += 1;
                3
            }
            // Evict the oldest sequence, store a new one.
            _ => {
                h.seq += 1;
                if h.sequences.len() >= PER_WORKER as usize {
                    let s = h.sequences.remove(0);
                    let blocks = sequence(w, s)[handoff_benches::PREFIX as usize..].to_vec();
                    state.apply_event(event(w, h.seq, KvEventKind::Removed { blocks }));
                } else {
                    let s = h.next_sequence;
                    h.next_sequence += 1;
                    h.sequences.push(s);
                    state.apply_event(event(w, h.seq, stored(w, s)));
                }
                done.events += 1;
                0
            }
        };
        let us = started.elapsed().as_secs_f64() * 1e6;
        done.longest[kind] = done.longest[kind].max(us);
    }
    done
}

/// Selection latencies (ns) for `seconds`, at `rate` per second (0: as fast as it goes).
fn select_for(state: &SchedulerState, n: u64, seconds: f64, rate: f64, seed: u64) -> Vec<u64> {
    let mut rng = StdRng::seed_from_u64(seed);
    let queries: Vec<Vec<BlockHash>> = (0..4096)
        .map(|_| sequence(rng.random_range(0..n), rng.random_range(0..PER_WORKER * 2)))
        .collect();
    let tokens = DEPTH as u32 * PAGE;
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    let mut took = Vec::new();
    let (mut q, begun) = (0, Instant::now());
    while Instant::now() < end {
        if rate > 0.0 {
            let due = begun + Duration::from_secs_f64(took.len() as f64 / rate);
            while Instant::now() < due {
                std::hint::spin_loop();
            }
        }
        q = (q + 1) % queries.len();
        let started = Instant::now();
        let sel = state.select(&Ask::new(&queries[q], tokens));
        took.push(started.elapsed().as_nanos() as u64);
        if let Ok(sel) = sel {
            state.report(sel.booking, Outcome::Success);
        }
    }
    took
}

fn pct(sorted: &[u64], p: f64) -> f64 {
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i] as f64 / 1e3
}

fn summary(out: &mut impl Write, label: &str, mut took: Vec<u64>) -> anyhow::Result<f64> {
    took.sort_unstable();
    let p99 = pct(&took, 0.99);
    writeln!(
        out,
        "| {label} | {} | {:.1} | {:.1} | {:.1} | {:.1} |",
        took.len(),
        pct(&took, 0.5),
        p99,
        pct(&took, 0.999),
        *took.last().unwrap_or(&0) as f64 / 1e3
    )?;
    Ok(p99)
}

fn main() -> anyhow::Result<()> {
    let mut a = Args { instances: 1024, seconds: 5.0, seed: 1, rate: 0.0, clears: true };
    parse_flags(|flag, val| {
        match flag {
            "--instances" => a.instances = val.parse()?,
            "--seconds" => a.seconds = val.parse()?,
            "--seed" => a.seed = val.parse()?,
            "--mix" => a.clears = val != "events",
            "--rate" => a.rate = val.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
        Ok(())
    })?;
    let state = Arc::new(fleet(a.instances));
    let mut out = handoff_benches::record::Report::new("churn");
    writeln!(
        out,
        "selection over {} instances ({} blocks each, kv_aware) {}, {} s per phase, seed {}, churn: {}",
        a.instances,
        PER_WORKER * DEPTH,
        if a.rate > 0.0 { format!("at {} /s", a.rate) } else { "flat out".into() },
        a.seconds,
        a.seed,
        if a.clears { "events, resyncs, rejoins, sweeps" } else { "events, sweeps" }
    )?;
    writeln!(out, "| phase | selections | p50 µs | p99 µs | p99.9 µs | max µs |")?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|")?;
    let quiet =
        summary(&mut out, "alone", select_for(&state, a.instances, a.seconds, a.rate, a.seed))?;
    let stop = Arc::new(AtomicBool::new(false));
    let (s, st, n, seed, clears) = (state.clone(), stop.clone(), a.instances, a.seed, a.clears);
    let churner = std::thread::spawn(move || churn(&s, n, seed, clears, &st));
    let busy = summary(
        &mut out,
        "under churn",
        select_for(&state, a.instances, a.seconds, a.rate, a.seed + 1),
    )?;
    stop.store(true, Ordering::Relaxed);
    let done = churner.join().map_err(|_| anyhow::anyhow!("churn thread panicked"))?;
    // The same churn with nobody selecting: what selections cost the ingest.
    let stop = Arc::new(AtomicBool::new(false));
    let (s, st, n, seed, clears) = (state.clone(), stop.clone(), a.instances, a.seed, a.clears);
    let churner = std::thread::spawn(move || churn(&s, n, seed, clears, &st));
    std::thread::sleep(Duration::from_secs_f64(a.seconds));
    stop.store(true, Ordering::Relaxed);
    let alone = churner.join().map_err(|_| anyhow::anyhow!("churn thread panicked"))?;
    writeln!(out)?;
    writeln!(
        out,
        "| churn | KV events/s | resyncs/s | leave-and-rejoins/s | longest event / resync / rejoin / sweep µs |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---|")?;
    for (label, c) in [("while selecting", &done), ("alone", &alone)] {
        let [e, r, j, w] = c.longest;
        writeln!(
            out,
            "| {label} | {:.0} | {:.0} | {:.0} | {e:.0} / {r:.0} / {j:.0} / {w:.0} |",
            c.events as f64 / a.seconds,
            c.resyncs as f64 / a.seconds,
            c.rejoins as f64 / a.seconds,
        )?;
    }
    writeln!(out, "selection p99 under churn / alone = {:.2}", busy / quiet)?;
    out.finish()?;
    Ok(())
}
