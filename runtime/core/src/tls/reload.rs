//! Certificate files read again while the process runs: every `--tls-reload-secs` each
//! process looks at its certificate files and takes those that changed and are usable (a
//! renewal by cert-manager or any rotation that rewrites the files). Each look is logged and
//! counted in `handoff_tls_reloads_total{certificate, outcome}` when it took or refused
//! something; a refused set is kept out until the files change again.

use std::future::Future;
use std::time::{Duration, SystemTime};

use super::expiry::{Shown, reloads};
use super::{ClusterTls, HandedTls, Reloaded, ServerTls, TlsError};

/// A process's TLS settings read from files.
#[derive(Debug, Clone)]
pub enum Reloadable {
    /// The cluster's (`--tls-cert`, `--tls-key`, `--tls-ca`).
    Cluster(ClusterTls),
    /// The public API's (`--public-tls-*`).
    Public(ServerTls),
    /// A client library's (etcd's: `--etcd-cert`, `--etcd-key`, `--etcd-ca`).
    Handed(HandedTls),
}

impl Reloadable {
    fn shown(&self) -> Shown {
        match self {
            Reloadable::Cluster(_) => Shown::Cluster,
            Reloadable::Public(_) => Shown::Public,
            Reloadable::Handed(t) => t.shown(),
        }
    }

    fn reload(&self, now: SystemTime) -> Result<Reloaded, TlsError> {
        match self {
            Reloadable::Cluster(t) => t.reload(now),
            Reloadable::Public(t) => t.reload(now),
            Reloadable::Handed(t) => t.reload(now),
        }
    }
}

/// Looks at the files of each of `held` once, at `now`: takes those changed, logs and
/// counts what it took or refused. Returns how many it took.
pub fn look(held: &[Reloadable], now: SystemTime) -> usize {
    let mut taken = 0;
    for h in held {
        let label = h.shown().label();
        match h.reload(now) {
            Ok(Reloaded::Unchanged) => {}
            Ok(Reloaded::Taken) => {
                taken += 1;
                reloads().with(&[label, "taken"]).inc();
                tracing::info!(certificate = label, "TLS certificate files changed: reloaded");
            }
            Err(e) => {
                reloads().with(&[label, "refused"]).inc();
                let what = match e {
                    TlsError::File { .. } => "TLS certificate files cannot be read",
                    _ => "TLS certificate files changed but are not usable",
                };
                tracing::warn!(certificate = label, error = %e, "{what}: the ones in use are kept");
            }
        }
    }
    taken
}

/// [`watch`] on `tasks` until they shut down (nothing to watch: nothing spawned).
pub fn watch_on(tasks: &crate::Tasks, held: Vec<Reloadable>, every: Duration) {
    if held.is_empty() {
        return;
    }
    let t = tasks.clone();
    tasks.spawn(watch(held, every, async move { t.shutdown_requested().await }));
}

/// Shows `held`'s counters at 0 (a series that first appears at 1 would hide its first
/// reload from a rate).
pub fn zeroed(held: &[Reloadable]) {
    for h in held {
        for outcome in ["taken", "refused"] {
            reloads().with(&[h.shown().label(), outcome]);
        }
    }
}

/// Counts a set of `shown` refused after it was taken (one its server would not accept).
pub fn refused_later(shown: Shown) {
    reloads().with(&[shown.label(), "refused"]).inc();
}

/// Looks at `held`'s files every `every` ([`look`]) until `stop`, its counters shown at 0
/// from the start ([`zeroed`]).
pub async fn watch(held: Vec<Reloadable>, every: Duration, stop: impl Future<Output = ()>) {
    watch_then(held, every, stop, |_| async {}).await;
}

/// [`watch`], running `then` after each look with how many sets it took (an owner that makes
/// a client with them: etcd's).
pub async fn watch_then<F, Fut>(
    held: Vec<Reloadable>,
    every: Duration,
    stop: impl Future<Output = ()>,
    mut then: F,
) where
    F: FnMut(usize) -> Fut,
    Fut: Future<Output = ()>,
{
    zeroed(&held);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stop = std::pin::pin!(stop);
    loop {
        tokio::select! {
            _ = &mut stop => return,
            _ = tick.tick() => {
                let taken = look(&held, SystemTime::now());
                tokio::select! {
                    _ = &mut stop => return,
                    _ = then(taken) => {}
                }
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
