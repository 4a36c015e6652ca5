//! The KV-aware scheduler: picks the (prefill instance, dp rank) for each request.
//!
//! - [`state`] — [`SchedulerState`]: the instances (from a discovery watch), the KV index
//!   (from KV events) and the in-flight load per (instance, dp rank); selection and outcomes.
//! - [`policy`] — the policies, one file each, chosen by [`PolicyKind`].
//! - [`protocol`] — how a routed instance is driven, and what a caller can drive.
//! - [`metrics`] — its counters, and `/metrics` and readiness ([`metrics::ops`]).
//! - [`service`] — the `handoff.v1.Scheduler` gRPC service and `serve(listener, shutdown)`.
//! - [`Scheduler::start`] (this file): wires a state to a registry and an event bus with
//!   owned tasks.

pub mod engine;
mod error;
pub mod http;
pub mod metrics;
pub mod policy;
pub mod protocol;
mod rejects;
pub mod service;
pub mod state;

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;
use handoff_core::InstanceId;
use handoff_core::Tasks;
use handoff_discovery::events::{
    KV_SUBJECT_PREFIX, LIVENESS_PREFIX, LOAD_PREFIX, load_subject, snapshot_subject,
};
use handoff_discovery::{
    EventBus, Heartbeat, KvEvent, KvSnapshot, LoadReport, Registry, Role, SnapshotAsk, Update,
};
use tracing::{debug, warn};

use rejects::Reject;

pub use error::{RETRY_AFTER_MS, SchedulerError};
pub use policy::PolicyKind;
pub use protocol::{Protocol, Protocols};
pub use state::{
    Ask, BookingId, BreakerConfig, MAX_BUFFERED_EVENTS, MAX_SNAPSHOT_PAGES, Outcome, Resynced,
    SchedulerConfig, SchedulerState, Selection, Work,
};

/// A running scheduler: its state, kept current by owned watch tasks.
#[derive(Debug, Clone)]
pub struct Scheduler {
    state: Arc<SchedulerState>,
    replica: Arc<str>,
}

impl Scheduler {
    /// Starts following `registry` (prefill instances), and on `bus` their KV events and
    /// heartbeats, on `tasks`. Instances whose heartbeats stop are swept out of routing;
    /// gaps in KV events, and instances first heard of, are resynced from snapshots. Other
    /// scheduler replicas on the same bus share their in-flight load with this one.
    pub async fn start(
        cfg: SchedulerConfig,
        registry: Arc<dyn Registry>,
        bus: Arc<dyn EventBus>,
        tasks: &Tasks,
    ) -> Result<Self, SchedulerError> {
        let sweep_every = cfg.liveness_timeout / 12;
        let state = Arc::new(SchedulerState::new(cfg));
        let mut updates = registry.watch(Role::Prefill).await.map_err(SchedulerError::Discovery)?;
        let mut frontends =
            registry.watch(Role::Frontend).await.map_err(SchedulerError::Discovery)?;
        let mut events =
            bus.subscribe(KV_SUBJECT_PREFIX).await.map_err(SchedulerError::Discovery)?;
        let mut beats = bus.subscribe(LIVENESS_PREFIX).await.map_err(SchedulerError::Discovery)?;
        let mut peers = bus.subscribe(LOAD_PREFIX).await.map_err(SchedulerError::Discovery)?;
        let replica: Arc<str> = format!("{:016x}", rand::random::<u64>()).into();
        let share_every = cfg_share_interval(&state);
        let load_bus = bus.clone();
        let (s, t) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u {
                        Some(u) => s.apply_update(u),
                        None => break,
                    },
                }
            }
        });
        // A frontend leaving discovery (stopped, or killed and its lease lapsed) has the
        // bookings it asked for expire soon (killed, it reports none of them); registering
        // again, it has them back.
        let (s, t) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            let mut listed = HashSet::new();
            loop {
                let u = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = frontends.next() => match u {
                        Some(u) => u,
                        None => break,
                    },
                };
                let (left, back) = frontends_changed(&mut listed, u);
                for gone in left {
                    s.frontend_left_at(&gone, std::time::Instant::now());
                }
                for again in back {
                    s.frontend_back(&again);
                }
            }
        });
        let (s, t) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            let mut sweep = tokio::time::interval(sweep_every.max(std::time::Duration::from_millis(50)));
            loop {
                let resync = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    _ = sweep.tick() => {
                        s.sweep();
                        None
                    }
                    m = events.next() => match m {
                        Some(m) => match serde_json::from_slice::<KvEvent>(&m.payload) {
                            Ok(ev) => {
                                let id = ev.instance.clone();
                                s.apply_event(ev).then_some(id)
                            }
                            Err(e) => {
                                s.rejects().note(Reject::MalformedEvent, &format_args!("{}: {e}", m.subject));
                                None
                            }
                        },
                        None => break,
                    },
                    m = beats.next() => match m {
                        Some(m) => match serde_json::from_slice::<Heartbeat>(&m.payload) {
                            Ok(hb) => s.heartbeat(&hb).then_some(hb.instance),
                            Err(e) => {
                                s.rejects().note(Reject::MalformedHeartbeat, &format_args!("{}: {e}", m.subject));
                                None
                            }
                        },
                        None => break,
                    },
                };
                if let Some(id) = resync {
                    let (s, b) = (s.clone(), bus.clone());
                    t.spawn(async move { resync_from_snapshot(&s, &*b, id).await });
                }
            }
        });
        let (s, t, b, me) = (state.clone(), tasks.clone(), load_bus, replica.clone());
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(share_every);
            let mut ticks = 0u64;
            let keepalive = (1000 / share_every.as_millis().max(1)).max(1) as u64;
            let mut said_cut = false;
            loop {
                tokio::select! {
                    _ = t.shutdown_requested() => break,
                    _ = tick.tick() => {
                        ticks += 1;
                        let Some(report) = s.load_report(&me, ticks.is_multiple_of(keepalive)) else { continue };
                        match state::replicas::encode_report(report) {
                            // Bounded: a bus client reconnecting can hold a publish without end,
                            // and with it this loop (and its shutdown).
                            Ok((p, cut)) => match tokio::time::timeout(LOAD_PUBLISH_TIMEOUT, b.publish(load_subject(&me), p.into())).await {
                                Ok(Ok(())) => {
                                    if cut && !said_cut {
                                        warn!("load report over 900 KiB: its routed prompts and lightest loads left out");
                                    }
                                    said_cut |= cut;
                                }
                                Ok(Err(e)) => warn!(error = %e, "load report not published"),
                                Err(_) => warn!("load report not published within its timeout"),
                            },
                            Err(e) => warn!(error = %e, "load report not encodable"),
                        }
                    }
                    m = peers.next() => match m {
                        Some(m) => match serde_json::from_slice::<LoadReport>(&m.payload) {
                            Ok(r) => s.apply_load_report(r, &me),
                            Err(e) => s.rejects().note(Reject::MalformedLoadReport, &format_args!("{}: {e}", m.subject)),
                        },
                        None => break,
                    },
                }
            }
        });
        Ok(Scheduler { state, replica })
    }

    /// This replica's name on the bus.
    pub fn replica(&self) -> &str {
        &self.replica
    }

    /// The state behind the service.
    pub fn state(&self) -> &Arc<SchedulerState> {
        &self.state
    }
}

/// The frontends an update of their registrations says left, and those it says are
/// (back) in (`listed` kept current): each one removed or added, and those a fresh list
/// leaves out or names anew.
fn frontends_changed(
    listed: &mut HashSet<InstanceId>,
    u: Update,
) -> (Vec<InstanceId>, Vec<InstanceId>) {
    match u {
        Update::Reset(all) => {
            let now: HashSet<InstanceId> = all.into_iter().map(|i| i.id).collect();
            let left = listed.difference(&now).cloned().collect();
            let back = now.difference(listed).cloned().collect();
            *listed = now;
            (left, back)
        }
        Update::Add(i) => match listed.insert(i.id.clone()) {
            true => (Vec::new(), vec![i.id]),
            false => (Vec::new(), Vec::new()),
        },
        Update::Remove(id) => {
            listed.remove(&id);
            (vec![id], Vec::new())
        }
    }
}

fn cfg_share_interval(state: &SchedulerState) -> std::time::Duration {
    state.config().load_share_interval.max(std::time::Duration::from_millis(1))
}

/// Times a resync starts over (events lost while its snapshot was fetched) before it is
/// left to the next trigger.
const RESYNC_RESTARTS: u32 = 3;

/// Longest wait for the bus to take a load report.
const LOAD_PUBLISH_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(1);

/// Fetches an instance's KV snapshot page by page and applies it (see [`Resynced`]).
async fn resync_from_snapshot(state: &SchedulerState, bus: &dyn EventBus, id: InstanceId) {
    // This task runs the resync just started; a later one (after this one ends, or the
    // instance leaves and comes back) has another generation and is not disturbed.
    let Some(generation) = state.resync_generation(&id) else { return };
    state.metrics().resyncs.inc();
    let (mut ask, mut restarts) = (SnapshotAsk::default(), 0);
    loop {
        let Some(page) = snapshot_page(state, bus, &id, ask).await else {
            state.resync_failed_as(&id, generation, std::time::Instant::now());
            return;
        };
        match state.apply_snapshot_as(generation, page) {
            Resynced::Next(next) => ask = next,
            Resynced::Done => return,
            Resynced::Dropped => {
                state.resync_failed_as(&id, generation, std::time::Instant::now());
                return;
            }
            Resynced::Again if restarts < RESYNC_RESTARTS => {
                restarts += 1;
                ask = SnapshotAsk::default();
            }
            Resynced::Again => {
                warn!(instance = %id, "KV resync keeps losing events; left to the next trigger");
                state.resync_failed_as(&id, generation, std::time::Instant::now());
                return;
            }
        }
    }
}

/// One page of `id`'s snapshot, or `None` (logged) when none came.
async fn snapshot_page(
    state: &SchedulerState,
    bus: &dyn EventBus,
    id: &InstanceId,
    ask: SnapshotAsk,
) -> Option<KvSnapshot> {
    let payload = serde_json::to_vec(&ask).unwrap_or_default();
    let wait = std::time::Duration::from_secs(2);
    let body = match bus.request(snapshot_subject(id), payload.into(), wait).await {
        Ok(b) => b,
        Err(e) => {
            warn!(instance = %id, error = %e, "KV snapshot page not received; will retry on the next trigger");
            return None;
        }
    };
    if body.is_empty() {
        debug!(instance = %id, snapshot = ask.snapshot, "snapshot no longer kept by the instance");
        return None;
    }
    match serde_json::from_slice::<KvSnapshot>(&body) {
        Ok(page) if &page.instance == id => Some(page),
        Ok(_) => {
            state.rejects().note(Reject::ForeignSnapshot, &format_args!("asked {id}"));
            None
        }
        Err(e) => {
            state.rejects().note(Reject::MalformedSnapshot, &format_args!("{id}: {e}"));
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use handoff_discovery::{Instance, Role, Update};

    use super::*;

    /// A fresh list (a watch connected again) says which frontends left meanwhile and which
    /// are in anew; a removal says one left, an addition that one is (back) in.
    #[test]
    fn frontends_left_or_back_by_update_or_a_fresh_list() {
        let f = |id: &str| Instance::fixture(id.parse().unwrap(), Role::Frontend);
        let id = |id: &str| id.parse::<InstanceId>().unwrap();
        let mut listed = HashSet::new();
        let (left, back) = frontends_changed(&mut listed, Update::Reset(vec![f("a"), f("b")]));
        assert_eq!((left.len(), back.len()), (0, 2));
        assert_eq!(frontends_changed(&mut listed, Update::Add(f("c"))), (vec![], vec![id("c")]));
        let again = frontends_changed(&mut listed, Update::Add(f("c")));
        assert_eq!(again, (vec![], vec![]), "a repeated addition says nothing");
        let removed = frontends_changed(&mut listed, Update::Remove(id("b")));
        assert_eq!(removed, (vec![id("b")], vec![]));
        let fresh = frontends_changed(&mut listed, Update::Reset(vec![f("c"), f("b")]));
        assert_eq!(fresh, (vec![id("a")], vec![id("b")]));
        assert_eq!(listed.len(), 2);
    }
}
