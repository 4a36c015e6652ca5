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
//! ```text
//! cargo run --release -p handoff-benches --bin loadgen -- --svg loadgen.svg
//! cargo run --release -p handoff-benches --bin loadgen -- --shape eviction --seconds 30
//! cargo run --release -p handoff-benches --bin loadgen -- --frontend 127.0.0.1:50051 --rate 0.5
//! ```

mod plot;

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
                // More system prompts than instances, SmolLM2-sized KV, and caches that
                // hold about one system prompt each: every policy must evict.
                "--shape" if val == "eviction" => {
                    (a.instances, a.systems, a.kv) = (8, 12, SMOLLM2);
                    a.cache_bytes = 48 << 20;
                }
                "--shape" => anyhow::bail!("unknown shape {val} (eviction)"),
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
        deadline_ms: 120_000,
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

fn pct(v: &mut [Duration], p: f64) -> Duration {
    if v.is_empty() {
        return Duration::ZERO;
    }
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize]
}

fn name(p: Policy) -> &'static str {
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
struct Row {
    hit: f64,
    ceiling: f64,
    ttft: [Duration; 3],
    itl: Duration,
    tps: f64,
    requests: usize,
    errors: usize,
}

/// One policy over every seed.
struct Summary {
    policy: &'static str,
    runs: Vec<Row>,
}

impl Summary {
    /// The mean, least and greatest of `f` over the seeds.
    fn spread(&self, f: impl Fn(&Row) -> f64) -> (f64, f64, f64) {
        let v: Vec<f64> = self.runs.iter().map(f).collect();
        let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
        let min = v.iter().copied().fold(f64::INFINITY, f64::min);
        let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        (mean, min, max)
    }
}

/// A run's row.
fn row_of(mut r: Report) -> Row {
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse()?;
    let mut rows = Vec::new();
    let mut seeds_run = Vec::new();
    for (i, &p) in a.policies.iter().enumerate() {
        let mut runs = Vec::new();
        for k in 0..a.seeds {
            // The same workloads for every policy on fresh clusters; a live cluster keeps
            // its caches between runs, so there every run gets prompts of its own.
            let seed = if a.frontend.is_some() { 42 + i as u64 * a.seeds + k } else { 42 + k };
            seeds_run.push(seed);
            runs.push(row_of(run_policy(&a, p, seed).await?));
        }
        rows.push(Summary { policy: name(p), runs });
    }
    let mut out = handoff_benches::record::Report::new("loadgen");
    out.note("seeds", serde_json::json!(seeds_run));
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
    for r in &rows {
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
    if let Some(path) = &a.svg {
        std::fs::write(path, plot::svg(&rows))?;
        writeln!(out, "\nplot: {path}")?;
    }
    out.finish()?;
    Ok(())
}
