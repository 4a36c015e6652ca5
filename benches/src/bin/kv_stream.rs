//! What moving a prompt's KV adds to the time to first token beyond the compute.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin kv_stream -- [REPS]
//! ```
//!
//! The mock engine with SmolLM2-135M's KV shape (30 layers, 3 KV heads, 256 B per head and token:
//! 46 KB per token) and an exact compute time per token, through a real cluster (frontend,
//! scheduler, one prefill, decode tp 1) on loopback. Since the mock's compute time is exact, TTFT −
//! compute is what the KV and the path cost. `tcp streamed` and `mooncake streamed` send the layers
//! as they are computed (in parts of at least 1 MiB, the last layer alone while the sender keeps
//! up: `handoff_engine::layer_channel`); `tcp whole` is the same tcp path with the prefill's agent
//! behind an unarmed fault injector, which has no streams: the KV goes in one write after the
//! compute, as before streaming. Equal work, same run, interleaved. Beside them, the floor: the
//! KV's bytes through one plain loopback socket, and the path with a 1-token prompt (no KV to speak
//! of).
//! Shapes: 256 and 1024 tokens, at 0 (nothing to overlap: the unflattering one), 100 µs and
//! 1 ms of compute per token. Prints p50 and p90 of the tail in ms. At 0 µs the tail also
//! holds the mock's own making of its KV bytes (printed beside it), which no engine charges
//! for its compute.
//!
//! Before each shape's runs, every cluster's prefill fills its prefix cache with prompts of
//! that shape (not counted). Until its cache is full a process keeps every prompt's KV, so
//! the mock makes each new one on fresh pages the kernel faults in as it writes (about
//! 3.5 ms at 256 tokens on the machine this was found on), which lands in the 0 µs rows'
//! tail; a server that has been up a while reuses the memory its cache evicts.
//!
//! At 100 µs a token, a row more: each request after [`PAUSE`] with nothing to do (the
//! first request after a lull), where whatever a path lets go of while idle is paid for
//! again. With mimalloc's default purge delay of a second, the decode's region came back on
//! fresh pages the kernel faulted in (see `handoff::alloc`).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use handoff::{Cluster, ClusterConfig};
use handoff_benches::path::{pct, prompt, ttft};
use handoff_engine::{Engine, KvShape, MockConfig, MockEngine};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_transfer::{FaultSwitch, TransferKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The lull before each request of the paused rows: longer than mimalloc's default purge
/// delay (a second), shorter than the one the processes set (a minute).
const PAUSE: Duration = Duration::from_secs(2);

const SMOLLM: KvShape = KvShape { layers: 30, kv_heads: 3, head_bytes: 256 };

/// The time to move `bytes` through one plain loopback TCP connection (best of 3).
async fn socket_floor(bytes: usize) -> anyhow::Result<Duration> {
    let data = vec![7u8; bytes];
    let mut best = Duration::MAX;
    for _ in 0..3 {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        // In a set of its own, so an early error here aborts it rather than leaving it be.
        let mut reader = tokio::task::JoinSet::new();
        reader.spawn(async move {
            let (mut s, _) = l.accept().await?;
            let mut buf = vec![0u8; 256 << 10];
            let mut got = 0;
            while got < bytes {
                let k = s.read(&mut buf).await?;
                anyhow::ensure!(k > 0, "closed early");
                got += k;
            }
            s.write_all(b"k").await?;
            Ok::<_, anyhow::Error>(())
        });
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        let t = Instant::now();
        s.write_all(&data).await?;
        let mut ack = [0u8; 1];
        s.read_exact(&mut ack).await?;
        best = best.min(t.elapsed());
        reader.join_next().await.context("the reader task")???;
    }
    Ok(best)
}

/// What the mock spends making a prompt's KV bytes and first token (best of 3): CPU that
/// lands in the tail when nothing else is charged for the compute.
async fn mock_making(tokens: usize) -> anyhow::Result<Duration> {
    let e = MockEngine::new(MockConfig { shape: SMOLLM, ..MockConfig::default() });
    let mut best = Duration::MAX;
    for i in 0..3 {
        let t = Instant::now();
        e.prefill(&prompt(1_000_000 + i, tokens), None, &Default::default()).await?;
        best = best.min(t.elapsed());
    }
    Ok(best)
}

struct Path {
    cluster: Cluster,
    client: GenerateClient<tonic::transport::Channel>,
    /// Its prefill's prefix cache budget.
    cache_bytes: usize,
}

/// A cluster on `transfer`; `whole`: its prefill's agent behind an unarmed fault injector,
/// which has no streams, so the KV goes in one write after the compute (today's baseline).
async fn path(transfer: TransferKind, per_token: Duration, whole: bool) -> anyhow::Result<Path> {
    let faults = if whole { vec![Some(FaultSwitch::new())] } else { Vec::new() };
    let cfg = ClusterConfig {
        prefills: 1,
        prefill_tp: 1,
        transfer,
        faults,
        ..ClusterConfig::ephemeral()
    };
    let cache_bytes = cfg.prefill_cache_bytes;
    let mock = MockConfig { shape: SMOLLM, prefill_per_token: per_token, ..MockConfig::default() };
    let cluster =
        Cluster::start(cfg, &|| Ok(Arc::new(MockEngine::new(mock.clone())) as Arc<dyn Engine>))
            .await?;
    let mut client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
    ttft(&mut client, prompt(999_999, 32)).await?; // warm-up: connections
    Ok(Path { cluster, client, cache_bytes })
}

/// Prompts of `tokens` tokens enough to fill a prefix cache of `cache_bytes` and evict from
/// it.
fn cache_fill(cache_bytes: usize, tokens: usize) -> usize {
    handoff_benches::path::cache_fill(cache_bytes, tokens, SMOLLM.token_bytes())
}

/// Sends [`cache_fill`] distinct prompts of `tokens` tokens through `p` (see the module docs).
async fn fill_cache(p: &mut Path, tokens: usize, seed: &mut u32) -> anyhow::Result<()> {
    for _ in 0..cache_fill(p.cache_bytes, tokens) {
        *seed += 1;
        ttft(&mut p.client, prompt(*seed, tokens)).await?;
    }
    Ok(())
}

/// `reps` rounds of a `tokens`-token prompt through each path in turn, each after `pause`;
/// each path's tail (TTFT - `compute`) p50 / p90, ms.
async fn tails(
    paths: &mut [Path],
    tokens: usize,
    compute: Duration,
    reps: usize,
    pause: Duration,
    seed: &mut u32,
) -> anyhow::Result<Vec<String>> {
    let mut tails: Vec<Vec<Duration>> = vec![Vec::new(); paths.len()];
    for _ in 0..reps {
        for (p, tail) in paths.iter_mut().zip(tails.iter_mut()) {
            if !pause.is_zero() {
                tokio::time::sleep(pause).await;
            }
            *seed += 1;
            let t = ttft(&mut p.client, prompt(*seed, tokens)).await?;
            tail.push(t.saturating_sub(compute));
        }
    }
    Ok(tails
        .iter_mut()
        .map(|t| {
            t.sort();
            format!("{:.2} / {:.2}", ms(pct(t, 0.5)), ms(pct(t, 0.9)))
        })
        .collect())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let reps: usize = std::env::args().nth(1).map(|s| s.parse()).transpose()?.unwrap_or(15);
    let mut out = handoff_benches::record::Report::new("kv_stream");
    let loopback: std::net::IpAddr = std::net::Ipv4Addr::LOCALHOST.into();
    writeln!(
        out,
        "KV of {} B per token (SmolLM2-135M's shape); tail = TTFT - compute, ms; each shape's runs after {} (256 tokens) or {} (1024) prompts that fill the prefill's prefix cache",
        SMOLLM.token_bytes(),
        cache_fill(ClusterConfig::ephemeral().prefill_cache_bytes, 256),
        cache_fill(ClusterConfig::ephemeral().prefill_cache_bytes, 1024)
    )?;
    writeln!(
        out,
        "| tokens | compute/token | KV MB | socket floor | mock's KV making | 1-token path | tcp streamed p50 / p90 | tcp whole p50 / p90 | mooncake streamed p50 / p90 |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")?;
    let mut seed = 0;
    for per_token in [Duration::ZERO, Duration::from_micros(100), Duration::from_millis(1)] {
        let tcp = TransferKind::Tcp {
            bind_ip: loopback,
            advertise_ip: None,
            tls: None,
            shared_memory: false,
        };
        let mooncake = TransferKind::Mooncake { bind_ip: loopback, advertise_ip: None };
        let mut paths = vec![
            path(tcp.clone(), per_token, false).await?,
            path(tcp, per_token, true).await?,
            path(mooncake, per_token, false).await?,
        ];
        let mut bare = Vec::new();
        for tokens in [256usize, 1024] {
            for p in &mut paths {
                fill_cache(p, tokens, &mut seed).await?;
            }
            // The path without KV: a 1-token prompt's tail on the tcp cluster, once filled.
            while bare.len() < reps {
                seed += 1;
                let t = ttft(&mut paths[0].client, prompt(seed, 1)).await?;
                bare.push(t.saturating_sub(per_token));
            }
            bare.sort();
            let compute = per_token * tokens as u32;
            let bytes = tokens * SMOLLM.token_bytes();
            let floor = ms(socket_floor(bytes).await?);
            let making = ms(mock_making(tokens).await?);
            let pauses: &[Duration] = match per_token.as_micros() {
                100 => &[Duration::ZERO, PAUSE],
                _ => &[Duration::ZERO],
            };
            for &pause in pauses {
                let tails = tails(&mut paths, tokens, compute, reps, pause, &mut seed).await?;
                let (label, bare) = match pause.is_zero() {
                    true => (String::new(), format!("{:.2}", ms(pct(&bare, 0.5)))),
                    false => (format!(", each after {} s idle", pause.as_secs()), "-".into()),
                };
                writeln!(
                    out,
                    "| {tokens} | {} µs{label} | {:.1} | {floor:.2} | {making:.2} | {bare} | {} |",
                    per_token.as_micros(),
                    bytes as f64 / 1e6,
                    tails.join(" | "),
                )?;
            }
        }
        for p in paths {
            p.cluster.shutdown().await;
        }
    }
    out.finish()?;
    Ok(())
}
