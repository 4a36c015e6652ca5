//! Fuzzes every decoder of network bytes (see `handoff_benches::fuzz`) with N inputs each
//! (default 10^6) and prints inputs per second and failures; exits non-zero on any failure.
//! Allocation is bounded: the heap may grow at most 256 MiB past where each decoder's run
//! began (an input that needs more aborts the run), and the peak is printed.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin fuzz
//! cargo run --release -p handoff-benches --bin fuzz -- --inputs 200000 --seed 3
//! ```

use std::alloc::System;
use std::io::Write;

use cap::Cap;

use handoff_benches::fuzz;
use handoff_benches::parse_flags;

#[global_allocator]
static HEAP: Cap<System> = Cap::new(System, usize::MAX);

/// How far the heap may grow past its size when a decoder's run begins.
const HEADROOM: usize = 256 << 20;

/// Caps the heap at its current size plus [`HEADROOM`].
fn cap_heap() -> anyhow::Result<()> {
    HEAP.set_limit(HEAP.allocated() + HEADROOM)
        .map_err(|()| anyhow::anyhow!("the heap is already past its cap"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let (mut inputs, mut seed) = (1_000_000u64, 1u64);
    parse_flags(|flag, val| {
        match flag {
            "--inputs" => inputs = val.parse()?,
            "--seed" => seed = val.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
        Ok(())
    })?;
    let baseline = HEAP.allocated();
    cap_heap()?;
    let frames = fuzz::transfer_frames(inputs, seed).await;
    cap_heap()?;
    let http = fuzz::bootstrap_http(inputs, seed).await;
    cap_heap()?;
    let bus = fuzz::bus_payloads(inputs, seed);
    let reports = [frames, http, bus];
    let mut out = handoff_benches::record::Report::new("fuzz");
    writeln!(out, "| decoder | inputs | inputs/s | failures |")?;
    writeln!(out, "|---|---:|---:|---:|")?;
    for r in &reports {
        writeln!(
            out,
            "| {} | {} | {:.0} | {} |",
            r.name,
            r.inputs,
            r.inputs as f64 / r.secs.max(1e-9),
            r.failed
        )?;
    }
    for r in &reports {
        for f in &r.failures {
            writeln!(out, "{}: {f}", r.name)?;
        }
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    writeln!(
        out,
        "heap: {:.1} MiB at the start, peak {:.1} MiB over the run (each decoder capped at +{} MiB)",
        mib(baseline),
        mib(HEAP.max_allocated()),
        HEADROOM >> 20
    )?;
    out.finish()?;
    if reports.iter().any(|r| r.failed > 0) {
        anyhow::bail!("fuzzing found failures");
    }
    Ok(())
}
