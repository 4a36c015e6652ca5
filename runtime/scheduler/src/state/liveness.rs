//! Liveness: heartbeats heard, and the sweep that takes silent instances out of routing
//! (and forgets silent replicas, expired bookings and pending prefixes).

use std::time::Instant;

use handoff_core::InstanceId;
use handoff_discovery::Heartbeat;
use tracing::{info, warn};

use super::{Inner, SchedulerState, sync};

/// The shortest gap between sweeps taken for this process stopped (sweeps run at least 50 ms
/// apart: under a short liveness timeout, half of it is a gap any busy moment makes).
const STOPPED_AT_LEAST: std::time::Duration = std::time::Duration::from_secs(1);

impl SchedulerState {
    /// Applies a heartbeat. Returns whether the instance's index must be resynced from a
    /// snapshot (first heartbeat heard, or heartbeats resumed after silence).
    pub fn heartbeat(&self, hb: &Heartbeat) -> bool {
        self.heartbeat_at(hb, Instant::now())
    }

    /// [`SchedulerState::heartbeat`] as of `now`.
    pub fn heartbeat_at(&self, hb: &Heartbeat, now: Instant) -> bool {
        let mut inner = self.lock();
        if !inner.members.contains_key(&hb.instance) {
            return false;
        }
        // The first beat after the bus was down (nobody heard for a whole timeout): nobody was
        // swept meanwhile, and the others' beats come as their own connections come back
        // (seconds apart), so each is given a full timeout from now, not from its last beat
        // before the outage. (A shorter lull only held the sweeps back.)
        if inner.bus_quiet {
            let Inner { members, engines, .. } = &mut *inner;
            for m in members.values_mut().filter(|m| !engines.contains(&m.instance.id)) {
                m.seen = m.seen.max(now);
            }
        }
        inner.bus_heard(now, self.cfg.liveness_timeout);
        let unbooked = inner.unbooked(&hb.instance, &hb.dp_queued_tokens);
        let Some(m) = inner.members.get_mut(&hb.instance) else { return false };
        m.seen = now;
        let resumed = std::mem::replace(&mut m.silent, false);
        let unsynced = m.seq.is_none();
        let cost = hb.prefill_ns_per_token as f32 / 1e3;
        let send = hb.send_ns_per_token as f32 / 1e3;
        let cost_changed = (cost.is_finite() && cost != m.token_cost_us)
            || (send.is_finite() && send != m.send_cost_us);
        if cost_changed {
            m.token_cost_us = cost;
            m.send_cost_us = send;
        }
        let ahead_changed = unbooked != m.ahead;
        if ahead_changed {
            m.ahead = unbooked;
        }
        let cost_changed = cost_changed || ahead_changed;
        if resumed {
            info!(instance = %hb.instance, "heartbeats resumed; back in routing");
        }
        if resumed || cost_changed {
            inner.sync(&hb.instance);
        }
        inner.last_beat = Some(now);
        if inner.bus_quiet {
            info!("heartbeats heard again; liveness checks resume");
            inner.bus_quiet = false;
        }
        (resumed || unsynced) && sync::start(&mut inner.resyncing, &hb.instance, now)
    }

    /// Whether a prefill registered for longer than the liveness timeout exists and no
    /// heartbeat has been heard for as long: NATS down, or not the server the prefills
    /// publish to (a wrong `--nats`). Routing then runs on the last known state, or with no
    /// load or cache information at all when none was ever heard.
    pub fn bus_silent_at(&self, now: Instant) -> bool {
        self.lock().bus_silent(now, self.cfg.liveness_timeout)
    }

    /// Takes instances not heard from within the liveness timeout out of routing and drops
    /// their index entries. Returns the ones taken out now.
    pub fn sweep(&self) -> Vec<InstanceId> {
        self.sweep_at(Instant::now())
    }

    /// [`SchedulerState::sweep`] as of `now`.
    pub fn sweep_at(&self, now: Instant) -> Vec<InstanceId> {
        let mut inner = self.lock();
        let timeout = self.cfg.liveness_timeout;
        // Sweeps run twelve times a timeout: a gap of half of one (a second at least) is this
        // process stopped (a paused VM, SIGSTOP, a frozen cgroup), when nothing could be
        // heard, not everyone silent. Each instance and replica gets a full timeout from now,
        // engines too (the bus's rule spares only those heard on the bus): before, every
        // engine was silenced at once on resume, its bookings and index entries forgotten.
        let last_sweep = inner.last_sweep.replace(now);
        let gap = last_sweep.map(|t| now.saturating_duration_since(t));
        if let Some(gap) = gap.filter(|&gap| gap > (timeout / 2).max(STOPPED_AT_LEAST)) {
            warn!("this scheduler did not run for {gap:?}; liveness counts from now");
            inner.heard_all(now);
        }
        inner.expire_bookings(now);
        inner.pending.expire(now);
        // Silence from everyone at once is the bus, not the fleet: keep routing on the last
        // known state (leases still remove instances that are really gone). Someone must have
        // been heard within half the timeout: when the bus stops, the instances' last beats
        // are spread over one interval, so the first to look stale must not be swept while
        // the others' last beats still look recent.
        // Engines are heard on their own streams, not the bus: they are swept either way.
        let quiet = inner.last_beat.is_none_or(|t| now.saturating_duration_since(t) > timeout / 2);
        if quiet {
            let long = inner.last_beat.is_some_and(|t| now.saturating_duration_since(t) > timeout);
            if long && !inner.bus_quiet {
                warn!(
                    "no heartbeat from any instance for {timeout:?}; the bus may be down; routing on the last known state"
                );
                inner.bus_quiet = true;
            }
        }
        // Prefills registered (in etcd) and never heard (on NATS): two servers that are not
        // one cluster's, said once. (A bus heard and then gone is said above.)
        if inner.last_beat.is_none() && !inner.said_unheard && inner.bus_silent(now, timeout) {
            warn!(
                "prefills registered for {timeout:?} and not one heartbeat heard from any: is --nats the NATS server they publish to? Routing has no load or cache information meanwhile"
            );
            inner.said_unheard = true;
        }
        // The other replicas' load reports ride the same bus: while nothing is heard on it
        // their load is kept (their requests are still queued at the prefills).
        let bus_quiet =
            inner.last_bus.is_none_or(|t| now.saturating_duration_since(t) > timeout / 2);
        if let Some(before) = now.checked_sub(timeout).filter(|_| !bus_quiet) {
            inner.expire_replicas(before);
        }
        // What an instance said is ahead of its queue is no floor once half the timeout old
        // (the bus down, or the instance silent): its own bookings price it alone.
        let old: Vec<InstanceId> = inner
            .members
            .values()
            .filter(|m| !m.ahead.is_empty() && now.saturating_duration_since(m.seen) > timeout / 2)
            .map(|m| m.instance.id.clone())
            .collect();
        for id in &old {
            if let Some(m) = inner.members.get_mut(id) {
                m.ahead.clear();
            }
            inner.sync(id);
        }
        let stale: Vec<InstanceId> = inner
            .members
            .values()
            .filter(|m| now.saturating_duration_since(m.seen) > timeout && !m.silent)
            .filter(|m| !quiet || inner.engines.contains(&m.instance.id))
            .map(|m| m.instance.id.clone())
            .collect();
        for id in &stale {
            warn!(instance = %id, "no heartbeat for {timeout:?}; out of routing");
            inner.silence(id);
        }
        drop(inner);
        self.settle_index();
        stale
    }
}

impl Inner {
    /// See [`SchedulerState::bus_silent_at`].
    fn bus_silent(&self, now: Instant, timeout: std::time::Duration) -> bool {
        let old = |t: Instant| now.saturating_duration_since(t) > timeout;
        self.last_beat.is_none_or(old)
            && self.members.values().any(|m| !self.engines.contains(&m.instance.id) && old(m.seen))
    }

    /// Counts everyone as heard at `now`: instances (engines too), replicas, and the bus.
    fn heard_all(&mut self, now: Instant) {
        for m in self.members.values_mut() {
            m.seen = m.seen.max(now);
        }
        self.heard_replicas(now);
        for t in [&mut self.last_beat, &mut self.last_bus].into_iter().flatten() {
            *t = (*t).max(now);
        }
    }

    /// Of the work `ahead` an instance says is queued on each dp rank, what no booking here
    /// or of another replica holds (a replica that died or restarted left its requests
    /// there): one figure per rank it has, none when it said none.
    fn unbooked(&self, id: &InstanceId, ahead: &[u64]) -> Vec<u64> {
        let Some(m) = self.members.get(id) else { return Vec::new() };
        let booked = |slot: &handoff_kv_index::Slot| {
            let (l, r) = (self.load[slot.index()], self.remote_load[slot.index()]);
            l.queued_tokens.saturating_add(r.queued_tokens)
        };
        ahead.iter().zip(&m.slots).map(|(a, s)| a.saturating_sub(booked(s))).collect()
    }
}
