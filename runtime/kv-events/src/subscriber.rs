//! [`EngineStream`]: one engine endpoint's KV events, in order, as index operations.
//!
//! A SUB socket connects to the engine's publisher (`[topic, seq (u64 BE), payload]`). The
//! stream keeps the last sequence number applied:
//! - the next one is applied;
//! - a repeat is dropped;
//! - a gap is filled from the engine's replay socket (a DEALER asking `[b"", start]`; replies
//!   `[b"", topic?, seq, payload]` until seq `u64::MAX`, both of vLLM's layouts), and if the
//!   replay no longer covers it, or there is no replay socket, the worker is cleared and
//!   rebuilt from what comes next;
//! - a sequence that goes backwards is an engine restart: the worker is cleared.
//!
//! Each batch's events go through the worker's [`WorkerChains`] and come out as
//! [`IndexOp`]s for the sink. Bad payloads are counted and skipped; nothing here blocks
//! another engine's stream.
//!
//! Both sockets speak ZMTP through `handoff_core::zmtp`, with every length the engine
//! declares bounded ([`EVENT_LIMITS`]) before anything is kept for it; a lost connection
//! is made again (a second later), and what was missed meanwhile is a gap like any other.
//! Endpoints are `tcp://host:port`.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use handoff_core::zmtp::{Connection, Limits};
use tracing::{debug, warn};

use crate::chain::{ChainError, IndexOp, WorkerChains};
use crate::decode::decode_batch;

/// The replay end marker's sequence number (-1).
const END: u64 = u64::MAX;
/// How long a replay may go without a word (its connect, its first answer, each next one)
/// before the worker is rebuilt instead.
const REPLAY_QUIET: Duration = Duration::from_secs(2);
/// How long a whole replay may take (the live stream waits behind it). Before, the whole
/// replay had [`REPLAY_QUIET`]: a large buffer over a long round trip never finished, and
/// the worker's entries were cleared at each gap.
const REPLAY_LONGEST: Duration = Duration::from_secs(15);

/// The longest batch taken from an engine: a prompt of a few million tokens stored at once.
pub const EVENT_LIMITS: Limits =
    Limits { frame: 16 << 20, message: 16 << 20, within: Duration::from_secs(30) };

/// `host:port` of a `tcp://host:port` endpoint.
fn tcp_addr(endpoint: &str) -> Result<&str, String> {
    endpoint.strip_prefix("tcp://").ok_or_else(|| format!("{endpoint} is not tcp://host:port"))
}

/// A SUB connection to the publisher at `endpoint`, subscribed to `topic`.
async fn subscribe(endpoint: &str, topic: &str) -> Result<Connection, String> {
    let sub = Connection::connect(tcp_addr(endpoint)?, b"SUB", b"PUB").await;
    let mut sub = sub.map_err(|e| e.to_string())?.with_limits(EVENT_LIMITS);
    // ZMTP 3.0's subscription: a message of 1 then the topic (publishers of 3.1 take it too).
    let mut subscription = vec![1u8];
    subscription.extend_from_slice(topic.as_bytes());
    sub.send(&[Bytes::from(subscription)]).await.map_err(|e| e.to_string())?;
    Ok(sub)
}

/// Where an engine publishes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineEndpoint {
    /// The PUB socket, e.g. `tcp://10.0.0.5:5557` (dp rank r publishes on port + r).
    pub events: String,
    /// Its ROUTER replay socket, if the engine has one.
    pub replay: Option<String>,
    /// The topic to subscribe to (`""`: every topic).
    pub topic: String,
}

/// What a stream has seen (for logs and metrics).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StreamStats {
    /// Seconds between the last applied batch's timestamp (the engine's clock) and when it
    /// was applied here.
    pub lag_secs: f64,
    /// Batches applied.
    pub batches: u64,
    /// Batches recovered by replay.
    pub replayed: u64,
    /// Times the worker was cleared to rebuild (a gap replay could not fill, a restart).
    pub rebuilds: u64,
    /// Payloads or events refused.
    pub refused: u64,
}

/// One engine endpoint's stream (see the module docs).
pub struct EngineStream {
    endpoint: EngineEndpoint,
    chains: WorkerChains,
    last: Option<u64>,
    /// The live seq that triggered the last replay: live messages after it and up to what
    /// the replay reached are duplicates, not a restart.
    replayed_past: Option<u64>,
    stats: StreamStats,
    /// A copy of `stats` kept current for readers elsewhere (metrics).
    meter: Option<Arc<Mutex<StreamStats>>>,
}

impl std::fmt::Debug for EngineStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineStream")
            .field("endpoint", &self.endpoint)
            .field("last", &self.last)
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// A live or replayed message: its sequence number and payload.
fn seq_and_payload(frames: &[Bytes]) -> Option<(u64, &Bytes)> {
    let [.., seq, payload] = frames else { return None };
    let seq: [u8; 8] = seq.as_ref().try_into().ok()?;
    Some((u64::from_be_bytes(seq), payload))
}

impl EngineStream {
    /// A stream of `endpoint`, hashing `page_size` tokens per page (ours), remembering at
    /// most `max_blocks` engine blocks.
    pub fn new(endpoint: EngineEndpoint, page_size: usize, max_blocks: usize) -> Self {
        EngineStream {
            endpoint,
            chains: WorkerChains::new(page_size, max_blocks),
            last: None,
            replayed_past: None,
            stats: StreamStats::default(),
            meter: None,
        }
    }

    /// Keeps `meter` current with the stream's stats after every message.
    pub fn with_meter(mut self, meter: Arc<Mutex<StreamStats>>) -> Self {
        self.meter = Some(meter);
        self
    }

    /// What it has seen.
    pub fn stats(&self) -> StreamStats {
        self.stats
    }

    /// Subscribes and applies until `shutdown` completes, handing every batch's operations
    /// to `sink`. A sink that answers `false` lost the worker's index entries (the worker
    /// was cleared meanwhile): the block map starts over.
    pub async fn run(
        mut self,
        mut sink: impl FnMut(Vec<IndexOp>) -> bool + Send,
        shutdown: impl Future<Output = ()> + Send,
    ) -> StreamStats {
        tokio::pin!(shutdown);
        let mut lost = false;
        loop {
            let tried = tokio::time::Instant::now();
            let connected = tokio::select! {
                _ = &mut shutdown => return self.stats,
                r = subscribe(&self.endpoint.events, &self.endpoint.topic) => r,
            };
            let mut sub = match connected {
                Ok(sub) => sub,
                Err(e) => {
                    if !std::mem::replace(&mut lost, true) {
                        warn!(endpoint = %self.endpoint.events, error = %e, "KV event stream not connected; retrying every second");
                    }
                    tokio::select! {
                        _ = &mut shutdown => return self.stats,
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                    continue;
                }
            };
            lost = false;
            loop {
                let msg = tokio::select! {
                    _ = &mut shutdown => return self.stats,
                    m = sub.recv() => m,
                };
                match msg {
                    // A replay may take seconds: the stop does not wait for it.
                    Ok(frames) => tokio::select! {
                        _ = &mut shutdown => return self.stats,
                        _ = self.on_message(&frames, &mut sink) => {}
                    },
                    Err(e) => {
                        debug!(endpoint = %self.endpoint.events, error = %e, "KV event stream lost; connecting again");
                        // At most one connection a second: a publisher that closes each
                        // stream after its handshake was connected to in a tight loop.
                        tokio::select! {
                            _ = &mut shutdown => return self.stats,
                            _ = tokio::time::sleep_until(tried + Duration::from_secs(1)) => {}
                        }
                        break;
                    }
                }
                if let Some(m) = &self.meter {
                    *m.lock().unwrap_or_else(|e| e.into_inner()) = self.stats;
                }
            }
        }
    }

    /// Handles one live message.
    pub async fn on_message(
        &mut self,
        frames: &[Bytes],
        sink: &mut impl FnMut(Vec<IndexOp>) -> bool,
    ) {
        let Some((seq, payload)) = seq_and_payload(frames) else {
            self.refuse(&"a message without sequence and payload frames");
            return;
        };
        if self.last.is_some_and(|last| seq > last) {
            // Past what any replay covered: an earlier sequence from here on is a restart.
            self.replayed_past = None;
        }
        match self.last {
            Some(last) if seq == last => return,
            // Live messages queued while a replay ran past them: already applied.
            Some(last) if seq < last && self.replayed_past.is_some_and(|from| seq > from) => {
                return;
            }
            Some(last) if seq < last => {
                debug!(endpoint = %self.endpoint.events, seq, last, "engine restarted");
                self.rebuild(sink);
                // The new engine's sequence starts over: follow it from its start.
                self.last = None;
                self.replayed_past = None;
                if seq > 0 {
                    self.replayed_past = Some(seq);
                    self.fill(0, sink).await;
                }
            }
            Some(last) if seq > last + 1 => {
                self.replayed_past = Some(seq);
                self.fill(last + 1, sink).await;
            }
            None if seq > 0 => {
                self.replayed_past = Some(seq);
                self.fill(0, sink).await;
            }
            _ => {}
        }
        if self.last.is_none_or(|l| seq > l) {
            self.apply(seq, payload, sink);
        }
    }

    /// Fills a gap from `start` through the replay socket, or clears the worker.
    async fn fill(&mut self, start: u64, sink: &mut impl FnMut(Vec<IndexOp>) -> bool) {
        let replayed = match &self.endpoint.replay {
            Some(r) => tokio::time::timeout(REPLAY_LONGEST, replay(r, start)).await.ok().flatten(),
            None => None,
        };
        let Some(batches) = replayed else {
            if self.last.is_some() {
                self.lost(sink);
            }
            return;
        };
        let first = batches.first().map(|(s, _)| *s);
        if self.last.is_some() && first.is_none_or(|f| f > start) {
            // The replay buffer no longer holds the gap.
            self.lost(sink);
        }
        for (seq, payload) in batches {
            if self.last.is_none_or(|l| seq > l) {
                self.stats.replayed += 1;
                self.apply(seq, &payload, sink);
            }
        }
    }

    /// Counts a refused message or event: the stream's first is logged as a warning, the
    /// rest at debug level (the count is in [`StreamStats::refused`] and the metrics).
    fn refuse(&mut self, what: &dyn std::fmt::Display) {
        self.stats.refused += 1;
        if self.stats.refused == 1 {
            warn!(endpoint = %self.endpoint.events, %what, "KV event refused (further ones are counted, logged at debug level)");
        } else {
            debug!(endpoint = %self.endpoint.events, %what, "KV event refused");
        }
    }

    /// The engine started over (its cache empty): its blocks are forgotten, and its entries
    /// cleared.
    fn rebuild(&mut self, sink: &mut impl FnMut(Vec<IndexOp>) -> bool) {
        self.stats.rebuilds += 1;
        self.chains.reset();
        sink(vec![IndexOp::Clear]);
    }

    /// Events were lost (a gap no replay fills): the worker's entries are cleared, and its
    /// blocks known kept, stored again as stores continue them
    /// ([`WorkerChains::forget_index`]).
    fn lost(&mut self, sink: &mut impl FnMut(Vec<IndexOp>) -> bool) {
        self.stats.rebuilds += 1;
        self.chains.forget_index(true);
        sink(vec![IndexOp::Clear]);
    }

    fn apply(&mut self, seq: u64, payload: &[u8], sink: &mut impl FnMut(Vec<IndexOp>) -> bool) {
        self.last = Some(seq);
        let batch = match decode_batch(payload) {
            Ok(b) => b,
            Err(e) => {
                self.refuse(&format_args!("batch {seq}: {e}"));
                return;
            }
        };
        self.stats.batches += 1;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        let lag = now.map_or(0.0, |n| n.as_secs_f64() - batch.ts);
        // A timestamp that is no time at all (NaN, infinite) says nothing about lag.
        self.stats.lag_secs = if lag.is_finite() { lag.max(0.0) } else { 0.0 };
        let mut ops = Vec::new();
        for ev in &batch.events {
            match self.chains.apply(ev) {
                Ok(o) => ops.extend(o),
                Err(e @ (ChainError::UnknownParent(_) | ChainError::Inconsistent { .. })) => {
                    self.refuse(&format_args!("batch {seq}: event skipped: {e}"));
                }
            }
        }
        if !ops.is_empty() && !sink(ops) {
            // The index lost this worker's entries (silenced meanwhile): its blocks are
            // stored again as stores continue them.
            self.stats.rebuilds += 1;
            self.chains.forget_index(false);
        }
    }
}

/// Asks the replay socket at `endpoint` for every batch from `start`; `None` if it fails.
async fn replay(endpoint: &str, start: u64) -> Option<Vec<(u64, Bytes)>> {
    use tokio::time::timeout as quiet;
    let dealer =
        quiet(REPLAY_QUIET, Connection::connect(tcp_addr(endpoint).ok()?, b"DEALER", b"ROUTER"))
            .await;
    let mut dealer = dealer.ok()?.ok()?.with_limits(EVENT_LIMITS);
    let ask = [Bytes::new(), Bytes::copy_from_slice(&start.to_be_bytes())];
    quiet(REPLAY_QUIET, dealer.send(&ask)).await.ok()?.ok()?;
    let (mut out, mut bytes) = (Vec::new(), 0usize);
    loop {
        let frames = quiet(REPLAY_QUIET, dealer.recv()).await.ok()?.ok()?;
        let (seq, payload) = seq_and_payload(&frames)?;
        if seq == END {
            return Some(out);
        }
        bytes += payload.len();
        if out.len() >= MAX_REPLAY_BATCHES || bytes > MAX_REPLAY_BYTES {
            return None;
        }
        out.push((seq, payload.clone()));
    }
}

/// Most batches and bytes one replay may bring (beyond, the worker is rebuilt instead).
const MAX_REPLAY_BATCHES: usize = 100_000;
const MAX_REPLAY_BYTES: usize = 256 << 20;
