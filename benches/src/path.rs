//! What the path benchmarks (`overhead`, `ops_overhead`) share: distinct prompts, one
//! request's time to first token through a frontend, and percentiles.

use std::ops::Range;
use std::time::{Duration, Instant};

use futures::StreamExt;

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use tonic::transport::Channel;

/// CPU time this process has used (user and system, all threads), to the nanosecond
/// (`CLOCK_PROCESS_CPUTIME_ID`; `/proc`'s count is in 10 ms ticks).
pub fn process_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec.max(0) as u64, t.tv_nsec.clamp(0, 999_999_999) as u32)
}

/// CPU time the thread `tid` of this process has used (user and system), to the
/// nanosecond, from its `/proc/self/task/<tid>/schedstat`: exact for a thread that is not
/// running, up to its last scheduler tick for one that is.
pub fn thread_cpu(tid: u32) -> anyhow::Result<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat"))?;
    Ok(Duration::from_nanos(ran_ns(&stat)?))
}

/// The time on a CPU a `schedstat` line gives (its first field, in nanoseconds).
fn ran_ns(schedstat: &str) -> anyhow::Result<u64> {
    let first = schedstat.split_whitespace().next();
    Ok(first.ok_or_else(|| anyhow::anyhow!("an empty schedstat"))?.parse()?)
}

/// The CPU time each of this process's threads has used, to the nanosecond
/// (`/proc/self/task/*/schedstat`, the time each has run), but for those whose name starts
/// with one of the prefixes it was read with.
#[derive(Debug, Clone)]
pub struct ThreadsCpu(std::collections::HashMap<u32, u64>);

impl ThreadsCpu {
    /// Reads every thread alive now but those whose name starts with one of `skip`.
    pub fn read(skip: &[&str]) -> anyhow::Result<Self> {
        let mut ns = std::collections::HashMap::new();
        for task in std::fs::read_dir("/proc/self/task")? {
            let task = task?;
            let Some(tid) = task.file_name().to_str().and_then(|t| t.parse::<u32>().ok()) else {
                continue;
            };
            // A thread that ended while being read counts nothing.
            let (Ok(name), Ok(stat)) = (
                std::fs::read_to_string(task.path().join("comm")),
                std::fs::read_to_string(task.path().join("schedstat")),
            ) else {
                continue;
            };
            if !skip.iter().any(|s| name.starts_with(s)) {
                ns.insert(tid, ran_ns(&stat)?);
            }
        }
        Ok(ThreadsCpu(ns))
    }

    /// What the threads read here used since `earlier`, thread by thread: one started since
    /// counts from zero, one that ended since takes its time with it.
    pub fn since(&self, earlier: &ThreadsCpu) -> Duration {
        let ns =
            self.0.iter().map(|(tid, &now)| now.saturating_sub(*earlier.0.get(tid).unwrap_or(&0)));
        Duration::from_nanos(ns.sum())
    }
}

/// The calling thread's id, as `/proc` names it.
pub fn current_tid() -> anyhow::Result<u32> {
    let link = std::fs::read_link("/proc/thread-self")?;
    let tid = link.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    Ok(tid.parse()?)
}

/// A runtime on one thread of its own, for a load generator whose CPU must be told apart
/// from the system's it loads: its futures (and the connections they open) run there.
pub struct OwnThread {
    /// Spawns onto it.
    pub handle: tokio::runtime::Handle,
    /// Its thread, for [`thread_cpu`].
    pub tid: u32,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl OwnThread {
    /// Starts it.
    pub fn start() -> anyhow::Result<Self> {
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("loadgen".into()).spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build();
            let rt = match rt {
                Ok(rt) => rt,
                Err(e) => return drop(tx.send(Err(anyhow::Error::from(e)))),
            };
            let _ = tx.send(current_tid().map(|tid| (rt.handle().clone(), tid)));
            rt.block_on(async {
                let _ = stopped.await;
            });
        })?;
        let (handle, tid) = rx.recv()??;
        Ok(OwnThread { handle, tid, stop: Some(stop), thread: Some(thread) })
    }

    /// Runs `f` there and waits for it.
    pub async fn run<F>(&self, f: F) -> anyhow::Result<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        Ok(self.handle.spawn(f).await?)
    }
}

impl Drop for OwnThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A closed loop's requests: each one's TTFT, the time they took together, and the CPU they
/// took, the process's and the load generator's.
#[derive(Debug, Default)]
pub struct Run {
    /// Each request's time to first token.
    pub t: Vec<Duration>,
    /// From the first request's start to the last one's answer.
    pub wall: Duration,
    /// The process's CPU over them.
    pub cpu: Duration,
    /// The load generator's thread's.
    pub client_cpu: Duration,
}

impl Run {
    /// Requests answered per second.
    pub fn rate(&self) -> f64 {
        self.t.len() as f64 / self.wall.as_secs_f64()
    }

    /// Adds `next`, run after it, as if one run.
    pub fn extend(&mut self, next: Run) {
        self.t.extend(next.t);
        self.wall += next.wall;
        self.cpu += next.cpu;
        self.client_cpu += next.client_cpu;
    }
}

/// One request per seed of `seeds` (a `tokens`-token prompt each), `conc` in flight, sent
/// from `loadgen`.
pub async fn closed_loop(
    loadgen: &OwnThread,
    client: &GenerateClient<Channel>,
    conc: usize,
    seeds: Range<u32>,
    tokens: usize,
) -> anyhow::Result<Run> {
    let (start, cpu, client_cpu) = (Instant::now(), process_cpu(), thread_cpu(loadgen.tid)?);
    let c = client.clone();
    let runs = loadgen.run(async move {
        let runs = futures::stream::iter(seeds).map(|s| {
            let mut c = c.clone();
            let p = prompt(s, tokens);
            async move { ttft(&mut c, p).await }
        });
        runs.buffer_unordered(conc).collect::<Vec<_>>().await
    });
    let t: Vec<Duration> = runs.await?.into_iter().collect::<Result<_, _>>()?;
    let wall = start.elapsed();
    let (cpu, client_cpu) = (process_cpu() - cpu, thread_cpu(loadgen.tid)? - client_cpu);
    Ok(Run { t, wall, cpu, client_cpu })
}

/// An `n`-token prompt of its own for each `seed` (no prefix shared with another seed's).
pub fn prompt(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| 2 + seed.wrapping_mul(7919).wrapping_add(i.wrapping_mul(104_729)) % 31_000)
        .collect()
}

/// A request for one token after `tokens` (end of sequence ignored).
pub fn one_token(tokens: Vec<u32>) -> GenerateRequest {
    GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: tokens })),
        sampling: Some(SamplingParams { max_tokens: 1, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// Sends `tokens` for one token and returns the time to it (the stream is read to its end).
pub async fn ttft(
    client: &mut GenerateClient<Channel>,
    tokens: Vec<u32>,
) -> anyhow::Result<Duration> {
    let start = Instant::now();
    let mut stream = client.generate(one_token(tokens)).await?.into_inner();
    let first = stream.message().await?;
    let t = start.elapsed();
    anyhow::ensure!(first.is_some(), "no first token");
    while stream.message().await?.is_some() {}
    Ok(t)
}

/// The `p` quantile of `sorted`: the element at `(len - 1) * p` rounded to the nearest
/// index, half up (the median of an even count is the upper middle one).
pub fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Distinct prompts of `tokens` tokens, with `token_bytes` of KV a token, that fill a
/// prefix cache of `cache_bytes` and evict from it.
pub fn cache_fill(cache_bytes: usize, tokens: usize, token_bytes: usize) -> usize {
    cache_bytes / (tokens * token_bytes) + 2
}

/// `d` in microseconds.
pub fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests;
