//! Several scheduler replicas routing one fleet: each builds the same index from the same KV
//! events, and they share in-flight load so they do not all pile onto the instance that
//! looks idle to each alone. A replica publishes its own load per (instance, dp rank) as
//! absolute values (a lost report is healed by the next), and adds the others' latest
//! reports to its own when it prices candidates. A replica not heard from within the
//! liveness timeout is forgotten, and at most [`MAX_REPLICAS`] are tracked.

use std::collections::HashMap;
use std::time::Instant;

use handoff_discovery::{LoadReport, WorkerLoad};
use handoff_kv_index::{Slot, WorkerKey};
use tracing::{info, warn};

use super::{Inner, Load, SchedulerState};

/// Most other replicas tracked.
pub const MAX_REPLICAS: usize = 64;

/// Longest replica name accepted.
const MAX_REPLICA_NAME: usize = 64;

/// Another replica's latest report, resolved to slots.
#[derive(Debug)]
pub(super) struct Remote {
    seen: Instant,
    loads: Vec<(Slot, Load)>,
}

impl Inner {
    /// Sums every other replica's load per slot again.
    fn rebuild_remote(&mut self) {
        self.remote_load.clear();
        self.remote_load.resize(self.load.len(), Load::default());
        for r in self.remote.values() {
            for (slot, l) in &r.loads {
                if let Some(t) = self.remote_load.get_mut(slot.index()) {
                    t.in_flight += l.in_flight;
                    t.queued_tokens += l.queued_tokens;
                }
            }
        }
    }

    /// Drops other replicas' load on `slots` (their instance left; the slots will be reused).
    pub(super) fn forget_remote_slots(&mut self, slots: &[Slot]) {
        for r in self.remote.values_mut() {
            r.loads.retain(|(s, _)| !slots.contains(s));
        }
        self.rebuild_remote();
    }

    /// Forgets replicas not heard from since `before`.
    pub(super) fn expire_replicas(&mut self, before: Instant) {
        let n = self.remote.len();
        self.remote.retain(|name, r| {
            let keep = r.seen >= before;
            if !keep {
                info!(replica = %name, "scheduler replica silent; its load is forgotten");
            }
            keep
        });
        if self.remote.len() != n {
            self.rebuild_remote();
        }
    }
}

impl SchedulerState {
    /// This replica's in-flight load as replica `me`, or `None` when nothing changed since
    /// the last report and `force` is false (the periodic keep-alive forces one).
    pub fn load_report(&self, me: &str, force: bool) -> Option<LoadReport> {
        let mut inner = self.lock();
        if !inner.load_dirty && !force {
            return None;
        }
        inner.load_dirty = false;
        let mut loads = Vec::new();
        for m in inner.members.values() {
            for (dp_rank, slot) in m.slots.iter().enumerate() {
                let l = inner.load[slot.index()];
                if l.in_flight > 0 || l.queued_tokens > 0 {
                    loads.push(WorkerLoad {
                        instance: m.instance.id.clone(),
                        dp_rank: dp_rank as u32,
                        in_flight: l.in_flight,
                        queued_tokens: l.queued_tokens,
                    });
                }
            }
        }
        Some(LoadReport { replica: me.to_owned(), loads })
    }

    /// Applies another replica's load report (this replica's own, `me`, is ignored).
    /// Entries for unknown workers are skipped.
    pub fn apply_load_report(&self, report: LoadReport, me: &str) {
        if report.replica == me {
            return;
        }
        if report.replica.is_empty() || report.replica.len() > MAX_REPLICA_NAME {
            warn!("load report with a bad replica name dropped");
            return;
        }
        let mut inner = self.lock();
        if !inner.remote.contains_key(&report.replica) && inner.remote.len() >= MAX_REPLICAS {
            warn!(replica = %report.replica, "too many scheduler replicas; load report dropped");
            return;
        }
        let mut loads = Vec::with_capacity(report.loads.len().min(inner.load.len()));
        for w in report.loads {
            let key = WorkerKey { instance: w.instance, dp_rank: w.dp_rank };
            let known =
                inner.index.slot(&key).filter(|_| inner.members.contains_key(&key.instance));
            if let Some(slot) = known {
                loads.push((slot, Load { in_flight: w.in_flight, queued_tokens: w.queued_tokens }));
            }
        }
        loads.sort_by_key(|(s, _)| *s);
        loads.dedup_by_key(|(s, _)| *s);
        // Swap this replica's contribution: take its last report off, put this one on.
        let old = inner
            .remote
            .insert(report.replica, Remote { seen: Instant::now(), loads: loads.clone() });
        let Inner { remote_load, .. } = &mut *inner;
        for (slot, l) in old.map(|r| r.loads).unwrap_or_default() {
            if let Some(t) = remote_load.get_mut(slot.index()) {
                t.in_flight = t.in_flight.saturating_sub(l.in_flight);
                t.queued_tokens = t.queued_tokens.saturating_sub(l.queued_tokens);
            }
        }
        for (slot, l) in loads {
            if let Some(t) = remote_load.get_mut(slot.index()) {
                t.in_flight += l.in_flight;
                t.queued_tokens += l.queued_tokens;
            }
        }
    }
}

/// Other replicas' latest reports, by name.
pub(super) type Remotes = HashMap<String, Remote>;
