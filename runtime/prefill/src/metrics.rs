//! [`PrefillMetrics`]: what a prefill instance counts and times, and [`ops`], its `/metrics`
//! (queue gauges read at each scrape) and readiness (registered in discovery).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use handoff_core::metrics::{BYTE_BUCKETS, Counter, Family, Histogram, LATENCY_BUCKETS, Registry};
use handoff_core::ops::Ops;

use crate::PrefillError;
use crate::service::PrefillService;

/// The instance's counters and histograms.
#[derive(Debug)]
pub struct PrefillMetrics {
    registry: Arc<Registry>,
    requests: Arc<Family<Counter>>,
    stages: Arc<Family<Histogram>>,
    kv_bytes: Arc<Counter>,
    kv_size: Arc<Histogram>,
    transfer_failures: Arc<Family<Counter>>,
    handshakes: Arc<Family<Counter>>,
    computed_tokens: Arc<Counter>,
    cached_tokens: Arc<Counter>,
    /// Registered in discovery and not draining (readiness).
    registered: AtomicBool,
}

impl Default for PrefillMetrics {
    fn default() -> Self {
        let r = Registry::new();
        PrefillMetrics {
            requests: r.counters(
                "handoff_prefill_requests_total",
                "Prefill requests by result (ok, invalid, mismatch, overloaded, draining, deadline, \
                 engine, transfer, cancelled, other).",
                &["result"],
            ),
            stages: r.histograms(
                "handoff_prefill_stage_seconds",
                "Time each stage of a prefill took (queue, compute, send).",
                &["stage"],
                LATENCY_BUCKETS,
            ),
            kv_bytes: r.counter("handoff_prefill_kv_sent_bytes_total", "KV bytes sent."),
            kv_size: r.histogram(
                "handoff_prefill_kv_transfer_bytes",
                "KV bytes sent per request.",
                BYTE_BUCKETS,
            ),
            transfer_failures: r.counters(
                "handoff_prefill_transfer_failures_total",
                "KV sends that failed, by reason.",
                &["reason"],
            ),
            handshakes: r.counters(
                "handoff_prefill_handshake_requests_total",
                "Requests by how the decode's transfer handshakes came: in the Prefill call \
                 (call) or over the ranks' transfer connections (transfer).",
                &["via"],
            ),
            computed_tokens: r
                .counter("handoff_prefill_computed_tokens_total", "Prompt tokens computed."),
            cached_tokens: r.counter(
                "handoff_prefill_cached_tokens_total",
                "Prompt tokens served from the prefix cache.",
            ),
            registry: r,
            registered: AtomicBool::new(false),
        }
    }
}

impl PrefillMetrics {
    /// A request ended with `result`.
    pub(crate) fn ended(&self, result: Result<(), &PrefillError>) {
        let label = match result {
            Ok(()) => "ok",
            Err(PrefillError::Invalid(_)) => "invalid",
            Err(PrefillError::Mismatch(_)) => "mismatch",
            Err(PrefillError::Overloaded(_)) => "overloaded",
            Err(PrefillError::Draining) => "draining",
            Err(PrefillError::QueuedPastDeadline(_)) => "queue_deadline",
            Err(PrefillError::SentPastDeadline) => "send_deadline",
            Err(PrefillError::Engine(_)) => "engine",
            Err(PrefillError::Transfer(t) | PrefillError::ReceiverUnreachable(t)) => {
                self.transfer_failures.with(&[t.kind()]).inc();
                "transfer"
            }
            Err(_) => "other",
        };
        self.requests.with(&[label]).inc();
    }

    /// A request dropped before it was answered (the decode went away).
    pub(crate) fn cancelled(&self) {
        self.requests.with(&["cancelled"]).inc();
    }

    /// A request's handshakes came in its call (`in_call`) or over the transfer connections.
    pub(crate) fn handshakes(&self, in_call: bool) {
        self.handshakes.with(&[if in_call { "call" } else { "transfer" }]).inc();
    }

    pub(crate) fn stage(&self, stage: &'static str, took: Duration) {
        self.stages.with(&[stage]).observe_duration(took);
    }

    pub(crate) fn tokens(&self, computed: usize, cached: usize) {
        self.computed_tokens.add(computed as u64);
        self.cached_tokens.add(cached as u64);
    }

    pub(crate) fn sent(&self, bytes: u64) {
        self.kv_bytes.add(bytes);
        self.kv_size.observe(bytes as f64);
    }

    /// Marks the instance in routing (registered) or out of it (draining).
    pub(crate) fn set_registered(&self, yes: bool) {
        self.registered.store(yes, Ordering::Relaxed);
    }
}

/// The instance's operations surface.
pub(crate) fn ops(svc: &PrefillService) -> Ops {
    let r = svc.metrics().registry.clone();
    let running = r.gauge("handoff_prefill_running", "Requests queued, computing or sending.");
    let queued = r.gauges(
        "handoff_prefill_queued",
        "Requests waiting for a dp rank's engine.",
        &["dp_rank"],
    );
    let queued_tokens =
        r.gauge("handoff_prefill_queued_tokens", "Prompt tokens of the requests running.");
    let cost = r.gauge(
        "handoff_prefill_token_cost_seconds",
        "Measured prefill time per computed token (what the scheduler prices it by).",
    );
    let cache = r.gauge("handoff_prefill_cache_bytes", "KV bytes held in the prefix cache.");
    let bus_lost = r.tallies(
        "handoff_prefill_bus_lost_total",
        "Heartbeats and KV events not sent on NATS: the queue full, or the bus not taking them \
         (down, or too slow).",
        &["reason"],
    );
    let publishing = r.gauge(
        "handoff_prefill_bus_publishing",
        "1 while NATS takes this instance's heartbeats and KV events; 0 after a publish failed \
         (the schedulers then stop hearing it).",
    );
    let (a, b) = (svc.clone(), svc.clone());
    Ops::new(r)
        .on_scrape(move || {
            let hb = a.heartbeat();
            running.set(a.running() as f64);
            queued_tokens.set(hb.queued_tokens as f64);
            cost.set(hb.prefill_ns_per_token as f64 / 1e9);
            cache.set(hb.kv_bytes as f64);
            for (rank, n) in a.queued().into_iter().enumerate() {
                queued.with(&[&rank.to_string()]).set(n as f64);
            }
            let bus = &a.inner.publisher;
            bus_lost.with(&["queue_full"]).set(bus.dropped());
            bus_lost.with(&["unsent"]).set(bus.unsent());
            publishing.set(if bus.publishing() { 1.0 } else { 0.0 });
        })
        .ready_when(move || {
            if b.metrics().registered.load(Ordering::Relaxed) {
                Ok(())
            } else {
                Err("not registered in discovery (starting or draining)".into())
            }
        })
}
