//! What operations instrumentation costs on the request path: the whole disaggregated path
//! (mock compute zero, so orchestration is all there is) with metrics and request traces off,
//! with them on, and with them on plus INFO spans and logs formatted as JSON (written to a
//! sink). The three run in interleaved rounds on one cluster, so drift hits them alike.
//! Prints TTFT p50/p99 and throughput per configuration and concurrency, and the difference
//! to "off".
//!
//! ```text
//! cargo run --release -p handoff-benches --bin ops_overhead -- [prompt_tokens] [requests_per_round] [rounds]
//! ```

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use handoff::{Cluster, ClusterConfig};
use handoff_benches::path::{pct, prompt, ttft, us};
use handoff_engine::{MockConfig, MockEngine};
use handoff_proto::v1::generate_client::GenerateClient;
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::reload;
use tracing_subscriber::util::SubscriberInitExt;

#[derive(Debug, Clone, Copy, PartialEq)]
enum Ops {
    Off,
    Metrics,
    MetricsAndLogs,
}

impl Ops {
    fn name(self) -> &'static str {
        match self {
            Ops::Off => "off",
            Ops::Metrics => "metrics + traces",
            Ops::MetricsAndLogs => "metrics + traces + JSON logs (INFO)",
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let prompt_tokens: usize = args.next().map_or(Ok(256), |a| a.parse())?;
    let per_round: usize = args.next().map_or(Ok(300), |a| a.parse())?;
    let rounds: usize = args.next().map_or(Ok(5), |a| a.parse())?;

    // Logs go to a sink: what is measured is formatting them, not the terminal.
    let (level, switch) = reload::Layer::new(LevelFilter::OFF);
    tracing_subscriber::registry()
        .with(level)
        .with(tracing_subscriber::fmt::layer().json().with_writer(std::io::sink))
        .init();

    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let cluster = Cluster::start_shared(ClusterConfig::ephemeral(), engine).await?;
    let client = GenerateClient::connect(format!("http://{}", cluster.frontend_addr)).await?;
    let configs = [Ops::Off, Ops::Metrics, Ops::MetricsAndLogs];
    let mut out = handoff_benches::record::Report::new("ops_overhead");
    writeln!(
        out,
        "prompt {prompt_tokens} tokens, {rounds} interleaved rounds of {per_round} requests per configuration, mock compute 0, tcp transfer"
    )?;
    writeln!(out)?;
    writeln!(
        out,
        "| concurrency | configuration | TTFT p50 (us) | TTFT p99 (us) | req/s | p50 vs off (us) | req/s vs off |"
    )?;
    writeln!(out, "|---:|---|---:|---:|---:|---:|---:|")?;
    let mut seed = 0u32;
    for conc in [1usize, 16] {
        let mut ttfts: Vec<Vec<Duration>> = vec![Vec::new(); configs.len()];
        let mut walls = vec![Duration::ZERO; configs.len()];
        for round in 0..=rounds {
            for (k, ops) in configs.iter().enumerate() {
                handoff_core::metrics::set_enabled(*ops != Ops::Off);
                let filter =
                    if *ops == Ops::MetricsAndLogs { LevelFilter::INFO } else { LevelFilter::OFF };
                switch.modify(|l| *l = filter)?;
                let start = Instant::now();
                let runs = futures::stream::iter(0..per_round).map(|_| {
                    seed += 1;
                    let (mut c, s) = (client.clone(), seed);
                    // Distinct prompts: no prefix reuse.
                    async move { ttft(&mut c, prompt(s, prompt_tokens)).await }
                });
                let t: Vec<Duration> = runs
                    .buffer_unordered(conc)
                    .collect::<Vec<_>>()
                    .await
                    .into_iter()
                    .collect::<Result<_, _>>()?;
                // Round 0 warms up (connections, caches) and is not counted.
                if round > 0 {
                    walls[k] += start.elapsed();
                    ttfts[k].extend(t);
                }
            }
        }
        let n = (per_round * rounds) as f64;
        let off_p50 = {
            ttfts[0].sort();
            us(pct(&ttfts[0], 0.5))
        };
        let off_rate = n / walls[0].as_secs_f64();
        for (k, ops) in configs.iter().enumerate() {
            ttfts[k].sort();
            let (p50, p99) = (us(pct(&ttfts[k], 0.5)), us(pct(&ttfts[k], 0.99)));
            let rate = n / walls[k].as_secs_f64();
            writeln!(
                out,
                "| {conc} | {} | {p50:.0} | {p99:.0} | {rate:.0} | {:+.0} | {:+.1} % |",
                ops.name(),
                p50 - off_p50,
                (rate / off_rate - 1.0) * 100.0
            )?;
        }
    }
    handoff_core::metrics::set_enabled(true);
    cluster.shutdown().await;
    out.finish()?;
    Ok(())
}
