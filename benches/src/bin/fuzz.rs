//! Fuzzes every decoder of network bytes (see `handoff_benches::fuzz`) with N inputs each
//! (default 10^6) and prints inputs per second and failures; exits non-zero on any failure.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin fuzz
//! cargo run --release -p handoff-benches --bin fuzz -- --inputs 200000 --seed 3
//! ```

use std::io::Write;

use handoff_benches::fuzz::{self, Report};
use handoff_benches::parse_flags;

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
    let reports: Vec<Report> = vec![
        fuzz::transfer_frames(inputs, seed).await,
        fuzz::bootstrap_http(inputs, seed).await,
        fuzz::bus_payloads(inputs, seed),
    ];
    let mut out = std::io::stdout().lock();
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
        for f in &r.failures {
            writeln!(out, "  {f}")?;
        }
    }
    if reports.iter().any(|r| r.failed > 0) {
        anyhow::bail!("fuzzing found failures");
    }
    Ok(())
}
