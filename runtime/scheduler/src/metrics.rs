//! [`SchedulerMetrics`]: what the scheduler counts and times, and [`ops`], its `/metrics`
//! (with gauges read from the state at each scrape) and readiness.

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_core::metrics::{Counter, Family, Gauge, Histogram, LATENCY_BUCKETS, Registry, Tally};
use handoff_core::ops::Ops;
use handoff_kv_events::StreamStats;

use crate::state::Outcome;
use crate::{PolicyKind, SchedulerError, SchedulerState};

/// The scheduler's counters and histograms.
#[derive(Debug)]
pub struct SchedulerMetrics {
    registry: Arc<Registry>,
    selections: Arc<Family<Counter>>,
    select_seconds: Arc<Histogram>,
    reports: Arc<Family<Counter>>,
    pub(crate) resyncs: Arc<Counter>,
    /// Registered in discovery (readiness).
    pub(crate) registered: AtomicBool,
    /// Each followed engine stream's stats.
    engine_streams: Mutex<Vec<EngineMeter>>,
    /// The operations surface, made once.
    ops: std::sync::OnceLock<Arc<Ops>>,
}

fn policy_label(p: PolicyKind) -> &'static str {
    match p {
        PolicyKind::KvAware => "kv_aware",
        PolicyKind::RoundRobin => "round_robin",
        PolicyKind::Random => "random",
        PolicyKind::PowerOfTwo => "power_of_two",
        PolicyKind::PrefixHash => "prefix_hash",
    }
}

fn outcome_label(o: Outcome) -> &'static str {
    match o {
        Outcome::Success => "success",
        Outcome::InstanceFault => "instance_fault",
        Outcome::Overloaded => "overloaded",
        Outcome::Deadline => "deadline",
        Outcome::Cancelled => "cancelled",
        Outcome::Invalid => "invalid",
        Outcome::DecodeFault => "decode_fault",
    }
}

impl Default for SchedulerMetrics {
    fn default() -> Self {
        let r = Registry::new();
        SchedulerMetrics {
            selections: r.counters(
                "handoff_scheduler_selections_total",
                "Selections by policy and result (ok, invalid, no_instance, overloaded).",
                &["policy", "result"],
            ),
            select_seconds: r.histogram(
                "handoff_scheduler_select_seconds",
                "Time one selection took inside the scheduler.",
                LATENCY_BUCKETS,
            ),
            reports: r.counters(
                "handoff_scheduler_reports_total",
                "Bookings ended, by the outcome reported.",
                &["outcome"],
            ),
            resyncs: r.counter(
                "handoff_scheduler_resyncs_total",
                "KV index resyncs of an instance from its snapshot.",
            ),
            registry: r,
            registered: AtomicBool::new(false),
            engine_streams: Mutex::default(),
            ops: Default::default(),
        }
    }
}

impl SchedulerMetrics {
    pub(crate) fn selected(
        &self,
        policy: PolicyKind,
        result: Result<(), &SchedulerError>,
        took: Duration,
    ) {
        let result = match result {
            Ok(()) => "ok",
            Err(SchedulerError::Invalid(_)) => "invalid",
            Err(SchedulerError::NoInstance(_)) => "no_instance",
            Err(SchedulerError::Overloaded { .. }) => "overloaded",
            Err(_) => "error",
        };
        self.selections.with(&[policy_label(policy), result]).inc();
        self.select_seconds.observe_duration(took);
    }

    pub(crate) fn reported(&self, outcome: Outcome) {
        self.reports.with(&[outcome_label(outcome)]).inc();
    }

    /// The stats of engine `id`'s dp rank `dp` stream, kept current by the stream and shown
    /// at each scrape.
    pub fn engine_stream(&self, id: &handoff_core::InstanceId, dp: u32) -> Arc<Mutex<StreamStats>> {
        let meter = Arc::new(Mutex::new(StreamStats::default()));
        let mut all = self.engine_streams.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(i, d, _)| !(i == id.as_str() && *d == dp));
        all.push((id.to_string(), dp, meter.clone()));
        meter
    }

    /// Forgets engine `id`'s streams (it was removed).
    pub fn forget_engine(&self, id: &handoff_core::InstanceId) {
        let mut all = self.engine_streams.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|(i, _, _)| i != id.as_str());
    }

    /// Marks the scheduler registered in discovery (ready).
    pub fn set_registered(&self, yes: bool) {
        self.registered.store(yes, Relaxed);
    }
}

/// One engine dp rank stream's stats: (engine id, dp rank, stats kept current by the stream).
type EngineMeter = (String, u32, Arc<Mutex<StreamStats>>);

/// Gauges set from the state at each scrape.
struct Gauges {
    instances: Arc<Family<Gauge>>,
    in_flight: Arc<Family<Gauge>>,
    cached_blocks: Arc<Family<Gauge>>,
    breaker_open: Arc<Family<Gauge>>,
    endings: Arc<Family<Tally>>,
    token_cost: Arc<Family<Gauge>>,
    send_cost: Arc<Family<Gauge>>,
    bookings: Arc<Gauge>,
    bus_silent: Arc<Gauge>,
    rejects: Arc<Family<Tally>>,
    index_blocks: Arc<Gauge>,
    engine_batches: Arc<Family<Tally>>,
    engine_lag: Arc<Family<Gauge>>,
}

impl Gauges {
    fn new(r: &Registry) -> Self {
        Gauges {
            instances: r.gauges(
                "handoff_scheduler_instances",
                "Instances known, by whether requests are routed to them.",
                &["routable"],
            ),
            in_flight: r.gauges(
                "handoff_scheduler_instance_in_flight",
                "Requests booked on an instance and not yet reported.",
                &["prefill"],
            ),
            cached_blocks: r.gauges(
                "handoff_scheduler_instance_cached_blocks",
                "Blocks the index holds for an instance.",
                &["prefill"],
            ),
            breaker_open: r.gauges(
                "handoff_scheduler_instance_breaker_open",
                "1 while an instance's circuit breaker is open or half-open.",
                &["prefill"],
            ),
            endings: r.tallies(
                "handoff_scheduler_instance_bookings_ended_total",
                "An instance's bookings since it registered, by the outcome its frontends \
                 reported (expired: never reported).",
                &["prefill", "outcome"],
            ),
            token_cost: r.gauges(
                "handoff_scheduler_instance_token_cost_seconds",
                "An instance's measured prefill time per computed token.",
                &["prefill"],
            ),
            send_cost: r.gauges(
                "handoff_scheduler_instance_send_cost_seconds",
                "The time an instance's KV takes to leave after its compute, per prompt token.",
                &["prefill"],
            ),
            bookings: r.gauge("handoff_scheduler_open_bookings", "Bookings not yet reported."),
            bus_silent: r.gauge(
                "handoff_scheduler_bus_silent",
                "1 while prefills are registered and none has been heard on NATS for the \
                 liveness timeout (NATS down, or not theirs): routing on the last known state.",
            ),
            rejects: r.tallies(
                "handoff_scheduler_rejected_inputs_total",
                "Bad input dropped since start, by kind (malformed events, sequence gaps, ...).",
                &["kind"],
            ),
            index_blocks: r.gauge(
                "handoff_scheduler_index_blocks",
                "Blocks held in the KV index, over every instance and dp rank.",
            ),
            engine_batches: r.tallies(
                "handoff_scheduler_engine_event_batches_total",
                "An engine's dp rank stream since start: batches applied and replayed, messages \
                 and events refused, and rebuilds of its index entries.",
                &["engine", "dp_rank", "kind"],
            ),
            engine_lag: r.gauges(
                "handoff_scheduler_engine_event_lag_seconds",
                "Time from an engine's last batch timestamp (its clock) to its application here.",
                &["engine", "dp_rank"],
            ),
        }
    }

    fn refresh(&self, state: &SchedulerState) {
        let all = state.instances();
        for f in [&self.instances, &self.in_flight, &self.cached_blocks, &self.breaker_open] {
            f.clear();
        }
        self.endings.clear();
        self.token_cost.clear();
        self.send_cost.clear();
        let routable = all.iter().filter(|s| s.routable).count();
        self.instances.with(&["true"]).set(routable as f64);
        self.instances.with(&["false"]).set((all.len() - routable) as f64);
        // Added, not set: ids past the series' bound share `_other`, summed there.
        for s in &all {
            let id = [s.instance.id.as_str()];
            self.in_flight.with(&id).add(f64::from(s.in_flight));
            self.cached_blocks.with(&id).add(s.cached_blocks as f64);
            self.breaker_open.with(&id).add(if s.breaker_closed { 0.0 } else { 1.0 });
            self.token_cost.with(&id).add(f64::from(s.token_cost_us) / 1e6);
            self.send_cost.with(&id).add(f64::from(s.send_cost_us) / 1e6);
            let prefill = s.instance.id.as_str();
            for (outcome, n) in Outcome::ALL.iter().zip(s.endings.reported) {
                self.endings.with(&[prefill, outcome_label(*outcome)]).add(n);
            }
            self.endings.with(&[prefill, "expired"]).add(s.endings.expired);
        }
        self.bookings.set(state.open_bookings() as f64);
        let silent = state.bus_silent_at(std::time::Instant::now());
        self.bus_silent.set(if silent { 1.0 } else { 0.0 });
        self.index_blocks.set(all.iter().map(|s| s.cached_blocks as f64).sum());
        self.engine_batches.clear();
        self.engine_lag.clear();
        let streams = state.metrics().engine_streams.lock().unwrap_or_else(|e| e.into_inner());
        for (id, dp, meter) in streams.iter() {
            let st = *meter.lock().unwrap_or_else(|e| e.into_inner());
            let dp = dp.to_string();
            for (kind, n) in [
                ("applied", st.batches),
                ("replayed", st.replayed),
                ("refused", st.refused),
                ("rebuilds", st.rebuilds),
            ] {
                self.engine_batches.with(&[id, &dp, kind]).add(n);
            }
            self.engine_lag.with(&[id, &dp]).add(st.lag_secs);
        }
        for (kind, n) in state.rejects().totals() {
            self.rejects.with(&[kind]).set(n);
        }
    }
}

/// The scheduler's operations surface: metrics and readiness (registered in discovery).
pub fn ops(state: &Arc<SchedulerState>) -> Arc<Ops> {
    state.metrics().ops.get_or_init(|| Arc::new(make_ops(state, Host::Own))).clone()
}

/// [`ops`] for a replica in a frontend's process: ready while that frontend is announced
/// and not draining (`set_registered` says which), and its scrapes leave out the process's
/// traffic, which the frontend's own endpoint serves. A state has one surface: whichever
/// of the two is asked for first.
pub fn ops_in_frontend(state: &Arc<SchedulerState>) -> Arc<Ops> {
    state.metrics().ops.get_or_init(|| Arc::new(make_ops(state, Host::Frontend))).clone()
}

/// Whose process a replica runs in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Host {
    /// Its own (`handoff scheduler`, `handoff up`).
    Own,
    /// A frontend's.
    Frontend,
}

fn make_ops(state: &Arc<SchedulerState>, host: Host) -> Ops {
    let r = state.metrics().registry.clone();
    let gauges = Gauges::new(&r);
    let (a, b) = (Arc::downgrade(state), Arc::downgrade(state));
    let ops = Ops::new(r)
        .on_scrape(move || {
            if let Some(s) = a.upgrade() {
                gauges.refresh(&s);
            }
        })
        .ready_when(move || {
            let s = b.upgrade().ok_or("shutting down")?;
            match (s.metrics().registered.load(Relaxed), host) {
                (true, _) => Ok(()),
                (false, Host::Own) => Err("not registered in discovery yet".into()),
                (false, Host::Frontend) => Err("its frontend is not announced, or drains".into()),
            }
        });
    match host {
        Host::Own => ops,
        Host::Frontend => ops.without_traffic(),
    }
}

#[cfg(test)]
mod tests;
