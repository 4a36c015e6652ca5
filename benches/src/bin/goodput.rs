//! Goodput under overload: open-loop Poisson arrivals at multiples of the cluster's capacity
//! against an in-process cluster (mock engine calibrated to SmolLM2 on this machine), each
//! request with a deadline. Capacity is what the prefill instances can compute: instances /
//! (prompt tokens x prefill time per token); the mock engine's decode runs concurrently, so
//! prefill is the bottleneck, as with a real PD deployment under a burst.
//!
//! Per offered load it prints: goodput (requests answered in full within their deadline,
//! per second, counted over the arrival window after a warm-up) as a share of capacity;
//! refusals (429) and their latency p50/p99; latency of answered requests p50/p99; and any
//! other outcome (deadline misses of admitted requests, 5xx), which should be none.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin goodput
//! cargo run --release -p handoff-benches --bin goodput -- --loads 0.5,1,2,3 --seconds 30 --seed 7
//! ```

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{Engine, MockConfig, MockEngine};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;

#[derive(Debug, Clone)]
struct Args {
    instances: usize,
    prompt_tokens: usize,
    max_tokens: u32,
    prefill_us: u64,
    decode_us: u64,
    seconds: f64,
    warmup: f64,
    deadline_ms: u32,
    loads: Vec<f64>,
    seed: u64,
}

impl Args {
    fn parse() -> anyhow::Result<Self> {
        let mut a = Args {
            instances: 4,
            prompt_tokens: 128,
            max_tokens: 8,
            // Calibrated to SmolLM2 on this machine (see loadgen).
            prefill_us: 4200,
            decode_us: 9300,
            seconds: 20.0,
            warmup: 3.0,
            deadline_ms: 10_000,
            loads: vec![0.5, 1.0, 1.5, 2.0, 3.0],
            seed: 1,
        };
        handoff_benches::parse_flags(|flag, val| {
            match flag {
                "--instances" => a.instances = val.parse()?,
                "--prompt-tokens" => a.prompt_tokens = val.parse()?,
                "--max-tokens" => a.max_tokens = val.parse()?,
                "--prefill-us" => a.prefill_us = val.parse()?,
                "--decode-us" => a.decode_us = val.parse()?,
                "--seconds" => a.seconds = val.parse()?,
                "--warmup" => a.warmup = val.parse()?,
                "--deadline-ms" => a.deadline_ms = val.parse()?,
                "--seed" => a.seed = val.parse()?,
                "--loads" => a.loads = val.split(',').map(str::parse).collect::<Result<_, _>>()?,
                other => anyhow::bail!("unknown flag {other}"),
            }
            Ok(())
        })?;
        Ok(a)
    }

    /// Requests per second the prefill instances can compute.
    fn capacity(&self) -> f64 {
        self.instances as f64 / (self.prompt_tokens as f64 * self.prefill_us as f64 * 1e-6)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Answered,
    Refused,
    Other,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    outcome: Outcome,
    /// When it ended, since the run started.
    ended: Duration,
    latency: Duration,
}

async fn one(mut client: GenerateClient<Channel>, prompt: Vec<u32>, a: &Args) -> Outcome {
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: prompt })),
        sampling: Some(SamplingParams {
            max_tokens: a.max_tokens,
            ignore_eos: true,
            ..Default::default()
        }),
        deadline_ms: a.deadline_ms,
        ..Default::default()
    };
    let call = async {
        let mut s = client.generate(req).await?.into_inner();
        while s.message().await?.is_some() {}
        Ok::<_, tonic::Status>(())
    };
    match call.await {
        Ok(()) => Outcome::Answered,
        Err(e) if e.code() == tonic::Code::ResourceExhausted => Outcome::Refused,
        Err(e) => {
            eprintln!("  other outcome: {:?} {}", e.code(), e.message());
            Outcome::Other
        }
    }
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort_unstable();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

async fn run_load(a: &Args, load: f64) -> anyhow::Result<Vec<Sample>> {
    let engine: Arc<dyn Engine> = Arc::new(MockEngine::new(MockConfig {
        prefill_per_token: Duration::from_micros(a.prefill_us),
        decode_per_token: Duration::from_micros(a.decode_us),
        ..MockConfig::default()
    }));
    let cfg = ClusterConfig { prefills: a.instances, prefill_tp: 1, ..ClusterConfig::ephemeral() };
    let cluster = Cluster::start_shared(cfg, engine).await?;
    // Admission prices queues with the instances' measured cost: wait until it is heard.
    let since = Instant::now();
    while cluster.scheduler.state().instances().iter().any(|i| i.token_cost_us == 0.0) {
        anyhow::ensure!(since.elapsed() < Duration::from_secs(10), "no cost heard");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
    let rate = load * a.capacity();
    let mut rng = StdRng::seed_from_u64(a.seed ^ (load * 1000.0) as u64);
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    while start.elapsed().as_secs_f64() < a.seconds {
        let gap = -rng.random::<f64>().max(1e-9).ln() / rate;
        tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        // Distinct prompts: no prefix cache hits, every request costs the full prefill.
        let prompt: Vec<u32> = (0..a.prompt_tokens).map(|_| rng.random_range(2..30_000)).collect();
        let (client, args) = (client.clone(), a.clone());
        tasks.spawn(async move {
            let sent = Instant::now();
            let outcome = one(client, prompt, &args).await;
            Sample { outcome, ended: start.elapsed(), latency: sent.elapsed() }
        });
    }
    let mut out = Vec::new();
    while let Some(s) = tasks.join_next().await {
        out.push(s?);
    }
    cluster.shutdown().await;
    Ok(out)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse()?;
    let cap = a.capacity();
    let mut out = handoff_benches::record::Report::new("goodput");
    writeln!(
        out,
        "{} instances, {}-token prompts at {} us/token, {} tokens each at {} us/token, deadline {} ms, {} s per load (first {} s not counted), seed {}: capacity {cap:.2} req/s\n",
        a.instances,
        a.prompt_tokens,
        a.prefill_us,
        a.max_tokens,
        a.decode_us,
        a.deadline_ms,
        a.seconds,
        a.warmup,
        a.seed
    )?;
    writeln!(
        out,
        "| offered | offered req/s | goodput req/s | goodput / capacity | answered | refused | refusal p50 | refusal p99 | answered p50 | answered p99 | other |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    out.flush()?;
    for &load in &a.loads {
        let samples = run_load(&a, load).await?;
        let window = (a.warmup, a.seconds);
        let counted = samples.iter().filter(|s| {
            s.outcome == Outcome::Answered && (window.0..window.1).contains(&s.ended.as_secs_f64())
        });
        let goodput = counted.count() as f64 / (window.1 - window.0);
        let of = |o| samples.iter().filter(move |s| s.outcome == o);
        let mut refused: Vec<Duration> = of(Outcome::Refused).map(|s| s.latency).collect();
        let mut answered: Vec<Duration> = of(Outcome::Answered).map(|s| s.latency).collect();
        let other = of(Outcome::Other).count();
        writeln!(
            out,
            "| {load:.1}x | {:.2} | {goodput:.2} | {:.0} % | {} | {} | {:.2} ms | {:.2} ms | {:.0} ms | {:.0} ms | {other} |",
            load * cap,
            100.0 * goodput / cap,
            answered.len(),
            refused.len(),
            pct(&mut refused, 0.5).as_secs_f64() * 1e3,
            pct(&mut refused, 0.99).as_secs_f64() * 1e3,
            pct(&mut answered, 0.5).as_secs_f64() * 1e3,
            pct(&mut answered, 0.99).as_secs_f64() * 1e3,
        )?;
        out.flush()?;
    }
    out.finish()?;
    Ok(())
}
