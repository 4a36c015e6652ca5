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
//! (its prefill, no decoder, no gRPC: the unflattering comparison), in turn prompt by
//! prompt, after prompts that fill the prefill's prefix cache (`pairs.rs` says how).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_benches::path::one_token;
use handoff_engine::{Engine, Kv, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_smollm::{SmolConfig, SmolLm};
use handoff_transfer::TransferKind;

mod pairs;
use pairs::Shape;

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
    let t = Instant::now();
    let mut s = client.generate(one_token(tokens)).await?.into_inner();
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
        "TTFT 256-token prompt (one of each, different prompts): aggregated {:.0} ms, disaggregated {:.0} ms ({:+.1} ms)",
        ms(agg),
        ms(disagg),
        ms(disagg) - ms(agg)
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

    // The same prompts through each transfer backend beside the engine alone (`pairs`).
    let shapes = [
        Shape { tokens: 256, pairs: 12, first_salt: 40 },
        Shape { tokens: 1024, pairs: 6, first_salt: 60 },
    ];
    let loopback = std::net::Ipv4Addr::LOCALHOST.into();
    let tcp = |shared_memory| TransferKind::Tcp {
        bind_ip: loopback,
        advertise_ip: None,
        tls: None,
        shared_memory,
    };
    let backends = [
        ("tcp", tcp(false)),
        ("shm (tcp's same-host path)", tcp(true)),
        ("mooncake", TransferKind::Mooncake { bind_ip: loopback, advertise_ip: None }),
        ("nixl", TransferKind::Nixl { bind_ip: loopback, advertise_ip: None }),
    ];
    pairs::by_backend(&mut out, &e, &shapes, backends).await?;
    out.finish()?;
    Ok(())
}
