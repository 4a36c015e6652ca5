//! Load generator: a multi-turn chat workload against a live cluster, once per policy.
//!
//! Users share a few system prompts; each user's next turn is the whole conversation so far
//! (system prompt, earlier questions and the answers the model actually gave) plus a new
//! question, so later turns share long prefixes with earlier ones. Requests arrive open-loop
//! (Poisson, `--rate` per second): an arrival takes the next turn of a user who is not
//! waiting for an answer. Each policy runs on a fresh cluster of `--instances` prefill
//! instances (mock engine, cold caches) with the same workload and seed.
//!
//! Every policy runs `--seeds` times (3 by default), each on a workload of its own seed.
//! Prints, per policy, prefix cache hit rate, TTFT p50/p95/p99, inter-token latency,
//! throughput and errors as a Markdown table (means over the seeds, with the least and
//! greatest hit rate and TTFT p50 beside), and writes an SVG plot with the spread and the
//! hit rate's ceiling drawn. The hit rate's
//! *ceiling* is what one infinite cache would have hit: per request, the full pages of its
//! prompt that the prompts prefilled before it (first token back earlier) began with. A
//! prefill caches prompts, not answers, so a policy can pass it only by the odd race.
//!
//! With `--frontend host:port` it drives a cluster already running (say `handoff up`, with
//! the real model) instead: the policies run one after another on the same instances, each
//! with its own system prompts (another seed) so one policy's cache does not serve the next.
//!
//! `--shape eviction` is the unflattering shape: 12 system prompts on 8 instances, the mock's
//! KV sized like SmolLM2's (`--kv smollm2`) and 48 MB caches (`--cache-mb`), about one system
//! prompt each, so every policy evicts.
//!
//! `--tune 0.25,0.5,1,2,4` chooses kv_aware's load weight among those on the chat shape, on
//! seeds of its own, then reports every policy with it on the chat shape and on the eviction
//! shape, which the choice never saw (`tune`).
//!
//! ```text
//! cargo run --release -p handoff-benches --bin loadgen -- --svg loadgen.svg
//! cargo run --release -p handoff-benches --bin loadgen -- --shape eviction --seconds 30
//! cargo run --release -p handoff-benches --bin loadgen -- --tune 0.25,0.5,1,2,4 --seconds 30
//! cargo run --release -p handoff-benches --bin loadgen -- --frontend 127.0.0.1:50051 --rate 0.5
//! ```

mod plot;
mod table;
mod tune;

use table::{Summary, name, row_of};

use std::collections::HashSet;
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_core::{BlockHash, block_hashes};
use handoff_engine::{Engine, KvShape, MockConfig, MockEngine};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{GenerateRequest, Policy, SamplingParams, TokenIds};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tonic::transport::Channel;

#[derive(Debug, Clone)]
struct Args {
    instances: usize,
    users: usize,
    turns: usize,
    systems: usize,
    system_tokens: usize,
    question_tokens: usize,
    answer_tokens: u32,
    rate: f64,
    seconds: f64,
    prefill_us: u64,
    decode_us: u64,
    svg: Option<String>,
    policies: Vec<Policy>,
    /// Runs per policy, each on its own seed.
    seeds: u64,
    /// The mock's KV per token: its own small shape, or SmolLM2-135M's (46 KB per token).
    kv: KvShape,
    /// Each instance's prefix cache, bytes.
    cache_bytes: usize,
    load_weight: f64,
    frontend: Option<String>,
    page_size: usize,
    /// The workload's shape.
    shape: Shape,
    /// kv_aware load weights to choose from on the chat shape before reporting on both.
    tune: Option<Vec<f64>>,
}

/// A workload shape: the chat shape of the flags given, or the eviction one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Shape {
    Chat,
    /// More system prompts than instances, SmolLM2-sized KV, and caches that hold about one
    /// system prompt each: every policy must evict.
    Eviction,
}

impl Shape {
    /// `a` in this shape.
    fn apply(self, a: &Args) -> Args {
        let mut a = a.clone();
        if self == Shape::Eviction {
            (a.instances, a.systems, a.kv) = (8, 12, SMOLLM2);
            a.cache_bytes = 48 << 20;
        }
        a
    }
}

impl Args {
    fn parse() -> anyhow::Result<Self> {
        let mut a = Args {
            // Long shared system prompts, short turns: the shape SGLang's cache-aware
            // routing numbers come from. `--users 48 --turns 6 --systems 4 --system-tokens
            // 384 --question-tokens 48 --answer-tokens 24 --seconds 40` is a short-prompt one.
            instances: 8,
            users: 64,
            turns: 8,
            systems: 8,
            system_tokens: 1024,
            question_tokens: 32,
            answer_tokens: 16,
            rate: 4.0,
            seconds: 60.0,
            // Calibrated to SmolLM2 on this machine (the `model` bench: prefill ~240 tok/s,
            // decode ~107 tok/s for one stream).
            prefill_us: 4200,
            decode_us: 9300,
            svg: None,
            load_weight: handoff_scheduler::policy::KvAwareWeights::default().load,
            frontend: None,
            page_size: 16,
            shape: Shape::Chat,
            tune: None,
            seeds: 3,
            kv: MockConfig::default().shape,
            cache_bytes: ClusterConfig::default().prefill_cache_bytes,
            policies: vec![
                Policy::KvAware,
                Policy::RoundRobin,
                Policy::Random,
                Policy::PowerOfTwo,
                Policy::PrefixHash,
            ],
        };
        handoff_benches::parse_flags(|flag, val| {
            match flag {
                "--instances" => a.instances = val.parse()?,
                "--users" => a.users = val.parse()?,
                "--turns" => a.turns = val.parse()?,
                "--systems" => a.systems = val.parse()?,
                "--system-tokens" => a.system_tokens = val.parse()?,
                "--question-tokens" => a.question_tokens = val.parse()?,
                "--answer-tokens" => a.answer_tokens = val.parse()?,
                "--rate" => a.rate = val.parse()?,
                "--seconds" => a.seconds = val.parse()?,
                "--prefill-us" => a.prefill_us = val.parse()?,
                "--decode-us" => a.decode_us = val.parse()?,
                "--svg" => a.svg = Some(val.to_owned()),
                "--load-weight" => a.load_weight = val.parse()?,
                "--frontend" => a.frontend = Some(val.to_owned()),
                "--page-size" => a.page_size = val.parse()?,
                "--seeds" => a.seeds = val.parse::<u64>()?.max(1),
                "--kv" => a.kv = kv_shape(val)?,
                "--cache-mb" => a.cache_bytes = val.parse::<usize>()? << 20,
                // The shape's settings, as flags given here: later flags still change them.
                "--shape" if val == "eviction" => {
                    a = Shape::Eviction.apply(&a);
                    a.shape = Shape::Eviction;
                }
                "--shape" if val == "chat" => a.shape = Shape::Chat,
                "--shape" => anyhow::bail!("unknown shape {val} (chat, eviction)"),
                "--tune" => {
                    let w = val.split(',').map(str::parse).collect::<Result<Vec<f64>, _>>()?;
                    anyhow::ensure!(!w.is_empty(), "--tune needs load weights");
                    a.tune = Some(w);
                }
                "--policies" => {
                    a.policies = val
                        .split(',')
                        .map(|p| match p {
                            "kv_aware" => Ok(Policy::KvAware),
                            "round_robin" => Ok(Policy::RoundRobin),
                            "random" => Ok(Policy::Random),
                            "power_of_two" => Ok(Policy::PowerOfTwo),
                            "prefix_hash" => Ok(Policy::PrefixHash),
                            other => Err(anyhow::anyhow!("unknown policy {other}")),
                        })
                        .collect::<Result<_, _>>()?
                }
                other => anyhow::bail!("unknown flag {other}"),
            }
            Ok(())
        })?;
        anyhow::ensure!(
            a.tune.is_none() || a.frontend.is_none(),
            "--tune needs fresh clusters: it cannot run with --frontend"
        );
        anyhow::ensure!(
            a.tune.is_none() || a.shape == Shape::Chat,
            "--tune chooses on the chat shape and reports on both: leave out --shape"
        );
        Ok(a)
    }
}

/// SmolLM2-135M's KV per token: 30 layers, 3 KV heads of 64 f32.
const SMOLLM2: KvShape = KvShape { layers: 30, kv_heads: 3, head_bytes: 256 };

fn kv_shape(name: &str) -> anyhow::Result<KvShape> {
    match name {
        "mock" => Ok(MockConfig::default().shape),
        "smollm2" => Ok(SMOLLM2),
        other => anyhow::bail!("unknown KV shape {other} (mock, smollm2)"),
    }
}

fn tokens(rng: &mut StdRng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(2..30_000)).collect()
}

#[derive(Debug, Default)]
struct Sample {
    ttft: Duration,
    itl: Option<Duration>,
    prompt: u32,
    cached: u32,
    /// Tokens one infinite cache would have held (see the module docs).
    ceiling: u32,
    generated: u32,
}

#[derive(Debug, Default)]
struct Report {
    samples: Vec<Sample>,
    errors: usize,
    wall: Duration,
}

/// Every full page of every prompt whose first token came back: what one infinite cache
/// would hold.
type Seen = Mutex<HashSet<BlockHash>>;

async fn turn(
    client: &mut GenerateClient<Channel>,
    prompt: Vec<u32>,
    policy: Policy,
    answer: u32,
    (seen, page): (&Seen, usize),
) -> anyhow::Result<(Sample, Vec<u32>)> {
    let prompt_len = prompt.len() as u32;
    let hashes = block_hashes(&prompt, page);
    // Like the prefill, leave at least one token to compute.
    let usable = (prompt.len() - 1) / page;
    let mut ceiling = 0;
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: prompt })),
        sampling: Some(SamplingParams {
            max_tokens: answer,
            ignore_eos: true,
            ..Default::default()
        }),
        policy: policy as i32,
        // A frontend takes at most its request timeout (60 s by default).
        deadline_ms: 60_000,
        ..Default::default()
    };
    let start = Instant::now();
    let mut s = client.generate(req).await?.into_inner();
    let (mut out, mut ttft, mut cached) = (Vec::new(), None, 0);
    while let Some(m) = s.message().await? {
        match m.event {
            Some(Event::Chunk(c)) => {
                if ttft.is_none() {
                    ttft = Some(start.elapsed());
                    let mut seen = seen.lock().unwrap_or_else(|e| e.into_inner());
                    let held = hashes.iter().take(usable).take_while(|h| seen.contains(h));
                    ceiling = (held.count() * page) as u32;
                    seen.extend(&hashes);
                }
                out.extend(c.token_ids);
            }
            Some(Event::Complete(c)) => cached = c.usage.map_or(0, |u| u.cached_tokens),
            None => {}
        }
    }
    let ttft = ttft.ok_or_else(|| anyhow::anyhow!("no token"))?;
    let itl = (out.len() > 1).then(|| (start.elapsed() - ttft) / (out.len() as u32 - 1));
    let generated = out.len() as u32;
    Ok((Sample { ttft, itl, prompt: prompt_len, cached, ceiling, generated }, out))
}

async fn run_policy(a: &Args, policy: Policy, seed: u64) -> anyhow::Result<Report> {
    let cluster = match &a.frontend {
        Some(_) => None,
        None => {
            let engine: Arc<dyn Engine> = Arc::new(MockEngine::new(MockConfig {
                prefill_per_token: Duration::from_micros(a.prefill_us),
                decode_per_token: Duration::from_micros(a.decode_us),
                shape: a.kv,
                ..MockConfig::default()
            }));
            let mut cfg = ClusterConfig {
                prefills: a.instances,
                prefill_tp: 1,
                prefill_cache_bytes: a.cache_bytes,
                ..ClusterConfig::ephemeral()
            };
            cfg.scheduler.params.kv_aware.load = a.load_weight;
            Some(Cluster::start_shared(cfg, engine).await?)
        }
    };
    let addr = match (&a.frontend, &cluster) {
        (Some(f), _) => f.clone(),
        (None, Some(c)) => c.frontend_addr.to_string(),
        (None, None) => unreachable!("a cluster was started"),
    };
    let client = GenerateClient::connect(format!("http://{addr}")).await?;
    let seen: Arc<Seen> = Arc::default();

    // The same workload shape for every policy (the same tokens on fresh clusters).
    let mut rng = StdRng::seed_from_u64(seed);
    let systems: Vec<Vec<u32>> =
        (0..a.systems).map(|_| tokens(&mut rng, a.system_tokens)).collect();
    let users: Vec<Mutex<(Vec<u32>, usize, bool)>> =
        (0..a.users).map(|u| Mutex::new((systems[u % a.systems].clone(), 0, false))).collect();
    let users = Arc::new(users);
    let report = Arc::new(Mutex::new(Report::default()));
    let start = Instant::now();
    let mut inflight = tokio::task::JoinSet::new();
    while start.elapsed().as_secs_f64() < a.seconds {
        // Poisson arrivals.
        let gap = -rng.random::<f64>().max(1e-9).ln() / a.rate;
        tokio::time::sleep(Duration::from_secs_f64(gap)).await;
        // A random user who is not waiting for an answer and has turns left (a fixed order
        // would line users up with round-robin's rotation).
        let ready: Vec<usize> = (0..a.users)
            .filter(|&u| {
                let s = users[u].lock().unwrap_or_else(|e| e.into_inner());
                !s.2 && s.1 < a.turns
            })
            .collect();
        if ready.is_empty() {
            continue;
        }
        let u = ready[rng.random_range(0..ready.len())];
        let question = tokens(&mut rng, a.question_tokens);
        let prompt = {
            let mut s = users[u].lock().unwrap_or_else(|e| e.into_inner());
            s.0.extend(&question);
            s.2 = true;
            s.0.clone()
        };
        let (mut c, users, report, answer, seen, page) = (
            client.clone(),
            users.clone(),
            report.clone(),
            a.answer_tokens,
            seen.clone(),
            a.page_size,
        );
        inflight.spawn(async move {
            let r = turn(&mut c, prompt, policy, answer, (&seen, page)).await;
            let mut s = users[u].lock().unwrap_or_else(|e| e.into_inner());
            s.2 = false;
            s.1 += 1;
            let mut rep = report.lock().unwrap_or_else(|e| e.into_inner());
            match r {
                Ok((sample, out)) => {
                    s.0.extend(out);
                    rep.samples.push(sample);
                }
                Err(_) => rep.errors += 1,
            }
        });
    }
    while inflight.join_next().await.is_some() {}
    let wall = start.elapsed();
    if let Some(cluster) = cluster {
        cluster.shutdown().await;
    }
    let mut r = std::mem::take(&mut *report.lock().unwrap_or_else(|e| e.into_inner()));
    r.wall = wall;
    Ok(r)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut a = Args::parse()?;
    let mut out = handoff_benches::record::Report::new("loadgen");
    let mut seeds_run = Vec::new();
    let runs = match &a.tune {
        Some(weights) => {
            let (best, lines) = tune::tune(&a, weights).await?;
            for l in lines {
                writeln!(out, "{l}")?;
            }
            a.load_weight = best;
            // Chosen on the chat shape; reported on it and on the one it never saw.
            vec![(Shape::Chat, a.clone()), (Shape::Eviction, Shape::Eviction.apply(&a))]
        }
        None => vec![(a.shape, a.clone())],
    };
    for (shape, a) in runs {
        let rows = run_policies(&a, &mut seeds_run).await?;
        table::write(&mut out, &a, &rows)?;
        if let Some(path) = &a.svg {
            let path = match (a.tune.is_some(), shape) {
                (true, Shape::Eviction) => path.replace(".svg", "-eviction.svg"),
                _ => path.clone(),
            };
            std::fs::write(&path, plot::svg(&rows))?;
            writeln!(out, "\nplot: {path}\n")?;
        }
    }
    out.note("seeds", serde_json::json!(seeds_run));
    out.finish()?;
    Ok(())
}

/// Every policy of `a` over its seeds (noted in `seeds_run`).
async fn run_policies(a: &Args, seeds_run: &mut Vec<u64>) -> anyhow::Result<Vec<Summary>> {
    let mut rows = Vec::new();
    for (i, &p) in a.policies.iter().enumerate() {
        let mut runs = Vec::new();
        for k in 0..a.seeds {
            // The same workloads for every policy on fresh clusters; a live cluster keeps
            // its caches between runs, so there every run gets prompts of its own.
            let seed = if a.frontend.is_some() { 42 + i as u64 * a.seeds + k } else { 42 + k };
            seeds_run.push(seed);
            runs.push(row_of(run_policy(a, p, seed).await?));
        }
        rows.push(Summary { policy: name(p), runs });
    }
    Ok(rows)
}
