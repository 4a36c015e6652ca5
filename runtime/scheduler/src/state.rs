//! The scheduler's view of the fleet, and selection over it.

mod admission;
mod bookings;
mod cheapest;
mod engines;
mod gather;
mod liveness;
mod member;
mod pending;
pub(crate) mod replicas;
mod select;
mod status;
mod sync;

pub use bookings::BookingId;
pub use pending::MAX_PENDING_BLOCKS;
pub use replicas::MAX_REPLICAS;
pub use select::{Ask, Outcome, Work};
pub use status::{Endings, InstanceStatus};
pub use sync::{MAX_BUFFERED_EVENTS, MAX_SNAPSHOT_PAGES, Resynced};

/// Most dp ranks a prefill registration may have (as an engine's,
/// [`crate::engine::MAX_ENGINE_DP`]): each is a slot in the index and a route, made under
/// the lock.
pub const MAX_PREFILL_DP: u32 = crate::engine::MAX_ENGINE_DP;

use std::collections::{BTreeMap, HashSet};
use std::sync::atomic::AtomicUsize;
use std::time::{Duration, Instant};

use handoff_core::InstanceId;
use handoff_discovery::{Instance, Update};
use handoff_kv_index::KvIndex;
use parking_lot::{Mutex, MutexGuard};
use tracing::{info, warn};

use crate::policy::{Candidate, PolicyKind, PolicyParams};
use member::{Member, Route};

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
    /// How often this replica tells other replicas its in-flight load when it changed (at
    /// least once a second regardless, as a keep-alive).
    pub load_share_interval: Duration,
    /// Longest queue wait a request is admitted to: prefill work queued ahead of it on the
    /// chosen (instance, dp rank) times the instance's measured cost per token. Requests that
    /// would wait longer, or not finish their prefill before their deadline, are refused at
    /// once (RESOURCE_EXHAUSTED, with when to retry).
    pub max_queue_wait: Duration,
    /// Most open bookings (requests selected and not yet reported).
    pub max_bookings: usize,
    /// How long a booking of a request without a deadline stays open unreported.
    pub booking_ttl: Duration,
    /// How long past its request's deadline a booking stays open unreported (and, at most,
    /// past its frontend's departure from discovery).
    pub booking_grace: Duration,
    /// Longest any booking stays open unreported.
    pub booking_ttl_max: Duration,
    /// The cluster's token: when set, every gRPC call must carry it as a bearer token.
    pub token: Option<String>,
    /// The cluster's mutual TLS on the gRPC listener.
    pub tls: Option<handoff_core::tls::ClusterTls>,
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

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            default_policy: PolicyKind::KvAware,
            params: PolicyParams::default(),
            max_block_hashes: 1 << 16,
            max_exclude: handoff_proto::select::MAX_EXCLUDE,
            max_index_entries: 50_000_000,
            liveness_timeout: Duration::from_secs(3),
            breaker: BreakerConfig::default(),
            load_share_interval: Duration::from_millis(25),
            max_queue_wait: Duration::from_secs(30),
            max_bookings: 1 << 18,
            booking_ttl: Duration::from_secs(120),
            booking_grace: Duration::from_secs(10),
            booking_ttl_max: Duration::from_secs(600),
            token: None,
            tls: None,
        }
    }
}

/// Index tree nodes scanned per hold of the lock while clearing (a few microseconds).
const CLEAN_NODES: usize = 512;

/// Where a request goes.
#[derive(Debug, Clone, PartialEq)]
pub struct Selection {
    /// The prefill instance.
    pub instance: Instance,
    /// Its dp rank.
    pub dp_rank: u32,
    /// Leading prompt blocks it is expected to hold.
    pub cached_blocks: u32,
    /// The lease on it: report the outcome under this id.
    pub booking: BookingId,
    /// Estimated prefill work queued ahead of the request there.
    pub expected_wait: Duration,
    /// Its own prefill there, estimated.
    pub expected_prefill: Duration,
}

#[derive(Debug, Default, Clone, Copy)]
struct Load {
    in_flight: u32,
    queued_tokens: u64,
}

#[derive(Debug)]
struct Inner {
    members: BTreeMap<InstanceId, Member>,
    index: KvIndex,
    /// What selection reads of each slot, mirrored from the members.
    routes: Vec<Route>,
    /// In-flight load, by index slot: this replica's own, and the sum of the others'.
    load: Vec<Load>,
    remote_load: Vec<Load>,
    remote: replicas::Remotes,
    /// Own load changed since the last load report.
    load_dirty: bool,
    /// Prompts routed since the last load report.
    routed: replicas::Routed,
    /// Prompts routed and not yet reported, priced as cached where they went.
    pending: pending::Pending,
    /// Open selections, each holding its load until it ends.
    bookings: bookings::Bookings,
    /// Instances whose snapshot has been asked for and not yet applied.
    resyncing: sync::Resyncs,
    /// When any instance was last heard from: while nothing is heard from anyone, the bus is
    /// presumed down and nobody is swept out of routing.
    last_beat: Option<Instant>,
    /// When anything was last heard on the bus: a heartbeat, or a load report (this
    /// replica's own, echoed, included: a fleet of engines sends no heartbeat).
    last_bus: Option<Instant>,
    bus_quiet: bool,
    /// Whether the log said prefills were registered and none ever heard (once).
    said_unheard: bool,
    /// When the last sweep ran: a gap of half the liveness timeout is this process stopped
    /// (see `sweep_at`).
    last_sweep: Option<Instant>,
    /// Reused by every selection: overlap per slot, the candidate list, and the ties.
    run: handoff_kv_index::Run,
    candidates: Vec<Candidate>,
    ties: cheapest::Ties,
    /// Engine instances registered here (kept across discovery resets).
    engines: HashSet<InstanceId>,
}

impl Inner {
    /// Registers `instance` (fresh slots and load), or refreshes it when known: a new
    /// version (a restart) or a new topology starts it over, keeping its breaker.
    fn admit(&mut self, instance: Instance, now: Instant) {
        let dp = instance.topology.dp;
        if !(1..=MAX_PREFILL_DP).contains(&dp) {
            warn!(instance = %instance.id, dp, "prefill registration ignored: not 1 to {MAX_PREFILL_DP} dp ranks");
            return;
        }
        let known = self.members.get(&instance.id);
        let same = known.is_some_and(|m| {
            m.instance.version == instance.version && m.instance.topology == instance.topology
        });
        if same {
            let id = instance.id.clone();
            let m = self.members.get_mut(&id).unwrap_or_else(|| unreachable!());
            m.instance = instance;
            m.seen = now;
            m.silent = false;
            self.sync(&id);
            return;
        }
        let breaker = known.map(|m| m.breaker);
        self.drop_member(&instance.id);
        let mut m = Member::new(instance, &mut self.index, now);
        if let Some(b) = breaker {
            m.breaker = b;
            m.breaker.restarted();
        }
        if self.load.len() < self.index.slot_capacity() {
            self.load.resize(self.index.slot_capacity(), Load::default());
            self.remote_load.resize(self.index.slot_capacity(), Load::default());
            self.routes.resize(self.index.slot_capacity(), Route::default());
        }
        let id = m.instance.id.clone();
        self.members.insert(id.clone(), m);
        self.sync(&id);
    }

    /// Mirrors a member's state into its slots' routes (after any change to it).
    fn sync(&mut self, id: &InstanceId) {
        let Some(m) = self.members.get(id) else { return };
        for (slot, route) in m.routes() {
            self.routes[slot.index()] = route;
        }
    }

    /// Forgets an instance entirely (it left); its slots are reused.
    fn drop_member(&mut self, id: &InstanceId) {
        if let Some(m) = self.members.remove(id) {
            for s in &m.slots {
                self.load[s.index()] = Load::default();
                self.routes[s.index()] = Route::default();
            }
            self.index.retire_instance(id);
            self.forget_remote_slots(&m.slots);
            self.pending.forget(&m.slots);
            self.bookings.forget_instance(id);
            self.load_dirty = true;
        }
        self.resyncing.remove(id);
    }

    /// Takes a registered instance out of routing (its heartbeats stopped), forgetting what
    /// it holds and has in flight: it is resynced from a snapshot when heard again.
    fn silence(&mut self, id: &InstanceId) {
        let Some(m) = self.members.get_mut(id) else { return };
        m.silent = true;
        m.seq = None;
        m.cleared += 1;
        m.ahead.clear();
        // Its bookings are forgotten below, a probe among them: given back.
        m.breaker.release_probe();
        // A resync in flight is over: its pages would land on a cleared instance.
        self.resyncing.remove(id);
        for s in &m.slots {
            self.load[s.index()] = Load::default();
        }
        self.pending.forget(&m.slots);
        self.bookings.forget_instance(id);
        self.load_dirty = true;
        for s in &m.slots {
            self.index.begin_clear_at(*s);
        }
        self.sync(id);
    }
}

/// The scheduler's state (see the module docs).
#[derive(Debug)]
pub struct SchedulerState {
    cfg: SchedulerConfig,
    inner: Mutex<Inner>,
    /// Bad input seen, logged once per kind.
    rejects: crate::rejects::Rejects,
    tick: AtomicUsize,
    metrics: crate::metrics::SchedulerMetrics,
}

impl SchedulerState {
    /// An empty state.
    pub fn new(cfg: SchedulerConfig) -> Self {
        let inner = Inner {
            members: BTreeMap::new(),
            index: KvIndex::new(cfg.max_index_entries),
            routes: Vec::new(),
            load: Vec::new(),
            remote_load: Vec::new(),
            remote: Default::default(),
            load_dirty: false,
            routed: Default::default(),
            pending: Default::default(),
            bookings: Default::default(),
            resyncing: Default::default(),
            last_beat: None,
            last_bus: None,
            last_sweep: None,
            bus_quiet: false,
            said_unheard: false,
            run: handoff_kv_index::Run::new(),
            candidates: Vec::new(),
            ties: cheapest::Ties::default(),
            engines: HashSet::new(),
        };
        SchedulerState {
            cfg,
            inner: Mutex::new(inner),
            rejects: Default::default(),
            tick: AtomicUsize::new(0),
            metrics: Default::default(),
        }
    }

    /// The settings.
    pub fn config(&self) -> &SchedulerConfig {
        &self.cfg
    }

    /// Its counters and histograms.
    pub fn metrics(&self) -> &crate::metrics::SchedulerMetrics {
        &self.metrics
    }

    /// Bad input seen, logged once per kind.
    pub(crate) fn rejects(&self) -> &crate::rejects::Rejects {
        &self.rejects
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Finishes the index clears begun (instances gone, silent, cleared or resyncing) a
    /// bounded step per hold of the lock, so selections wait for one step at most.
    fn settle_index(&self) {
        loop {
            let mut inner = self.lock();
            if inner.index.clean_some(CLEAN_NODES) {
                return;
            }
            // Handed to a waiting selection, not taken straight back.
            MutexGuard::unlock_fair(inner);
        }
    }

    /// Applies a discovery update.
    pub fn apply_update(&self, u: Update) {
        let mut inner = self.lock();
        let now = Instant::now();
        match u {
            Update::Reset(all) => {
                let keep: HashSet<InstanceId> = all.iter().map(|i| i.id.clone()).collect();
                let gone: Vec<_> = inner
                    .members
                    .keys()
                    .filter(|k| !keep.contains(*k) && !inner.engines.contains(*k))
                    .cloned()
                    .collect();
                for id in &gone {
                    inner.drop_member(id);
                }
                info!(instances = keep.len(), dropped = gone.len(), "prefill membership reset");
                for i in all {
                    if inner.engines.contains(&i.id) {
                        warn!(instance = %i.id, "prefill registration with an engine's id ignored");
                        continue;
                    }
                    // A reset re-lists everyone: not news from a known instance itself.
                    match inner.members.get_mut(&i.id) {
                        Some(m)
                            if m.instance.version == i.version
                                && m.instance.topology == i.topology =>
                        {
                            let id = i.id.clone();
                            m.instance = i;
                            inner.sync(&id);
                        }
                        _ => inner.admit(i, now),
                    }
                }
            }
            Update::Add(i) if inner.engines.contains(&i.id) => {
                warn!(instance = %i.id, "prefill registration with an engine's id ignored");
            }
            Update::Add(i) => {
                info!(instance = %i.id, bootstrap = %i.bootstrap_addr, "prefill instance added");
                inner.admit(i, now);
            }
            Update::Remove(id) if inner.engines.contains(&id) => {}
            Update::Remove(id) => {
                info!(instance = %id, "prefill instance removed");
                inner.drop_member(&id);
            }
        }
        drop(inner);
        self.settle_index();
    }
}

#[cfg(test)]
mod breaker_tests;
#[cfg(test)]
mod lease_tests;
#[cfg(test)]
mod replica_tests;
#[cfg(test)]
mod tests;
