//! Speeds of the smollm engine and of the real model on the disaggregated path.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin model -- [model.gguf]
//! ```
//!
//! Prints: model load time; prefill tok/s at 32 / 256 / 1024 tokens; decode tok/s with 1
//! and 4 concurrent streams; TTFT of a 256-token prompt aggregated (engine in-process) and
//! disaggregated (through `handoff up`'s path); TTFT with 90 % of the prompt cached vs none;
//! TTFT of the same prompts (256 and 1024 tokens) over the tcp (sockets, and its same-host
//! shared memory), mooncake and nixl transfers (nixl: run with
//! `eval "$(scripts/fetch-nixl --env)"`), each beside the engine alone on the same prompts
//! (its prefill, no decoder, no gRPC: the unflattering comparison). The two run in turn
//! prompt by prompt, which goes first alternating, and the table gives the median of the
//! paired differences with its quartiles, and the process's CPU beyond the engine alone's.
//! Each shape's pairs follow prompts that fill the prefill's prefix cache (the steady
//! state; see [`CACHE_BYTES`]).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{Engine, Kv, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use handoff_smollm::{SmolConfig, SmolLm};
use handoff_transfer::TransferKind;

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 200 + (i * 7919 + salt * 104_729) % 40_000).collect()
}

async fn prefill_time(e: &SmolLm, tokens: &[u32], prefix: Option<Kv>) -> anyhow::Result<Duration> {
    let t = Instant::now();
    e.prefill(tokens, prefix, &Sampling::default()).await?;
    Ok(t.elapsed())
}

async fn decode_rate(e: &SmolLm, streams: usize, steps: usize) -> anyhow::Result<f64> {
    let mut decoders = Vec::new();
    for s in 0..streams {
        let p = e.prefill(&prompt(32, s as u32), None, &Sampling::default()).await?;
        decoders.push(e.decoder(p.kv, p.first_token, &Sampling::default())?);
    }
    let t = Instant::now();
    let runs = decoders.iter_mut().map(|d| async move {
        for _ in 0..steps {
            d.step().await?;
        }
        Ok::<_, handoff_engine::EngineError>(())
    });
    for r in futures::future::join_all(runs).await {
        r?;
    }
    Ok((streams * steps) as f64 / t.elapsed().as_secs_f64())
}

async fn ttft_through(
    client: &mut GenerateClient<tonic::transport::Channel>,
    tokens: Vec<u32>,
) -> anyhow::Result<(Duration, u32)> {
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: tokens })),
        sampling: Some(SamplingParams { max_tokens: 1, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let t = Instant::now();
    let mut s = client.generate(req).await?.into_inner();
    let _first = s.message().await?;
    let ttft = t.elapsed();
    let mut cached = 0;
    while let Some(m) = s.message().await? {
        if let Some(handoff_proto::v1::generate_response::Event::Complete(c)) = m.event {
            cached = c.usage.map_or(0, |u| u.cached_tokens);
        }
    }
    Ok((ttft, cached))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let path = std::env::args().nth(1).map(std::path::PathBuf::from).unwrap_or_else(|| {
        std::path::PathBuf::from(std::env::var("HOME").unwrap_or_default())
            .join(".cache/handoff/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    });
    let mut out = handoff_benches::record::Report::new("model");
    let t = Instant::now();
    let e = SmolLm::load(&SmolConfig::new(&path))?;
    writeln!(out, "model load (incl. Q4_1 -> Q8_0 requantization): {:.0} ms", ms(t.elapsed()))?;
    e.prefill(&prompt(16, 9), None, &Sampling::default()).await?; // warm-up

    writeln!(out, "\n| prefill tokens | time (ms) | tok/s |\n|---:|---:|---:|")?;
    for n in [32, 256, 1024] {
        let d = prefill_time(&e, &prompt(n, 1), None).await?;
        writeln!(out, "| {n} | {:.0} | {:.0} |", ms(d), n as f64 / d.as_secs_f64())?;
    }

    writeln!(out, "\n| decode streams | tok/s (all streams) |\n|---:|---:|")?;
    for streams in [1, 4] {
        writeln!(out, "| {streams} | {:.1} |", decode_rate(&e, streams, 48).await?)?;
    }

    // 90 % cached vs none, in-process (the engine's own cost).
    let p = prompt(256, 3);
    let full = e.prefill(&p, None, &Sampling::default()).await?;
    let cached = full.kv.slice_tokens(0..224);
    let none = prefill_time(&e, &p, None).await?;
    let hit = prefill_time(&e, &p, Some(cached)).await?;
    writeln!(
        out,
        "\nengine prefill of 256 tokens: none cached {:.0} ms, 224 cached (88 %) {:.0} ms",
        ms(none),
        ms(hit)
    )?;

    // The path: 2 prefill instances (tp 1), decode tp 1, tcp transfer.
    let base = e.clone();
    let cluster =
        Cluster::start(ClusterConfig { prefill_tp: 1, ..ClusterConfig::ephemeral() }, &|| {
            Ok(Arc::new(base.fork()?) as Arc<dyn Engine>)
        })
        .await?;
    let mut client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
    ttft_through(&mut client, prompt(32, 77)).await?; // warm-up: connections
    let agg = {
        let t = Instant::now();
        e.prefill(&prompt(256, 11), None, &Sampling::default()).await?;
        t.elapsed()
    };
    let (disagg, _) = ttft_through(&mut client, prompt(256, 12)).await?;
    writeln!(
        out,
        "TTFT 256-token prompt: aggregated {:.0} ms, disaggregated {:.0} ms (+{:.1} ms)",
        ms(agg),
        ms(disagg),
        ms(disagg.saturating_sub(agg))
    )?;
    // 90 % cached through the path: a 256-token prompt sharing its first 14 pages (224 tokens).
    let mut first = prompt(256, 20);
    let (cold, c0) = ttft_through(&mut client, first.clone()).await?;
    first.truncate(232);
    first.extend(prompt(24, 21));
    tokio::time::sleep(Duration::from_millis(50)).await;
    let (warm, c1) = ttft_through(&mut client, first).await?;
    writeln!(
        out,
        "TTFT 256-token prompt through the path: {c0} cached {:.0} ms, {c1} cached {:.0} ms",
        ms(cold),
        ms(warm)
    )?;
    cluster.shutdown().await;

    // The same prompts through each transfer backend, against the engine alone, one run:
    // 256-token prompts (11 pairs) and 1024-token ones (5 pairs).
    // Salts distinct across shapes: no prompt shares a prefix with another (nothing cached).
    let shapes: [(usize, u32, u32); 2] = [(256, 11, 40), (1024, 5, 60)];
    out.note("pairs", serde_json::json!(shapes.map(|(n, reps, salt)| [n as u32, reps, salt])));
    let prompts: Vec<Vec<Vec<u32>>> = shapes
        .iter()
        .map(|&(n, reps, salt)| (0..reps).map(|i| prompt(n, salt + i)).collect())
        .collect();
    // Each backend's row beside the engine alone on the same prompts, one after the other
    // prompt by prompt, which goes first alternating: the machine's stretches move both alike.
    // Each shape's pairs follow prompts that fill the prefill's prefix cache and evict from
    // it: the steady state of a prefill that keeps what it computed (the engine alone keeps
    // nothing). Before, the cache grew through the pairs, each prompt's KV on pages the
    // process had never touched, faulted in while the compute ran (about 15 ms of CPU a
    // 256-token prompt on this VM, in a profile).
    let token_bytes = e.info().shape.token_bytes();
    let mut fill_salt = 500;
    out.note("prefill_cache_bytes", serde_json::json!(CACHE_BYTES));
    let mut rows = Vec::new();
    let loopback = std::net::Ipv4Addr::LOCALHOST.into();
    for (label, transfer) in [
        (
            "tcp",
            TransferKind::Tcp {
                bind_ip: loopback,
                advertise_ip: None,
                tls: None,
                shared_memory: false,
            },
        ),
        (
            "shm (tcp's same-host path)",
            TransferKind::Tcp {
                bind_ip: loopback,
                advertise_ip: None,
                tls: None,
                shared_memory: true,
            },
        ),
        ("mooncake", TransferKind::Mooncake { bind_ip: loopback, advertise_ip: None }),
        ("nixl", TransferKind::Nixl { bind_ip: loopback, advertise_ip: None }),
    ] {
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
        let mut client =
            GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
        ttft_through(&mut client, prompt(32, 78)).await?; // warm-up: connections
        for (ps, &(n, ..)) in prompts.iter().zip(&shapes) {
            for _ in 0..cache_fill(n, token_bytes) {
                fill_salt += 1;
                ttft_through(&mut client, prompt(n, fill_salt)).await?;
            }
            let mut pairs = Vec::new();
            for (i, p) in ps.iter().enumerate() {
                let engine_first = i % 2 == 0;
                let mut engine = None;
                if engine_first {
                    engine = Some(engine_alone(&e, p).await?);
                }
                let (path, cached) = timed(ttft_through(&mut client, p.clone())).await?;
                anyhow::ensure!(cached == 0, "{cached} tokens cached: not equal work");
                let engine = match engine {
                    Some(engine) => engine,
                    None => engine_alone(&e, p).await?,
                };
                pairs.push(Pair { path, engine });
            }
            rows.push((label, n, pairs));
        }
        cluster.shutdown().await;
    }
    writeln!(
        out,
        "\nTTFT by transfer backend beside the engine alone (its prefill, no decoder, no gRPC) on the same prompts, in turn prompt by prompt, which goes first alternating, after prompts that fill the prefill's {} MiB prefix cache ({} of 256 tokens, {} of 1024); medians, the paired difference's median and quartiles, and the process's CPU beyond the engine alone's (the path, the transfer and the decode, competing with the compute for the cores):",
        CACHE_BYTES >> 20,
        cache_fill(256, token_bytes),
        cache_fill(1024, token_bytes)
    )?;
    writeln!(
        out,
        "| path | tokens | pairs | TTFT (ms) | engine alone (ms) | paired difference (ms) | quartiles (ms) | vs engine | CPU beyond the engine's (ms) |"
    )?;
    writeln!(out, "|---|---:|---:|---:|---:|---:|---|---:|---:|")?;
    for (label, n, pairs) in rows {
        let ttft = median_ms(pairs.iter().map(|p| ms(p.path.wall)));
        let engine = median_ms(pairs.iter().map(|p| ms(p.engine.wall)));
        let diffs = sorted(pairs.iter().map(|p| ms(p.path.wall) - ms(p.engine.wall)));
        let cpu = median_ms(pairs.iter().map(|p| ms(p.path.cpu) - ms(p.engine.cpu)));
        let q = |f: f64| diffs[((diffs.len() - 1) as f64 * f).round() as usize];
        writeln!(
            out,
            "| disaggregated, {label} | {n} | {} | {ttft:.1} | {engine:.1} | {:+.1} | {:+.1} .. {:+.1} | {:+.1} % | {cpu:+.1} |",
            pairs.len(),
            q(0.5),
            q(0.25),
            q(0.75),
            100.0 * q(0.5) / engine,
        )?;
    }
    out.finish()?;
    Ok(())
}

/// The prefill's prefix cache budget on the backends' clusters: 5 prompts of 256 tokens or
/// one of 1024 (SmolLM2's 46 KiB a token), so a few prompts fill it.
const CACHE_BYTES: usize = 64 << 20;

/// Distinct prompts of `tokens` tokens that fill a [`CACHE_BYTES`] prefix cache and evict
/// from it.
fn cache_fill(tokens: usize, token_bytes: usize) -> usize {
    CACHE_BYTES / (tokens * token_bytes) + 2
}

/// One run's wall time and the process's CPU time over it (every thread: the engine's
/// compute and, for the path, the frontend, scheduler, prefill and transfer beside it).
#[derive(Debug, Clone, Copy)]
struct Timed {
    wall: Duration,
    cpu: Duration,
}

/// The path and the engine alone on one prompt.
#[derive(Debug)]
struct Pair {
    path: Timed,
    engine: Timed,
}

/// The engine alone's prefill of `tokens`, timed.
async fn engine_alone(e: &SmolLm, tokens: &[u32]) -> anyhow::Result<Timed> {
    Ok(timed(async { Ok((prefill_time(e, tokens, None).await?, ())) }).await?.0)
}

/// Runs `f`, timing it by the wall clock and the process's CPU clock. The wall time is
/// the one `f` returns (the TTFT, not the rest of the stream).
async fn timed<T>(
    f: impl std::future::Future<Output = anyhow::Result<(Duration, T)>>,
) -> anyhow::Result<(Timed, T)> {
    let cpu = process_cpu_clock();
    let (wall, rest) = f.await?;
    Ok((Timed { wall, cpu: process_cpu_clock().saturating_sub(cpu) }, rest))
}

/// The process's CPU time, all threads, to the nanosecond (`/proc`'s is in 10 ms ticks).
fn process_cpu_clock() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
}

fn sorted(v: impl Iterator<Item = f64>) -> Vec<f64> {
    let mut v: Vec<f64> = v.collect();
    v.sort_by(f64::total_cmp);
    v
}

fn median_ms(v: impl Iterator<Item = f64>) -> f64 {
    let v = sorted(v);
    v[v.len() / 2]
}
