//! handoff's KV index and selection against `dynamo-kv-router` 1.6.1 in the same run, on the
//! same shapes ([`shapes`]): two stored shapes (a shared system prompt; thousands of
//! distinct prompts) at several instance counts, each asked full hits, partial hits and
//! misses, 20k queries per shape. Every query is checked to get the same overlaps from all
//! three indexes before anything is timed.
//!
//! - Ingest: each side's event path, in two event orders, with its longest event ([`index`]).
//! - Match: ours behind the scheduler's lock against both Dynamo indexes ([`index`]).
//! - Selection: each router's whole per-request work, with requests booked and their
//!   prefixes pending ([`selection`]), and whether both pick the same worker.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin vs_dynamo [W,...]
//! ```
//!
//! With instance counts given (`vs_dynamo 1024`), only those rows run: for profiling one.

use std::io::Write;
use std::time::{Duration, Instant};

mod index;
mod selection;
mod shapes;

use shapes::{Ask, DISTINCT, SHARED, Stored};

pub(crate) const QUERIES: usize = 20_000;

/// Queries checked for the same pick, per shape.
const PICKS: usize = 2_000;

/// Median of five timings.
pub(crate) fn median5(mut f: impl FnMut() -> Duration) -> Duration {
    let mut t: Vec<Duration> = (0..5).map(|_| f()).collect();
    t.sort();
    t[2]
}

/// Median over batches of the mean time per call.
pub(crate) fn p50_per_call(mut f: impl FnMut(usize)) -> Duration {
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

fn us(d: Duration) -> String {
    format!("{:.2} us", d.as_secs_f64() * 1e6)
}

/// What one (stored shape, instance count) printed.
#[derive(Default)]
struct Rows {
    index: Vec<String>,
    ingest: Vec<String>,
    select: Vec<String>,
}

async fn measure(stored: &Stored, w_count: u64, rows: &mut Rows) -> anyhow::Result<()> {
    let built = index::build(stored, w_count).await?;
    let blocks = built.blocks as f64;
    for i in &built.ingests {
        let (ours, theirs) = (i.ours.total.as_secs_f64(), i.theirs.total.as_secs_f64());
        let ms = |d: Duration| format!("{:.2} ms", d.as_secs_f64() * 1e3);
        rows.ingest.push(format!(
            "| {} | {w_count} | {} | {} | {:.1} M blocks/s | {:.1} M blocks/s | {:.2}x | {} | {} |",
            stored.name,
            i.order.name(),
            built.blocks,
            blocks / ours / 1e6,
            blocks / theirs / 1e6,
            theirs / ours,
            ms(i.ours.worst),
            ms(i.theirs.worst),
        ));
    }
    for ask in Ask::ALL {
        let q = index::Queries::new(stored, ask, w_count);
        built.agree(w_count, &q)?;
        let m = built.match_times(w_count, &q);
        let faster = m.radix.min(m.concurrent);
        rows.index.push(format!(
            "| {} | {w_count} | {} | {} | {} | {} | {:.2}x |",
            stored.name,
            ask.name(),
            us(m.ours),
            us(m.radix),
            us(m.concurrent),
            m.ours.as_secs_f64() / faster.as_secs_f64()
        ));
        let backend = built.concurrent.backend();
        let dynamo = selection::Dynamo::new(backend, w_count, stored.depth);
        let (agree, unique) = selection::same_picks(&built.state, &dynamo, &q, stored.depth, PICKS);
        let ours = selection::time_ours(&built.state, &q, stored.depth);
        let theirs = dynamo.time(&q);
        let picks =
            if unique == 0 { "- (all tie)".to_owned() } else { format!("{agree}/{unique}") };
        rows.select.push(format!(
            "| {} | {w_count} | {} | {} | {} | {:.2}x | {picks} |",
            stored.name,
            ask.name(),
            us(ours),
            us(theirs),
            ours.as_secs_f64() / theirs.as_secs_f64()
        ));
        eprintln!("{} W={w_count} {}: done", stored.name, ask.name());
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut out = handoff_benches::record::Report::new("vs_dynamo");
    let mut rows = Rows::default();
    let only: Option<Vec<u64>> = match std::env::args().nth(1) {
        Some(a) => Some(
            a.split(',')
                .map(|w| w.parse().map_err(|e| anyhow::anyhow!("instance count {w:?}: {e}")))
                .collect::<anyhow::Result<_>>()?,
        ),
        None => None,
    };
    for (stored, counts) in [(SHARED, &[16u64, 128, 512, 1024][..]), (DISTINCT, &[16, 128, 512])] {
        for &w in counts.iter().filter(|w| only.as_ref().is_none_or(|o| o.contains(w))) {
            measure(&stored, w, &mut rows).await?;
        }
    }
    writeln!(
        out,
        "stored: \"{}\" = W x {} sequences of {} blocks sharing a {}-block prefix; \"{}\" = W x {} sequences of {} blocks, none shared. {QUERIES} queries per shape: hit (a stored sequence), partial (its first 3/4, then unseen blocks), miss (all unseen). Every query got the same overlaps from all three indexes.\n",
        SHARED.name,
        SHARED.per_worker,
        SHARED.depth,
        SHARED.prefix,
        DISTINCT.name,
        DISTINCT.per_worker,
        DISTINCT.depth,
    )?;
    writeln!(
        out,
        "| stored | W | query | match: handoff (locked) | Dynamo RadixTree | Dynamo concurrent | ratio to the faster Dynamo |"
    )?;
    writeln!(out, "|---|---:|---|---:|---:|---:|---:|")?;
    for r in &rows.index {
        writeln!(out, "{r}")?;
    }
    writeln!(out, "\nmatch: p50 per query; ratio < 1: handoff faster (target <= 0.5)\n")?;
    writeln!(
        out,
        "| stored | W | order | blocks | ingest: handoff apply_event | Dynamo RadixTree apply_event | ratio | longest event: handoff | Dynamo |"
    )?;
    writeln!(out, "|---|---:|---|---:|---:|---:|---:|---:|---:|")?;
    for r in &rows.ingest {
        writeln!(out, "{r}")?;
    }
    writeln!(
        out,
        "\ningest: median of 5 builds; ratio > 1: handoff faster (target >= 1). longest event: the slowest single event of a sixth build, timed one by one (how long the index is held from selections at worst; one build's maximum, so one preemption can set it)\n"
    )?;
    writeln!(
        out,
        "| stored | W | query | select: handoff | select: Dynamo | ratio | same pick (unique best) |"
    )?;
    writeln!(out, "|---|---:|---|---:|---:|---:|---:|")?;
    for r in &rows.select {
        writeln!(out, "{r}")?;
    }
    writeln!(
        out,
        "\nselect: p50 per request with {} requests booked on both sides (their prefixes pending); handoff target <= 10 us at 1024 instances. same pick: of the first {PICKS} queries whose longest overlap one worker alone holds, how many both sent there (nothing booked).",
        selection::OUTSTANDING
    )?;
    out.finish()?;
    Ok(())
}
