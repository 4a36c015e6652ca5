//! [`Publisher`]: keeps the bus off the request path. Messages go into a bounded queue that
//! one owned task drains, each publish bounded by a timeout; a caller never waits on the bus.
//! When the queue is full the message is dropped and counted (as is one the bus did not
//! take: [`Publisher::unsent`]): KV events carry sequence
//! numbers, so a dropped one shows up as a gap and schedulers resync from a snapshot, and a
//! dropped heartbeat is followed by the next one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use handoff_core::Tasks;
use handoff_core::log_every::LogEvery;
use tokio::sync::mpsc;
use tracing::{info, warn};

use crate::EventBus;

/// A bounded, non-blocking publishing queue (see the module docs).
#[derive(Clone)]
pub struct Publisher {
    tx: mpsc::Sender<(String, Bytes)>,
    bus: Arc<dyn EventBus>,
    dropped: Arc<AtomicU64>,
    /// Messages the bus did not take (an error, or no answer in time).
    unsent: Arc<AtomicU64>,
    /// The last publish failed.
    failing: Arc<AtomicBool>,
    /// Drops said in the log at most once a minute.
    dropped_log: Arc<std::sync::Mutex<LogEvery>>,
}

/// A full queue's drops are logged at most this often.
const DROPS_LOGGED_EVERY: Duration = Duration::from_secs(60);

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher").field("dropped", &self.dropped()).finish_non_exhaustive()
    }
}

impl Publisher {
    /// Starts the draining task on `tasks`: at most `capacity` messages wait, and each
    /// publish may take at most `timeout`.
    pub fn start(
        bus: Arc<dyn EventBus>,
        capacity: usize,
        timeout: Duration,
        tasks: &Tasks,
    ) -> Self {
        let (tx, mut rx) = mpsc::channel::<(String, Bytes)>(capacity.max(1));
        let t = tasks.clone();
        let (unsent, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicBool::new(false)));
        let (unsent_here, failed_here, bus_here) = (unsent.clone(), failed.clone(), bus.clone());
        tasks.spawn(async move {
            loop {
                let (subject, payload) = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    m = rx.recv() => match m { Some(m) => m, None => break },
                };
                let sent = tokio::time::timeout(timeout, bus_here.publish(subject, payload)).await;
                let ok = matches!(sent, Ok(Ok(())));
                if !ok {
                    unsent_here.fetch_add(1, Ordering::Relaxed);
                }
                // Said once per change.
                let failing = failed_here.swap(!ok, Ordering::Relaxed);
                match sent {
                    Ok(Ok(())) if failing => info!("bus publishing works again"),
                    Ok(Ok(())) => {}
                    Ok(Err(e)) if !failing => {
                        warn!(error = %e, "bus publish failed; messages are dropped until it works")
                    }
                    Err(_) if !failing => {
                        warn!(
                            ?timeout,
                            "bus publish timed out; messages are dropped until it works"
                        )
                    }
                    _ => {}
                }
            }
        });
        let dropped_log = Arc::new(std::sync::Mutex::new(LogEvery::new(DROPS_LOGGED_EVERY)));
        Publisher { tx, bus, dropped: Arc::default(), unsent, failing: failed, dropped_log }
    }

    /// Queues `payload` on `subject`; `false` (and the message dropped) when the queue is
    /// full or the drainer stopped.
    pub fn try_publish(&self, subject: String, payload: Bytes) -> bool {
        let queued = self.tx.try_send((subject, payload)).is_ok();
        if !queued {
            let total = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
            let due =
                self.dropped_log.lock().unwrap_or_else(|e| e.into_inner()).note(Instant::now());
            if let Some(since) = due {
                warn!(
                    since,
                    total, "bus queue full; messages dropped (logged at most once a minute)"
                );
            }
        }
        queued
    }

    /// Messages dropped so far because the queue was full.
    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Messages the bus did not take so far (a publish failed or timed out).
    pub fn unsent(&self) -> u64 {
        self.unsent.load(Ordering::Relaxed)
    }

    /// Whether the bus is connected and the last publish went through (or none was tried
    /// yet).
    pub fn publishing(&self) -> bool {
        self.bus.connected() && !self.failing.load(Ordering::Relaxed)
    }
}
