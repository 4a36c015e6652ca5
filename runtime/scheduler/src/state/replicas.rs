//! Several scheduler replicas routing one fleet: each builds the same index from the same KV
//! events, and they share in-flight load so they do not all pile onto the instance that
//! looks idle to each alone. A replica publishes its own load per (instance, dp rank) as
//! absolute values (a lost report is healed by the next), and adds the others' latest
//! reports to its own when it prices candidates. Each report also carries the prompts the
//! replica routed since its last one, which the others note as pending where they went, so
//! two replicas do not send the same new prefix to two cold instances. A replica not heard
//! from within the liveness timeout, while the bus is heard (a heartbeat, another replica's
//! report, or, in a fleet that sends no heartbeat, this one's own coming back), is forgotten; while nothing is heard on the bus
//! (it is down) the others' load is kept, as their requests are still queued at the
//! prefills. At most [`MAX_REPLICAS`] are tracked.

use std::collections::HashMap;
use std::time::Instant;

use handoff_core::BlockHash;
use handoff_discovery::{LoadReport, RoutedPrefix, WorkerLoad};
use handoff_kv_index::{Slot, WorkerKey};
use tracing::info;

use super::{Inner, Load, SchedulerState};
use crate::rejects::Reject;

/// Most other replicas tracked.
pub const MAX_REPLICAS: usize = 64;

/// Longest replica name accepted.
const MAX_REPLICA_NAME: usize = 64;

/// Most leading blocks of one routed prompt shared (a prefix of a prompt is a prompt).
const MAX_SHARED_PREFIX: usize = 1024;

/// Most blocks of routed prompts in one report (about 350 KiB of JSON); prompts routed
/// beyond that before the next report are not shared.
const MAX_SHARED_BLOCKS: usize = 16_384;

/// Prompts this replica routed since its last report.
#[derive(Debug, Default)]
pub(super) struct Routed {
    prefixes: Vec<RoutedPrefix>,
    blocks: usize,
}

impl Routed {
    /// Adds a prompt routed to `key`, if the next report has room for it.
    pub(super) fn push(&mut self, key: &WorkerKey, hashes: &[BlockHash]) {
        let blocks = &hashes[..hashes.len().min(MAX_SHARED_PREFIX)];
        if self.blocks + blocks.len() > MAX_SHARED_BLOCKS {
            return;
        }
        self.blocks += blocks.len();
        self.prefixes.push(RoutedPrefix {
            instance: key.instance.clone(),
            dp_rank: key.dp_rank,
            blocks: blocks.to_vec(),
        });
    }

    fn take(&mut self) -> Vec<RoutedPrefix> {
        self.blocks = 0;
        std::mem::take(&mut self.prefixes)
    }
}

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
                    t.in_flight = t.in_flight.saturating_add(l.in_flight);
                    t.queued_tokens = t.queued_tokens.saturating_add(l.queued_tokens);
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

    /// Notes another replica's routed prompts as pending where they went (unknown workers
    /// skipped; at most a report's worth).
    fn note_routed(&mut self, routed: &[RoutedPrefix]) {
        let now = Instant::now();
        let mut blocks = 0;
        for r in routed {
            let hashes = &r.blocks[..r.blocks.len().min(MAX_SHARED_PREFIX)];
            blocks += hashes.len();
            if blocks > MAX_SHARED_BLOCKS {
                return;
            }
            let key = WorkerKey { instance: r.instance.clone(), dp_rank: r.dp_rank };
            if let Some(slot) =
                self.index.slot(&key).filter(|_| self.members.contains_key(&key.instance))
            {
                self.pending.note(slot, hashes, now, super::pending::REMOTE_TTL);
            }
        }
    }

    /// Something was heard on the bus at `now`. After a quiet spell (nothing for half the
    /// liveness `timeout`, see `sweep_at`) the other replicas' reports come back with it, so
    /// each is given a full timeout from now.
    pub(super) fn bus_heard(&mut self, now: Instant, timeout: std::time::Duration) {
        if self.last_bus.is_none_or(|t| now.saturating_duration_since(t) > timeout / 2) {
            self.heard_replicas(now);
        }
        self.last_bus = Some(self.last_bus.map_or(now, |t| t.max(now)));
    }

    /// Counts every other replica as heard at `now`.
    pub(super) fn heard_replicas(&mut self, now: Instant) {
        for r in self.remote.values_mut() {
            r.seen = r.seen.max(now);
        }
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

/// Largest load report published: under a stock NATS server's 1 MiB payload limit. A larger
/// one was refused by the server, and the other replicas, hearing nothing, forgot this one
/// (at a thousand instances of dp 8, every dp rank loaded, a report is about 800 KB).
pub(crate) const MAX_REPORT_BYTES: usize = 900 << 10;

/// `report` encoded within [`MAX_REPORT_BYTES`]: whole if it fits; else without its routed
/// prompts (best effort anyway), and then with only its heaviest loads (the others read as
/// idle, which misprices the lightest entries rather than all of them). Says whether it was
/// cut.
pub(crate) fn encode_report(mut report: LoadReport) -> serde_json::Result<(Vec<u8>, bool)> {
    let whole = serde_json::to_vec(&report)?;
    if whole.len() <= MAX_REPORT_BYTES {
        return Ok((whole, false));
    }
    report.routed.clear();
    report.loads.sort_by_key(|l| std::cmp::Reverse((l.queued_tokens, l.in_flight)));
    loop {
        let bytes = serde_json::to_vec(&report)?;
        if bytes.len() <= MAX_REPORT_BYTES || report.loads.is_empty() {
            return Ok((bytes, true));
        }
        // Entries are about the same size: keep the share that fits, a little under.
        let keep = report.loads.len() * MAX_REPORT_BYTES / bytes.len() * 19 / 20;
        report.loads.truncate(keep.min(report.loads.len() - 1));
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
        Some(LoadReport { replica: me.to_owned(), loads, routed: inner.routed.take() })
    }

    /// Applies another replica's load report (this replica's own, `me`, is ignored but for
    /// saying the bus is up). Entries for unknown workers are skipped.
    pub fn apply_load_report(&self, report: LoadReport, me: &str) {
        self.apply_load_report_at(report, me, Instant::now());
    }

    /// [`SchedulerState::apply_load_report`] as of `now`.
    pub fn apply_load_report_at(&self, report: LoadReport, me: &str, now: Instant) {
        {
            // Its own report coming back says only that this replica's server is up (a
            // partial partition can leave it cut from the others): it counts when no instance
            // beats (a fleet of engines); otherwise heartbeats and the others' reports do.
            let mut inner = self.lock();
            if report.replica != me || inner.last_beat.is_none() {
                inner.bus_heard(now, self.cfg.liveness_timeout);
            }
        }
        if report.replica == me {
            return;
        }
        if report.replica.is_empty() || report.replica.len() > MAX_REPLICA_NAME {
            let name: String = report.replica.chars().take(MAX_REPLICA_NAME).collect();
            self.rejects.note(Reject::BadReplicaName, &format_args!("{name:?}"));
            return;
        }
        let mut inner = self.lock();
        if !inner.remote.contains_key(&report.replica) && inner.remote.len() >= MAX_REPLICAS {
            self.rejects.note(
                Reject::TooManyReplicas,
                &format_args!("{} (at most {MAX_REPLICAS})", report.replica),
            );
            return;
        }
        inner.note_routed(&report.routed);
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
        let old = inner.remote.insert(report.replica, Remote { seen: now, loads: loads.clone() });
        let Inner { remote_load, .. } = &mut *inner;
        for (slot, l) in old.map(|r| r.loads).unwrap_or_default() {
            if let Some(t) = remote_load.get_mut(slot.index()) {
                t.in_flight = t.in_flight.saturating_sub(l.in_flight);
                t.queued_tokens = t.queued_tokens.saturating_sub(l.queued_tokens);
            }
        }
        for (slot, l) in loads {
            if let Some(t) = remote_load.get_mut(slot.index()) {
                t.in_flight = t.in_flight.saturating_add(l.in_flight);
                t.queued_tokens = t.queued_tokens.saturating_add(l.queued_tokens);
            }
        }
    }
}

/// Other replicas' latest reports, by name.
pub(super) type Remotes = HashMap<String, Remote>;
