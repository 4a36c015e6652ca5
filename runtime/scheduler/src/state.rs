//! The scheduler's view of the fleet, and selection over it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use handoff_core::{BlockHash, InstanceId};
use handoff_discovery::{Heartbeat, Instance, KvEvent, KvEventKind, KvSnapshot, Update};
use handoff_kv_index::{KvIndex, WorkerKey};
use tracing::{debug, info, warn};

use crate::SchedulerError;
use crate::policy::{Candidate, PolicyKind, PolicyParams, Request};

/// Settings of a scheduler.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    /// The policy when a request names none.
    pub default_policy: PolicyKind,
    /// Policy tunables (kv_aware weights and temperature, prefix_hash load factor).
    pub params: PolicyParams,
    /// Most block hashes one request may carry.
    pub max_block_hashes: usize,
    /// Most instances one request may exclude.
    pub max_exclude: usize,
    /// Most (block, worker) pairs the index holds.
    pub max_index_entries: usize,
    /// An instance not heard from for this long (3 missed 1 s heartbeats) is out of routing
    /// and its index entries are dropped, before its lease expires.
    pub liveness_timeout: Duration,
    /// The per-instance circuit breaker.
    pub breaker: BreakerConfig,
}

/// Circuit breaker settings (defaults: SGLang's router).
#[derive(Debug, Clone, Copy)]
pub struct BreakerConfig {
    /// Consecutive prefill-side failures that open the breaker.
    pub failures: u32,
    /// Successful probes that close it again.
    pub successes: u32,
    /// How long it stays open before probes are let through (half-open).
    pub cooldown: Duration,
}

impl Default for BreakerConfig {
    fn default() -> Self {
        BreakerConfig { failures: 10, successes: 3, cooldown: Duration::from_secs(60) }
    }
}

/// One instance's breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Breaker {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { successes: u32, probing: bool },
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            default_policy: PolicyKind::KvAware,
            params: PolicyParams::default(),
            max_block_hashes: 1 << 16,
            max_exclude: 64,
            max_index_entries: 50_000_000,
            liveness_timeout: Duration::from_secs(3),
            breaker: BreakerConfig::default(),
        }
    }
}

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The prefill instance.
    pub instance: Instance,
    /// Its dp rank.
    pub dp_rank: u32,
    /// Leading prompt blocks it is expected to hold.
    pub cached_blocks: u32,
}

#[derive(Debug, Default, Clone, Copy)]
struct Load {
    in_flight: u32,
    queued_tokens: u64,
}

#[derive(Debug)]
struct Inner {
    instances: BTreeMap<InstanceId, Instance>,
    index: KvIndex,
    load: HashMap<WorkerKey, Load>,
    seqs: HashMap<InstanceId, u64>,
    /// When each instance was last heard from (registration counts).
    seen: HashMap<InstanceId, Instant>,
    /// Registered instances out of routing: heartbeats stopped.
    silent: HashSet<InstanceId>,
    /// Instances whose snapshot has been asked for and not yet applied.
    resyncing: HashSet<InstanceId>,
    /// When any instance was last heard from: while nothing is heard from anyone, the bus is
    /// presumed down and nobody is swept out of routing.
    last_beat: Option<Instant>,
    bus_quiet: bool,
    breakers: HashMap<InstanceId, Breaker>,
}

impl Inner {
    fn forget(&mut self, id: &InstanceId) {
        self.index.remove_instance(id);
        self.load.retain(|k, _| &k.instance != id);
        self.seqs.remove(id);
    }

    fn routable(&self, id: &InstanceId) -> bool {
        !self.silent.contains(id)
    }
}

/// Whether the breaker lets a request through now (turning open into half-open after the
/// cooldown; half-open lets one probe at a time).
fn admits(breakers: &mut HashMap<InstanceId, Breaker>, id: &InstanceId, probe: bool) -> bool {
    let b = breakers.entry(id.clone()).or_insert(Breaker::Closed { failures: 0 });
    match *b {
        Breaker::Closed { .. } => true,
        Breaker::Open { until } if Instant::now() >= until => {
            *b = Breaker::HalfOpen { successes: 0, probing: probe };
            true
        }
        Breaker::Open { .. } => false,
        Breaker::HalfOpen { probing, successes } => {
            if probe && !probing {
                *b = Breaker::HalfOpen { successes, probing: true };
            }
            !probing
        }
    }
}

/// The scheduler's state (see the module docs).
#[derive(Debug)]
pub struct SchedulerState {
    cfg: SchedulerConfig,
    inner: Mutex<Inner>,
    tick: AtomicUsize,
}

/// Status of one instance, for `ListInstances` and operators.
#[derive(Debug, Clone, PartialEq)]
pub struct InstanceStatus {
    /// The registration.
    pub instance: Instance,
    /// Requests in flight over all its dp ranks.
    pub in_flight: u32,
    /// Blocks indexed over all its dp ranks.
    pub cached_blocks: u64,
    /// Whether requests are routed to it.
    pub routable: bool,
}

impl SchedulerState {
    /// An empty state.
    pub fn new(cfg: SchedulerConfig) -> Self {
        let inner = Inner {
            instances: BTreeMap::new(),
            index: KvIndex::new(cfg.max_index_entries),
            load: HashMap::new(),
            seqs: HashMap::new(),
            seen: HashMap::new(),
            silent: HashSet::new(),
            resyncing: HashSet::new(),
            last_beat: None,
            bus_quiet: false,
            breakers: HashMap::new(),
        };
        SchedulerState { cfg, inner: Mutex::new(inner), tick: AtomicUsize::new(0) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Applies a discovery update.
    pub fn apply_update(&self, u: Update) {
        let mut inner = self.lock();
        match u {
            Update::Reset(all) => {
                let keep: BTreeMap<_, _> = all.into_iter().map(|i| (i.id.clone(), i)).collect();
                let gone: Vec<_> =
                    inner.instances.keys().filter(|k| !keep.contains_key(*k)).cloned().collect();
                for id in &gone {
                    inner.forget(id);
                    inner.seen.remove(id);
                    inner.silent.remove(id);
                }
                let now = Instant::now();
                for id in keep.keys() {
                    inner.seen.entry(id.clone()).or_insert(now);
                }
                info!(instances = keep.len(), dropped = gone.len(), "prefill membership reset");
                inner.instances = keep;
            }
            Update::Add(i) => {
                let restarted =
                    inner.instances.get(&i.id).is_some_and(|old| old.version != i.version);
                if restarted {
                    inner.forget(&i.id);
                }
                info!(instance = %i.id, bootstrap = %i.bootstrap_addr, "prefill instance added");
                inner.seen.insert(i.id.clone(), Instant::now());
                inner.silent.remove(&i.id);
                inner.instances.insert(i.id.clone(), i);
            }
            Update::Remove(id) => {
                info!(instance = %id, "prefill instance removed");
                inner.instances.remove(&id);
                inner.forget(&id);
                inner.seen.remove(&id);
                inner.silent.remove(&id);
            }
        }
    }

    /// Applies a heartbeat. Returns whether the instance's index must be resynced from a
    /// snapshot (first heartbeat heard, or heartbeats resumed after silence).
    pub fn heartbeat(&self, hb: &Heartbeat) -> bool {
        self.heartbeat_at(hb, Instant::now())
    }

    /// [`SchedulerState::heartbeat`] as of `now`.
    pub fn heartbeat_at(&self, hb: &Heartbeat, now: Instant) -> bool {
        let mut inner = self.lock();
        if !inner.instances.contains_key(&hb.instance) {
            return false;
        }
        inner.seen.insert(hb.instance.clone(), now);
        inner.last_beat = Some(now);
        if inner.bus_quiet {
            info!("heartbeats heard again; liveness checks resume");
            inner.bus_quiet = false;
        }
        let resumed = inner.silent.remove(&hb.instance);
        if resumed {
            info!(instance = %hb.instance, "heartbeats resumed; back in routing");
        }
        let unsynced = !inner.seqs.contains_key(&hb.instance);
        (resumed || unsynced) && inner.resyncing.insert(hb.instance.clone())
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
        // Silence from everyone at once is the bus, not the fleet: keep routing on the last
        // known state (leases still remove instances that are really gone). Someone must have
        // been heard within half the timeout: when the bus stops, the instances' last beats
        // are spread over one interval, so the first to look stale must not be swept while
        // the others' last beats still look recent.
        let quiet = inner.last_beat.is_none_or(|t| now.saturating_duration_since(t) > timeout / 2);
        if quiet {
            let long = inner.last_beat.is_some_and(|t| now.saturating_duration_since(t) > timeout);
            if long && !inner.bus_quiet {
                warn!(
                    "no heartbeat from any instance for {timeout:?}; the bus may be down; routing on the last known state"
                );
                inner.bus_quiet = true;
            }
            return Vec::new();
        }
        let stale: Vec<InstanceId> = inner
            .seen
            .iter()
            .filter(|(id, at)| {
                now.saturating_duration_since(**at) > timeout && !inner.silent.contains(*id)
            })
            .map(|(id, _)| id.clone())
            .collect();
        for id in &stale {
            warn!(instance = %id, "no heartbeat for {timeout:?}; out of routing");
            inner.forget(id);
            inner.silent.insert(id.clone());
        }
        stale
    }

    /// Replaces an instance's index entries with a snapshot of its caches.
    pub fn apply_snapshot(&self, snap: KvSnapshot) {
        let mut inner = self.lock();
        inner.resyncing.remove(&snap.instance);
        let Some(dp) = inner.instances.get(&snap.instance).map(|i| i.topology.dp) else { return };
        if inner.silent.contains(&snap.instance) {
            return;
        }
        for (dp_rank, blocks) in snap.dp_blocks.iter().enumerate().take(dp as usize) {
            let key = WorkerKey { instance: snap.instance.clone(), dp_rank: dp_rank as u32 };
            inner.index.clear(&key);
            inner.index.store(&key, blocks);
        }
        info!(instance = %snap.instance, seq = snap.seq, "KV index resynced from snapshot");
        inner.seqs.insert(snap.instance, snap.seq);
    }

    /// Forgets a resync that failed, so the next trigger asks again.
    pub fn resync_failed(&self, id: &InstanceId) {
        self.lock().resyncing.remove(id);
    }

    /// Applies a KV event from an instance. Returns whether the instance must be resynced
    /// from a snapshot (a gap in its sequence numbers, or nothing known of it yet).
    pub fn apply_event(&self, ev: KvEvent) -> bool {
        let mut inner = self.lock();
        let Some(inst) = inner.instances.get(&ev.instance) else {
            debug!(instance = %ev.instance, "KV event from an unknown instance dropped");
            return false;
        };
        if ev.dp_rank >= inst.topology.dp {
            warn!(instance = %ev.instance, dp_rank = ev.dp_rank, "KV event for a dp rank the instance does not have");
            return false;
        }
        if !inner.routable(&ev.instance) {
            return false;
        }
        let last = match inner.seqs.get(&ev.instance) {
            Some(&l) => l,
            // Nothing known yet: a first event applies as is, anything later needs a snapshot.
            None if ev.seq == 1 => 0,
            None => return inner.resyncing.insert(ev.instance.clone()),
        };
        if ev.seq <= last {
            return false; // already in a snapshot
        }
        if ev.seq != last + 1 {
            warn!(instance = %ev.instance, last, seq = ev.seq, "KV event sequence gap; resyncing");
            return inner.resyncing.insert(ev.instance.clone());
        }
        inner.seqs.insert(ev.instance.clone(), ev.seq);
        let key = WorkerKey { instance: ev.instance, dp_rank: ev.dp_rank };
        match ev.kind {
            KvEventKind::Stored { blocks } => inner.index.store(&key, &blocks),
            KvEventKind::Removed { blocks } => inner.index.remove(&key, &blocks),
            KvEventKind::Cleared => inner.index.clear(&key),
        }
        false
    }

    /// Picks where a prompt goes, and counts it in flight there.
    pub fn select(
        &self,
        hashes: &[BlockHash],
        prompt_tokens: u32,
        policy: Option<PolicyKind>,
        exclude: &[InstanceId],
    ) -> Result<Selection, SchedulerError> {
        if prompt_tokens == 0 {
            return Err(SchedulerError::Invalid("prompt_tokens must be positive".into()));
        }
        if hashes.len() > self.cfg.max_block_hashes {
            return Err(SchedulerError::Invalid(format!(
                "{} block hashes exceed the limit of {}",
                hashes.len(),
                self.cfg.max_block_hashes
            )));
        }
        if exclude.len() > self.cfg.max_exclude {
            return Err(SchedulerError::Invalid(format!(
                "at most {} exclusions",
                self.cfg.max_exclude
            )));
        }
        let policy = policy.unwrap_or(self.cfg.default_policy);
        let mut inner = self.lock();
        // Disjoint borrows: the breakers change (open -> half-open) while the rest is read.
        let Inner { instances, index, load, silent, breakers, .. } = &mut *inner;
        let overlaps = index.overlaps(hashes);
        let mut candidates = Vec::new();
        let mut page_size = 16;
        for inst in instances.values() {
            let usable = !exclude.contains(&inst.id)
                && !silent.contains(&inst.id)
                && admits(breakers, &inst.id, false);
            if !usable {
                continue;
            }
            page_size = inst.page_size as usize;
            for dp_rank in 0..inst.topology.dp {
                let key = WorkerKey { instance: inst.id.clone(), dp_rank };
                let load = load.get(&key).copied().unwrap_or_default();
                let overlap_blocks = overlaps.get(&key);
                candidates.push(Candidate {
                    key,
                    overlap_blocks,
                    queued_tokens: load.queued_tokens,
                    in_flight: load.in_flight,
                });
            }
        }
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let req = Request {
            candidates: &candidates,
            prompt_tokens: prompt_tokens as usize,
            page_size,
            hashes,
            tick,
        };
        let Some(i) = policy.pick(&req, &self.cfg.params) else {
            let why = if exclude.is_empty() {
                String::new()
            } else {
                format!(" (excluded {})", exclude.len())
            };
            return Err(SchedulerError::NoInstance(why));
        };
        let c = candidates.swap_remove(i);
        admits(&mut inner.breakers, &c.key.instance, true);
        let load = inner.load.entry(c.key.clone()).or_default();
        load.in_flight += 1;
        load.queued_tokens += u64::from(prompt_tokens);
        let instance = inner.instances[&c.key.instance].clone();
        Ok(Selection { instance, dp_rank: c.key.dp_rank, cached_blocks: c.overlap_blocks as u32 })
    }

    /// Ends a request's in-flight accounting on (instance, dp rank) and feeds the instance's
    /// circuit breaker: `Some(true)` success, `Some(false)` a prefill-side failure, `None` a
    /// failure that is not the prefill's (it does not count).
    pub fn report(
        &self,
        instance: &InstanceId,
        dp_rank: u32,
        prompt_tokens: u32,
        outcome: Option<bool>,
    ) {
        let mut inner = self.lock();
        let key = WorkerKey { instance: instance.clone(), dp_rank };
        if let Some(l) = inner.load.get_mut(&key) {
            l.in_flight = l.in_flight.saturating_sub(1);
            l.queued_tokens = l.queued_tokens.saturating_sub(u64::from(prompt_tokens));
        }
        let Some(ok) = outcome else { return };
        let cfg = self.cfg.breaker;
        let b = inner.breakers.entry(instance.clone()).or_insert(Breaker::Closed { failures: 0 });
        let next = match (*b, ok) {
            (Breaker::Closed { .. }, true) => Breaker::Closed { failures: 0 },
            (Breaker::Closed { failures }, false) if failures + 1 >= cfg.failures => {
                warn!(%instance, failures = failures + 1, "circuit breaker open");
                Breaker::Open { until: Instant::now() + cfg.cooldown }
            }
            (Breaker::Closed { failures }, false) => Breaker::Closed { failures: failures + 1 },
            (Breaker::HalfOpen { successes, .. }, true) if successes + 1 >= cfg.successes => {
                info!(%instance, "circuit breaker closed");
                Breaker::Closed { failures: 0 }
            }
            (Breaker::HalfOpen { successes, .. }, true) => {
                Breaker::HalfOpen { successes: successes + 1, probing: false }
            }
            (Breaker::HalfOpen { .. }, false) => {
                Breaker::Open { until: Instant::now() + cfg.cooldown }
            }
            (open @ Breaker::Open { .. }, _) => open,
        };
        *b = next;
    }

    /// The blocks indexed for (instance, dp rank).
    pub fn indexed_blocks(&self, instance: &InstanceId, dp_rank: u32) -> Vec<BlockHash> {
        self.lock().index.blocks(&WorkerKey { instance: instance.clone(), dp_rank })
    }

    /// Every known instance with its load and indexed blocks.
    pub fn instances(&self) -> Vec<InstanceStatus> {
        let inner = self.lock();
        inner
            .instances
            .values()
            .map(|i| {
                let keys =
                    (0..i.topology.dp).map(|dp_rank| WorkerKey { instance: i.id.clone(), dp_rank });
                let (mut in_flight, mut cached_blocks) = (0, 0);
                for k in keys {
                    in_flight += inner.load.get(&k).map_or(0, |l| l.in_flight);
                    cached_blocks += inner.index.blocks_of(&k) as u64;
                }
                InstanceStatus {
                    instance: i.clone(),
                    in_flight,
                    cached_blocks,
                    routable: inner.routable(&i.id),
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
