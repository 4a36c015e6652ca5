//! The load generator's results: one row per policy and seed, the means and spread over the
//! seeds, and the Markdown table they are printed as.

use std::io::Write;
use std::time::Duration;

use handoff_benches::record::Report as Record;
use handoff_proto::v1::Policy;

use crate::{Args, Report};

pub(crate) fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

pub(crate) fn name(p: Policy) -> &'static str {
    match p {
        Policy::KvAware => "kv_aware",
        Policy::RoundRobin => "round_robin",
        Policy::Random => "random",
        Policy::PowerOfTwo => "power_of_two",
        Policy::PrefixHash => "prefix_hash",
        Policy::Unspecified => "default",
    }
}

/// One policy on one seed.
pub(crate) struct Row {
    pub(crate) hit: f64,
    pub(crate) ceiling: f64,
    pub(crate) ttft: [Duration; 3],
    pub(crate) itl: Duration,
    pub(crate) tps: f64,
    pub(crate) requests: usize,
    pub(crate) errors: usize,
}

/// One policy over every seed.
pub(crate) struct Summary {
    pub(crate) policy: &'static str,
    pub(crate) runs: Vec<Row>,
}

impl Summary {
    /// The mean, least and greatest of `f` over the seeds.
    pub(crate) fn spread(&self, f: impl Fn(&Row) -> f64) -> (f64, f64, f64) {
        let v: Vec<f64> = self.runs.iter().map(f).collect();
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (mean, min, max)
    }
}

/// A run's row.
pub(crate) fn row_of(mut r: Report) -> Row {
    let prompt: u64 = r.samples.iter().map(|s| u64::from(s.prompt)).sum();
    let cached: u64 = r.samples.iter().map(|s| u64::from(s.cached)).sum();
    let ceiling: u64 = r.samples.iter().map(|s| u64::from(s.ceiling)).sum();
    let generated: u64 = r.samples.iter().map(|s| u64::from(s.generated)).sum();
    let mut ttft: Vec<Duration> = r.samples.iter().map(|s| s.ttft).collect();
    let mut itl: Vec<Duration> = r.samples.iter().filter_map(|s| s.itl).collect();
    Row {
        hit: if prompt == 0 { 0.0 } else { cached as f64 / prompt as f64 },
        ceiling: if prompt == 0 { 0.0 } else { ceiling as f64 / prompt as f64 },
        ttft: [pct(&mut ttft, 0.5), pct(&mut ttft, 0.95), pct(&mut ttft, 0.99)],
        itl: pct(&mut itl, 0.5),
        tps: generated as f64 / r.wall.as_secs_f64(),
        requests: r.samples.len(),
        errors: std::mem::take(&mut r.errors),
    }
}

/// Writes `rows`, the policies run on `a`'s cluster and workload, as a Markdown table.
pub(crate) fn write(out: &mut Record, a: &Args, rows: &[Summary]) -> anyhow::Result<()> {
    let cluster = match &a.frontend {
        Some(f) => format!("the cluster at {f}"),
        None => format!(
            "{} instances (mock prefill {} us/token, decode {} us/token, KV {} B/token, cache {} MB each)",
            a.instances,
            a.prefill_us,
            a.decode_us,
            a.kv.token_bytes(),
            a.cache_bytes >> 20
        ),
    };
    writeln!(
        out,
        "{cluster}; {} users x {} turns, {} system prompts of {} tokens, {}-token questions, {}-token answers, {} req/s for {} s\n",
        a.users,
        a.turns,
        a.systems,
        a.system_tokens,
        a.question_tokens,
        a.answer_tokens,
        a.rate,
        a.seconds,
    )?;
    writeln!(out, "mean over {} seeds; min and max beside\n", a.seeds)?;
    writeln!(
        out,
        "| policy | hit rate % | hit min | hit max | ceiling % | TTFT p50 (ms) | p50 min | p50 max | TTFT p95 (ms) | TTFT p99 (ms) | ITL p50 (ms) | tokens/s | requests (all seeds) | errors (all seeds) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    for r in rows {
        let hit = r.spread(|x| x.hit * 100.0);
        let p50 = r.spread(|x| ms(x.ttft[0]));
        writeln!(
            out,
            "| {} | {:.1} | {:.1} | {:.1} | {:.1} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {} | {} |",
            r.policy,
            hit.0,
            hit.1,
            hit.2,
            r.spread(|x| x.ceiling * 100.0).0,
            p50.0,
            p50.1,
            p50.2,
            r.spread(|x| ms(x.ttft[1])).0,
            r.spread(|x| ms(x.ttft[2])).0,
            r.spread(|x| ms(x.itl)).0,
            r.spread(|x| x.tps).0,
            r.runs.iter().map(|x| x.requests).sum::<usize>(),
            r.runs.iter().map(|x| x.errors).sum::<usize>(),
        )?;
    }
    Ok(())
}
