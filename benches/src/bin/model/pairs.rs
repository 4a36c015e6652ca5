//! TTFT through each transfer backend beside the engine alone on the same prompts.
//!
//! The engine alone is its prefill in this process: no decoder, no gRPC, no cache (the
//! unflattering comparison). The two run in turn prompt by prompt, which goes first
//! alternating, so the machine's stretches move both alike; the table gives each side's
//! median, the median of the paired differences with its quartiles, the process's CPU
//! beyond the engine alone's, and the path's threads' own: every thread but the engine's
//! compute threads ([`ENGINE_THREADS`]), whose CPU moves with the compute by more than the
//! path's whole CPU (tens of ms between runs of the same prompt).
//!
//! After each path request the bench waits until the prefill is idle (nothing running,
//! nothing being stored in its prefix cache) and counts the CPU up to there: the store runs
//! after the answer, and would otherwise land in the next run's time, the engine alone's
//! half the time. Each shape's pairs follow prompts that fill the prefill's prefix cache
//! ([`CACHE_BYTES`]): the steady state of a prefill that keeps what it computed.

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_benches::path::{ThreadsCpu, cache_fill, one_token, process_cpu};
use handoff_benches::record::Report;
use handoff_engine::{Engine, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_response::Event;
use handoff_smollm::SmolLm;
use handoff_transfer::TransferKind;
use serde_json::json;
use tonic::transport::Channel;

use super::{ms, prompt};

/// The prefill's prefix cache budget on the backends' clusters: 5 prompts of 256 tokens or
/// one of 1024 (SmolLM2's 45 KiB a token), so a few prompts fill it.
const CACHE_BYTES: usize = 64 << 20;

/// The names SmolLM's compute threads start with (its worker and pool, and candle's pool).
const ENGINE_THREADS: &[&str] = &["smollm-", "candle-bp"];

/// Longest the bench waits for a prefill to be idle after a request.
const SETTLE_LIMIT: Duration = Duration::from_secs(10);

/// Prompts of one length, and how many pairs run on them (even: each side goes first
/// equally often).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) tokens: usize,
    pub(crate) pairs: u32,
    /// Salt of the first prompt; the others follow. Distinct across shapes and from the
    /// fill's, so no prompt shares a prefix with another (nothing cached).
    pub(crate) first_salt: u32,
}

/// One path request: its TTFT, and the process's CPU to the first token and to the
/// prefill's idle.
#[derive(Debug, Clone, Copy)]
struct PathRun {
    ttft: Duration,
    cpu_first: Duration,
    cpu_idle: Duration,
    /// The CPU of every thread but the engine's compute threads, to the first token.
    threads_first: Duration,
}

/// The engine alone on one prompt: its time and the process's CPU over it.
#[derive(Debug, Clone, Copy)]
struct EngineRun {
    took: Duration,
    cpu: Duration,
    /// The CPU of every thread but the engine's compute threads (the cluster idling).
    threads: Duration,
}

#[derive(Debug)]
struct Pair {
    path: PathRun,
    engine: EngineRun,
}

/// A cluster on one backend with one prefill, and a client of its frontend.
struct Path {
    cluster: Cluster,
    client: GenerateClient<Channel>,
}

/// Runs every shape's pairs on each backend, and writes the table and the raw pairs.
pub(crate) async fn by_backend(
    out: &mut Report,
    e: &SmolLm,
    shapes: &[Shape],
    backends: impl IntoIterator<Item = (&str, TransferKind)>,
) -> anyhow::Result<()> {
    let token_bytes = e.info().shape.token_bytes();
    let fills: Vec<usize> =
        shapes.iter().map(|s| cache_fill(CACHE_BYTES, s.tokens, token_bytes)).collect();
    out.note(
        "shapes",
        json!(shapes.iter().map(|s| [s.tokens as u32, s.pairs, s.first_salt]).collect::<Vec<_>>()),
    );
    out.note("prefill_cache_bytes", json!(CACHE_BYTES));
    let mut fill_salt = 500;
    let mut rows = Vec::new();
    for (label, transfer) in backends {
        let mut path = Path::start(e, transfer).await?;
        for (shape, &fill) in shapes.iter().zip(&fills) {
            for _ in 0..fill {
                fill_salt += 1;
                path.run(prompt(shape.tokens, fill_salt)).await?;
            }
            let mut pairs = Vec::new();
            for i in 0..shape.pairs {
                let p = prompt(shape.tokens, shape.first_salt + i);
                let engine_first = i % 2 == 0;
                let mut engine = None;
                if engine_first {
                    engine = Some(engine_alone(e, &p).await?);
                }
                let path = path.run(p.clone()).await?;
                let engine = match engine {
                    Some(engine) => engine,
                    None => engine_alone(e, &p).await?,
                };
                pairs.push(Pair { path, engine });
            }
            rows.push((label.to_owned(), shape.tokens, pairs));
        }
        path.cluster.shutdown().await;
    }
    write_table(out, &fills, &rows)
}

fn write_table(
    out: &mut Report,
    fills: &[usize],
    rows: &[(String, usize, Vec<Pair>)],
) -> anyhow::Result<()> {
    writeln!(
        out,
        "\nTTFT by transfer backend beside the engine alone (its prefill, no decoder, no gRPC) on the same prompts, in turn prompt by prompt, which goes first alternating, after {fills:?} prompts that fill the prefill's {} MiB prefix cache. Medians of each side; the paired differences' median and quartiles (interpolated); vs engine = that median over the engine's; the process's CPU beyond the engine alone's, up to the first token and up to the prefill's idle (its prompt stored in its cache), and that of every thread but the engine's compute threads (the path's own) to the first token; the bench's own gRPC client is in the path's:",
        CACHE_BYTES >> 20,
    )?;
    writeln!(
        out,
        "| path | tokens | pairs | TTFT (ms) | engine alone (ms) | paired difference (ms) | q1 (ms) | q3 (ms) | vs engine (%) | CPU beyond, to first token (ms) | CPU beyond, to idle (ms) | path's threads beyond, to first token (ms) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut raw = Vec::new();
    for (label, tokens, pairs) in rows {
        let median = |f: &dyn Fn(&Pair) -> f64| quantile(&sorted(pairs.iter().map(f)), 0.5);
        let diffs = sorted(pairs.iter().map(|p| ms(p.path.ttft) - ms(p.engine.took)));
        let engine = median(&|p| ms(p.engine.took));
        writeln!(
            out,
            "| disaggregated, {label} | {tokens} | {} | {:.1} | {engine:.1} | {:+.1} | {:+.1} | {:+.1} | {:+.1} | {:+.1} | {:+.1} | {:+.1} |",
            pairs.len(),
            median(&|p| ms(p.path.ttft)),
            quantile(&diffs, 0.5),
            quantile(&diffs, 0.25),
            quantile(&diffs, 0.75),
            100.0 * quantile(&diffs, 0.5) / engine,
            median(&|p| ms(p.path.cpu_first) - ms(p.engine.cpu)),
            median(&|p| ms(p.path.cpu_idle) - ms(p.engine.cpu)),
            median(&|p| ms(p.path.threads_first) - ms(p.engine.threads)),
        )?;
        let each = |p: &Pair| {
            let (path, engine) = (p.path, p.engine);
            let path = [path.ttft, path.cpu_first, path.cpu_idle, path.threads_first].map(ms);
            let engine = [engine.took, engine.cpu, engine.threads].map(ms);
            json!({"path_ttft_cpu_first_cpu_idle_threads_first_ms": path, "engine_took_cpu_threads_ms": engine})
        };
        raw.push(json!({"path": label, "tokens": tokens, "pairs": pairs.iter().map(each).collect::<Vec<_>>()}));
    }
    out.note("pairs", json!(raw));
    Ok(())
}

impl Path {
    async fn start(e: &SmolLm, transfer: TransferKind) -> anyhow::Result<Self> {
        let base = e.clone();
        let cfg = ClusterConfig {
            prefills: 1,
            prefill_tp: 1,
            prefill_cache_bytes: CACHE_BYTES,
            transfer,
            ..ClusterConfig::ephemeral()
        };
        let cluster =
            Cluster::start(cfg, &|| Ok(Arc::new(base.fork()?) as Arc<dyn Engine>)).await?;
        let client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
        let mut path = Path { cluster, client };
        path.run(prompt(32, 78)).await?; // warm-up: connections
        Ok(path)
    }

    /// One request of one token, timed to its first token and its prefill's idle; fails
    /// when any of its prompt was cached (not the engine alone's work).
    async fn run(&mut self, tokens: Vec<u32>) -> anyhow::Result<PathRun> {
        let threads = ThreadsCpu::read(ENGINE_THREADS)?;
        let cpu = process_cpu();
        let t = Instant::now();
        let mut s = self.client.generate(one_token(tokens)).await?.into_inner();
        anyhow::ensure!(s.message().await?.is_some(), "no first token");
        let ttft = t.elapsed();
        let cpu_first = process_cpu().saturating_sub(cpu);
        let threads_first = ThreadsCpu::read(ENGINE_THREADS)?.since(&threads);
        let mut cached = 0;
        while let Some(m) = s.message().await? {
            if let Some(Event::Complete(c)) = m.event {
                cached = c.usage.map_or(0, |u| u.cached_tokens);
            }
        }
        self.settle().await?;
        let cpu_idle = process_cpu().saturating_sub(cpu);
        anyhow::ensure!(cached == 0, "{cached} tokens cached: not equal work");
        Ok(PathRun { ttft, cpu_first, cpu_idle, threads_first })
    }

    /// Waits until the prefill runs nothing and stores nothing (`PrefillInstance::idle`).
    async fn settle(&self) -> anyhow::Result<()> {
        let start = Instant::now();
        while !self.cluster.prefills.iter().all(|p| p.idle()) {
            anyhow::ensure!(start.elapsed() < SETTLE_LIMIT, "the prefill did not settle");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }
}

/// The engine alone's prefill of `tokens`, timed by the wall, the process's CPU clock and
/// the threads but the engine's.
async fn engine_alone(e: &SmolLm, tokens: &[u32]) -> anyhow::Result<EngineRun> {
    let threads = ThreadsCpu::read(ENGINE_THREADS)?;
    let cpu = process_cpu();
    let t = Instant::now();
    e.prefill(tokens, None, &Sampling::default()).await?;
    let (took, cpu) = (t.elapsed(), process_cpu().saturating_sub(cpu));
    let threads = ThreadsCpu::read(ENGINE_THREADS)?.since(&threads);
    Ok(EngineRun { took, cpu, threads })
}

/// The `p` quantile of `sorted`, interpolated between the two nearest ranks (the median of
/// an even count is the mean of the middle two).
fn quantile(sorted: &[f64], p: f64) -> f64 {
    let h = (sorted.len() - 1) as f64 * p;
    let (lo, hi) = (sorted[h.floor() as usize], sorted[h.ceil() as usize]);
    lo + (hi - lo) * (h - h.floor())
}

fn sorted(v: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(f64::total_cmp);
    v
}
