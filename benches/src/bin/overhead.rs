//! Orchestration overhead of the whole disaggregated path: TTFT through the frontend
//! (scheduler, room, directory, handshakes, prefill gRPC, KV transfer over tcp, verify,
//! reassembly) minus the TTFT of the same mock engine called in-process, with mock compute
//! set to zero. Prints p50 and p99 per concurrency as a Markdown table.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin overhead -- [prompt_tokens] [requests_per_level]
//! ```

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use handoff::{Cluster, ClusterConfig};
use handoff_benches::path::{pct, prompt, ttft, us};
use handoff_engine::{Engine, MockConfig, MockEngine, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let prompt_tokens: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let per_level: usize = args.next().map_or(Ok(2000), |a| a.parse())?;
    let engine = Arc::new(MockEngine::new(MockConfig::default()));

    // The in-process reference: prefill and first token with no orchestration at all.
    let mut base = Vec::new();
    for i in 0..per_level {
        let p = prompt(i as u32, prompt_tokens);
        let start = Instant::now();
        let out = engine.prefill(&p, None, &Sampling::default()).await?;
        std::hint::black_box(out.first_token);
        base.push(start.elapsed());
    }
    base.sort();
    let base_p50 = pct(&base, 0.5);

    let cluster = Cluster::start_shared(ClusterConfig::ephemeral(), engine.clone()).await?;
    let client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
    let mut out = handoff_benches::record::Report::new("overhead");
    writeln!(
        out,
        "prompt {prompt_tokens} tokens, {per_level} requests per level, 2 prefill instances (tp 2), decode tp 1, tcp transfer, mock compute 0"
    )?;
    writeln!(
        out,
        "in-process mock TTFT: p50 {:.1} us, p99 {:.1} us",
        us(base_p50),
        us(pct(&base, 0.99))
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| concurrency | TTFT p50 (us) | TTFT p99 (us) | overhead p50 (us) | overhead p99 (us) | req/s |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|")?;
    for conc in [1usize, 64] {
        // Warm-up: connections, caches.
        let warm = futures::stream::iter(0..conc * 4).map(|i| {
            let mut c = client.clone();
            async move { ttft(&mut c, prompt(1_000_000 + i as u32, prompt_tokens)).await }
        });
        for r in warm.buffer_unordered(conc).collect::<Vec<_>>().await {
            r?;
        }
        let start = Instant::now();
        let runs = futures::stream::iter(0..per_level).map(|i| {
            let mut c = client.clone();
            // Distinct prompts: no prefix reuse, every request computes its whole prompt.
            async move { ttft(&mut c, prompt((conc * per_level + i) as u32, prompt_tokens)).await }
        });
        let mut t: Vec<Duration> = runs
            .buffer_unordered(conc)
            .collect::<Vec<_>>()
            .await
            .into_iter()
            .collect::<Result<_, _>>()?;
        let wall = start.elapsed();
        t.sort();
        let (p50, p99) = (pct(&t, 0.5), pct(&t, 0.99));
        writeln!(
            out,
            "| {conc} | {:.0} | {:.0} | {:.0} | {:.0} | {:.0} |",
            us(p50),
            us(p99),
            us(p50.saturating_sub(base_p50)),
            us(p99.saturating_sub(base_p50)),
            per_level as f64 / wall.as_secs_f64()
        )?;
    }
    cluster.shutdown().await;
    out.finish()?;
    Ok(())
}
