//! Orchestration overhead of the whole disaggregated path: TTFT through the frontend
//! (scheduler, room, directory, handshakes, prefill gRPC, KV transfer over tcp, verify,
//! reassembly) minus the TTFT of the same mock engine called in-process, with mock compute
//! set to zero. Prints p50 and p99 as a Markdown table:
//!
//! - first, distinct prompts at 64 in flight until every prefill's prefix cache is nine
//!   tenths full, in a row of its own and counted in no other. Until then the process grows
//!   (the caches keep buffers the allocator cannot hand out again), and more than half of
//!   the decode's receive regions landed on fresh pages that registering faulted in
//!   (registering a 256 KiB region took about 80 us on fresh pages and 7 us on reused ones,
//!   on the machine this was found on); once the caches are full and evicting, a region is
//!   almost never fresh. The levels below measure that steady state, as a server that has been up
//!   a while runs;
//! - closed loop with 1 request in flight (latency alone) and with 64 (saturation: its
//!   latency is mostly queueing, and labelled so), with the process's CPU per request (every
//!   role runs in this process, and so does the load generator), whole, beyond the mock
//!   engine's own (measured on the in-process runs), the load generator's (its gRPC client
//!   and connection, on a thread of its own: a client's cost, not the path's), and the
//!   path's: what is left. The process's CPU and the load generator's thread are read to
//!   the nanosecond;
//! - open loop, requests started on a fixed schedule whatever the answers do, at half the
//!   saturation rate just measured (or at a rate given, so that builds compared run at the
//!   same one: each run's saturation differs by more than builds do) and at 2,500 req/s
//!   (half of issue 14's 5,000 target).
//!   Latency counts from each request's scheduled start, so a stalled path is not hidden by
//!   a generator that waits for it. A pacing thread starts each request on the OS's timers
//!   (tokio's tick in whole milliseconds: sleeping on them started requests 0.85 ms late at
//!   the median, all of it counted as the path's latency); how late the starts still were
//!   is printed in the row's label;
//! - where one request at a time spends its time: the frontend's stages (from its
//!   `/metrics`) within the mean TTFT, and the rest.
//!
//! All of it for each placement of the scheduler asked for: its own server called over gRPC
//! on loopback (as `handoff scheduler` runs), and in the frontend's process (`handoff up
//! --scheduler-in-frontend`). `both` (the default) runs them in the order A B B A, each on
//! a fresh cluster, then prints them side by side with the ratios of their medians.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin overhead -- [prompt_tokens] [requests_per_level] [grpc|in-frontend|both] [half_rate]
//! ```

use std::io::Write;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_benches::pacer::Pacer;
use handoff_benches::path::{OwnThread, Run, closed_loop, pct, process_cpu, prompt, ttft, us};
use handoff_benches::stages::Stages;
use handoff_engine::{Engine, MockConfig, MockEngine, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use tonic::transport::Channel;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let prompt_tokens: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let per_level: usize = args.next().map_or(Ok(2000), |a| a.parse())?;
    let placement = args.next().unwrap_or_else(|| "both".to_owned());
    let half_rate: Option<f64> = args.next().map(|a| a.parse()).transpose()?;
    anyhow::ensure!(half_rate.is_none_or(|r| r > 0.0), "a half-load rate above 0");
    // Every level's prompts distinct from every other's, the warm-ups' and the fill's: the
    // four levels take seeds 0..4 * per_level, below WARM_SEEDS.
    anyhow::ensure!(
        4 * per_level <= WARM_SEEDS.start as usize,
        "at most {} requests per level: prompts would repeat",
        WARM_SEEDS.start / 4
    );
    anyhow::ensure!(per_level > 0, "at least one request per level");
    let engine = Arc::new(MockEngine::new(MockConfig::default()));

    // The in-process reference: prefill and first token with no orchestration at all.
    // Warm first (first touches, the allocator's pools), as the path is before it is timed.
    for i in 0..per_level / 10 {
        engine
            .prefill(&prompt(2_000_000 + i as u32, prompt_tokens), None, &Sampling::default())
            .await?;
    }
    let mut base = Vec::new();
    let cpu = process_cpu();
    for i in 0..per_level {
        let p = prompt(i as u32, prompt_tokens);
        let start = Instant::now();
        let out = engine.prefill(&p, None, &Sampling::default()).await?;
        std::hint::black_box(out.first_token);
        base.push(start.elapsed());
    }
    // The engine's own CPU per request (the mock still makes its KV bytes): part of the
    // path's CPU per request below, shown apart so the orchestration's share is plain.
    let engine_cpu_us = us(process_cpu() - cpu) / per_level as f64;
    base.sort();
    let base_p50 = pct(&base, 0.5);

    let mut out = handoff_benches::record::Report::new("overhead");
    writeln!(
        out,
        "prompt {prompt_tokens} tokens, {per_level} requests per level, 2 prefill instances (tp 2), decode tp 1, tcp transfer (same host: its shared memory), mock compute 0"
    )?;
    writeln!(
        out,
        "in-process mock TTFT: p50 {:.1} us, p99 {:.1} us; its CPU per request {engine_cpu_us:.0} us",
        us(base_p50),
        us(pct(&base, 0.99))
    )?;
    let fixed = Fixed { prompt_tokens, per_level, base_p50, engine_cpu_us, half_rate };
    // Both placements of the scheduler, in the order A B B A (the process warms as it
    // goes: neither gets only the later turns), each on a cluster of its own.
    let order = match placement.as_str() {
        "both" => {
            vec![Placement::Grpc, Placement::InFrontend, Placement::InFrontend, Placement::Grpc]
        }
        "grpc" => vec![Placement::Grpc],
        "in-frontend" => vec![Placement::InFrontend],
        other => anyhow::bail!("scheduler placement {other:?}: grpc, in-frontend or both"),
    };
    out.note("placements", serde_json::json!(order.iter().map(|p| p.label()).collect::<Vec<_>>()));
    let mut measured = Vec::new();
    for p in order {
        writeln!(out, "\n### {}\n", p.label())?;
        measured.push((p, measure(&engine, p, &fixed, &mut out).await?));
    }
    if measured.len() > 1 {
        compare(&measured, half_rate, &mut out)?;
    }
    out.finish()?;
    Ok(())
}

/// Where the frontend's scheduler replica runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Its own server, called over gRPC on loopback (as `handoff scheduler` runs).
    Grpc,
    /// In the frontend's process, called through its service with no socket.
    InFrontend,
}

impl Placement {
    fn label(self) -> &'static str {
        match self {
            Placement::Grpc => "scheduler over gRPC (loopback)",
            Placement::InFrontend => "scheduler in the frontend's process",
        }
    }
}

/// What every placement's run shares.
struct Fixed {
    prompt_tokens: usize,
    per_level: usize,
    /// The in-process mock's TTFT p50.
    base_p50: Duration,
    /// The mock's own CPU per request.
    engine_cpu_us: f64,
    /// The half-load rate given, instead of half of each run's saturation.
    half_rate: Option<f64>,
}

/// One placement's figures for the comparison.
struct Measured {
    /// Requests per second at 64 in flight.
    saturation: f64,
    /// The path's CPU per request at saturation (beyond the engine's and the load
    /// generator's), us.
    path_cpu: f64,
    /// TTFT p50 at one in flight, us.
    alone_p50: f64,
    /// Overhead p50 and p99 in the open loop at half of saturation, us.
    half: (f64, f64),
}

/// Runs every level on a fresh cluster whose scheduler is placed as `placement`.
async fn measure(
    engine: &Arc<MockEngine>,
    placement: Placement,
    fixed: &Fixed,
    out: &mut handoff_benches::record::Report,
) -> anyhow::Result<Measured> {
    let Fixed { prompt_tokens, per_level, base_p50, engine_cpu_us, half_rate } = *fixed;
    let cfg = ClusterConfig {
        scheduler_in_frontend: placement == Placement::InFrontend,
        ..ClusterConfig::ephemeral()
    };
    let cache_budget = cfg.prefill_cache_bytes;
    let cluster = Cluster::start_shared(cfg, engine.clone()).await?;
    // The load generator runs on a thread of its own: its CPU (its gRPC client and the
    // connection that drives) is the client's, shown apart from the path's.
    let loadgen = OwnThread::start()?;
    let url = format!("http://{}", cluster.frontend_addr);
    let client = loadgen.run(GenerateClient::connect(url)).await??;
    writeln!(
        out,
        "| load | TTFT p50 (us) | TTFT p99 (us) | overhead p50 (us) | overhead p99 (us) | req/s | CPU per request (us) | beyond the engine's (us) | the load generator's (us) | the path's: beyond the engine's and the load generator's (us) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let block_bytes = engine.info().page_size * engine.info().shape.token_bytes();
    let (fill, full) = fill_caches(&cluster, &loadgen, &client, prompt_tokens, |blocks| {
        blocks * block_bytes >= cache_budget / 10 * 9
    })
    .await?;
    let label = format!(
        "closed loop, 64 in flight, filling the prefix caches ({} requests{}; the process grows to its steady size, faulting fresh pages in; not counted below)",
        fill.t.len(),
        if full { "" } else { ", stopped short of full: prompts ran out" }
    );
    if !fill.t.is_empty() {
        let cpu = cpu_per_request(&fill, engine_cpu_us);
        let rate = fill.rate();
        row(out, &label, fill.t, base_p50, rate, Some(cpu))?;
    }
    let (mut saturation, mut alone, mut path_cpu, mut alone_p50) = (0f64, None, 0f64, 0f64);
    for (level, conc) in [1usize, 64].into_iter().enumerate() {
        // Warm-up: connections.
        let warm = WARM_SEEDS.start..WARM_SEEDS.start + 4 * conc as u32;
        closed_loop(&loadgen, &client, conc, warm, prompt_tokens).await?;
        let stages = Stages::read(cluster.http_addr).await?;
        // Distinct prompts: no prefix reuse, every request computes its whole prompt.
        let first = (level * per_level) as u32;
        let seeds = first..first + per_level as u32;
        let run = closed_loop(&loadgen, &client, conc, seeds, prompt_tokens).await?;
        let (cpu, rate) = (cpu_per_request(&run, engine_cpu_us), run.rate());
        let t = run.t;
        if conc == 1 {
            let mean = us(t.iter().sum::<Duration>()) / t.len() as f64;
            let means = Stages::read(cluster.http_addr).await?.mean_us_since(&stages);
            alone = Some(where_it_goes(mean, &means));
        }
        saturation = rate;
        let label = match conc {
            1 => "closed loop, 1 in flight".to_owned(),
            n => format!("closed loop, {n} in flight (saturated: latency is mostly queueing)"),
        };
        path_cpu = cpu.whole - cpu.engine - cpu.client;
        if conc == 1 {
            alone_p50 = us(pct_of(&t, 0.5));
        }
        row(out, &label, t, base_p50, rate, Some(cpu))?;
    }
    let (half, which) = match half_rate {
        Some(r) => (r, "as given"),
        None => (saturation / 2.0, "half of saturation"),
    };
    let mut half_overhead = (0f64, 0f64);
    for (k, (label, rate)) in [
        (format!("open loop at {half:.0} req/s ({which})"), half),
        ("open loop at 2,500 req/s (half of the 5,000 target)".to_owned(), 2500.0),
    ]
    .into_iter()
    .enumerate()
    {
        // Seeds of its own (the third and fourth blocks of `per_level`): a prompt seen before
        // would be served from the prefix cache (less work than the base measured).
        let first_seed = ((2 + k) * per_level) as u32;
        let c = client.clone();
        let run = open_loop(c, rate, per_level, prompt_tokens, first_seed);
        let mut answered = loadgen.run(run).await??;
        answered.late.sort();
        let late = format!(
            "{label}; started late p50 {:.0} us, p99 {:.0} us",
            us(pct(&answered.late, 0.5)),
            us(pct(&answered.late, 0.99))
        );
        if k == 0 {
            let o = |q| us(pct_of(&answered.ttft, q).saturating_sub(base_p50));
            half_overhead = (o(0.5), o(0.99));
        }
        row(out, &late, answered.ttft, base_p50, answered.rate, None)?;
    }
    if let Some(alone) = alone {
        writeln!(out, "\n{alone}")?;
    }
    cluster.shutdown().await;
    Ok(Measured { saturation, path_cpu, alone_p50, half: half_overhead })
}

/// `run`'s CPU per request, with the mock engine's own (`engine_us`) named.
fn cpu_per_request(run: &Run, engine_us: f64) -> Cpu {
    let per = |d: Duration| us(d) / run.t.len() as f64;
    Cpu { whole: per(run.cpu), engine: engine_us, client: per(run.client_cpu) }
}

/// Seeds of the levels' warm-ups; the levels' own are blocks of `per_level` below it (see
/// `main`), and every range is distinct modulo `prompt`'s 31,000.
const WARM_SEEDS: Range<u32> = 8_000..8_256;

/// Seeds of the prompts that fill the prefix caches.
const FILL_SEEDS: Range<u32> = WARM_SEEDS.end..31_000;

/// Requests sent before the levels, in rounds of this many.
const FILL_ROUND: u32 = 256;

/// Sends distinct prompts, 64 in flight, until every prefill's prefix cache holds blocks
/// enough that `full` says so (or [`FILL_SEEDS`] run out; then `false`). Until then the
/// process grows: the caches keep buffers the allocator cannot hand out again, so regions
/// and KV land on fresh pages the kernel faults in (populated, zeroed) one request after
/// another. A server that has been up a while reuses its memory instead; the levels after
/// this measure that.
async fn fill_caches(
    cluster: &Cluster,
    loadgen: &OwnThread,
    client: &GenerateClient<Channel>,
    tokens: usize,
    full: impl Fn(usize) -> bool,
) -> anyhow::Result<(Run, bool)> {
    let is_full =
        || cluster.prefills.iter().all(|p| p.snapshot().dp_blocks.iter().all(|b| full(b.len())));
    let mut run = Run::default();
    let mut at = FILL_SEEDS.start;
    while at < FILL_SEEDS.end && !is_full() {
        let seeds = at..(at + FILL_ROUND).min(FILL_SEEDS.end);
        at = seeds.end;
        run.extend(closed_loop(loadgen, client, 64, seeds, tokens).await?);
    }
    Ok((run, is_full()))
}

/// `q`'s percentile of `t`, unsorted.
fn pct_of(t: &[Duration], q: f64) -> Duration {
    let mut t = t.to_vec();
    t.sort();
    pct(&t, q)
}

/// Each placement's figures side by side, and the in-frontend ones over the gRPC ones
/// (medians of each placement's runs).
fn compare(
    measured: &[(Placement, Measured)],
    half_rate: Option<f64>,
    out: &mut handoff_benches::record::Report,
) -> anyhow::Result<()> {
    writeln!(out, "\n### the placements side by side (runs in order)\n")?;
    writeln!(
        out,
        "| scheduler | saturation (req/s) | the path's CPU per request (us) | 1 in flight TTFT p50 (us) | half of saturation overhead p50 (us) | p99 (us) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|")?;
    for (p, m) in measured {
        writeln!(
            out,
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            p.label(),
            m.saturation,
            m.path_cpu,
            m.alone_p50,
            m.half.0,
            m.half.1
        )?;
    }
    let median = |p: Placement, f: &dyn Fn(&Measured) -> f64| {
        let mut v: Vec<f64> = measured.iter().filter(|(q, _)| *q == p).map(|(_, m)| f(m)).collect();
        v.sort_by(f64::total_cmp);
        // Of an even count, the mean of the middle two.
        let n = v.len();
        (v[(n - 1) / 2] + v[n / 2]) / 2.0
    };
    let ratio = |f: &dyn Fn(&Measured) -> f64| {
        median(Placement::InFrontend, f) / median(Placement::Grpc, f)
    };
    writeln!(
        out,
        "\nin the frontend's process over gRPC (medians): saturation {:.2}x, the path's CPU per request {:.2}x, 1 in flight TTFT p50 {:.2}x, half-load overhead p50 {:.2}x ({})",
        ratio(&|m| m.saturation),
        ratio(&|m| m.path_cpu),
        ratio(&|m| m.alone_p50),
        ratio(&|m| m.half.0),
        match half_rate {
            Some(r) => format!("both at {r:.0} req/s, as given"),
            None => "each at half of its own saturation".to_owned(),
        },
    )?;
    Ok(())
}

/// Where one request at a time spends its time: the client's mean TTFT, the frontend's
/// stages' means within it, and the rest.
fn where_it_goes(ttft_us: f64, stages: &[(String, f64)]) -> String {
    let within: f64 = stages.iter().map(|(_, us)| us).sum();
    let listed: Vec<String> = stages.iter().map(|(s, us)| format!("{s} {us:.0}")).collect();
    format!(
        "1 in flight, mean us per request: TTFT {ttft_us:.0} = the frontend's stages ({}; the mock's compute is in transfer) {within:.0} + the rest {:.0} (the client's call and stream, the frontend's handling around its stages, the first token)",
        listed.join(", "),
        ttft_us - within
    )
}

/// CPU per request (µs): the whole process's, and the parts of it that are not the path's.
struct Cpu {
    whole: f64,
    /// The mock engine's own (measured in-process).
    engine: f64,
    /// The load generator's thread (its gRPC client and connection).
    client: f64,
}

/// One table row: TTFT and overhead (TTFT less the in-process `base`) percentiles of `t`,
/// and the CPU per request, whole and without the engine's and the load generator's.
fn row(
    out: &mut handoff_benches::record::Report,
    label: &str,
    mut t: Vec<Duration>,
    base: Duration,
    rate: f64,
    cpu: Option<Cpu>,
) -> anyhow::Result<()> {
    t.sort();
    let (p50, p99) = (pct(&t, 0.5), pct(&t, 0.99));
    let cpu = cpu.map_or("- | - | - | -".to_owned(), |c| {
        let beyond = c.whole - c.engine;
        format!("{:.0} | {beyond:.0} | {:.0} | {:.0}", c.whole, c.client, beyond - c.client)
    });
    writeln!(
        out,
        "| {label} | {:.0} | {:.0} | {:.0} | {:.0} | {rate:.0} | {cpu} |",
        us(p50),
        us(p99),
        us(p50.saturating_sub(base)),
        us(p99.saturating_sub(base)),
    )?;
    Ok(())
}

/// What an open-loop run measured.
struct OpenLoop {
    /// Each request's time from its scheduled start to its first token.
    ttft: Vec<Duration>,
    /// Each request's start past its schedule (the generator's own lateness, counted in
    /// `ttft` too).
    late: Vec<Duration>,
    /// Answers over the time to the last.
    rate: f64,
}

/// `n` requests started every `1 / rate` seconds whatever the earlier ones do, on a
/// [`Pacer`]'s schedule (the OS's timers: tokio's tick in whole milliseconds, and sleeping
/// on them started requests up to a millisecond late, counted as the system's latency).
async fn open_loop(
    client: GenerateClient<tonic::transport::Channel>,
    rate: f64,
    n: usize,
    prompt_tokens: usize,
    first_seed: u32,
) -> anyhow::Result<OpenLoop> {
    let mut prompts: Vec<Vec<u32>> =
        (0..n).map(|i| prompt(first_seed + i as u32, prompt_tokens)).collect();
    let mut pacer = Pacer::start(n, Duration::from_secs_f64(1.0 / rate))?;
    let mut runs = tokio::task::JoinSet::new();
    while let Some((i, due)) = pacer.next().await {
        let (mut client, prompt) = (client.clone(), std::mem::take(&mut prompts[i]));
        runs.spawn(async move {
            // Late starts count: the time from the scheduled start to the first token.
            let late = due.elapsed();
            anyhow::Ok((late, late + ttft(&mut client, prompt).await?))
        });
    }
    anyhow::ensure!(runs.len() == n, "the pacer stopped after {} of {n} starts", runs.len());
    let (mut late, mut ttfts) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for answer in runs.join_all().await {
        let (started_late, took) = answer?;
        late.push(started_late);
        ttfts.push(took);
    }
    Ok(OpenLoop { ttft: ttfts, late, rate: n as f64 / pacer.origin.elapsed().as_secs_f64() })
}
