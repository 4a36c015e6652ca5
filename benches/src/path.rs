//! What the path benchmarks (`overhead`, `ops_overhead`) share: distinct prompts, one
//! request's time to first token through a frontend, and percentiles.

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use tonic::transport::Channel;

/// CPU time this process has used (user and system, all threads), from `/proc/self/stat`
/// (10 ms ticks).
pub fn process_cpu() -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name (which may hold spaces) closed by ')'.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or_default();
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 =
        f.get(11).unwrap_or(&"0").parse::<u64>()? + f.get(12).unwrap_or(&"0").parse::<u64>()?;
    Ok(Duration::from_millis(ticks * 10))
}

/// An `n`-token prompt of its own for each `seed` (no prefix shared with another seed's).
pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 2 + seed.wrapping_mul(7919).wrapping_add(i.wrapping_mul(104_729)) % 31_000)
        .collect()
}

/// Sends `tokens` for one token and returns the time to it (the stream is read to its end).
pub async fn ttft(
    client: &mut GenerateClient<Channel>,
    tokens: Vec<u32>,
) -> anyhow::Result<Duration> {
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: tokens })),
        sampling: Some(SamplingParams { max_tokens: 1, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    };
    let start = Instant::now();
    let mut stream = client.generate(req).await?.into_inner();
    let first = stream.message().await?;
    let t = start.elapsed();
    anyhow::ensure!(first.is_some(), "no first token");
    while stream.message().await?.is_some() {}
    Ok(t)
}

/// The `p` quantile of `sorted` (nearest rank).
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// `d` in microseconds.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
