//! [`Metrics`]: what the frontend counts and times (served at `/metrics`), and its measured
//! decode step.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use handoff_core::metrics::{
    BYTE_BUCKETS, Counter, Family, Histogram, LATENCY_BUCKETS, Level, Registry,
};
use handoff_core::ops::Ops;
use handoff_proto::v1::StageTimings;

use crate::{Cause, FrontendError};

/// The frontend's metrics, shared by the gRPC and HTTP entry points.
#[derive(Debug)]
pub(crate) struct Metrics {
    pub(crate) registry: Arc<Registry>,
    requests: Arc<Family<Counter>>,
    refusals: Arc<Family<Counter>>,
    pub(crate) tokens: Arc<Counter>,
    in_flight: Arc<Level>,
    ttft: Arc<Histogram>,
    inter_token: Arc<Histogram>,
    end_to_end: Arc<Histogram>,
    stages: Arc<Family<Histogram>>,
    attempt_failures: Arc<Family<Counter>>,
    kv_bytes: Arc<Counter>,
    kv_size: Arc<Histogram>,
    /// Moving average of one decode step, in nanoseconds (0: none measured yet).
    step_ns: AtomicU64,
}

/// How a request ended, as the `outcome` label says it.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Ending {
    /// Streamed to its end.
    Ok,
    /// Refused for overload.
    Refused,
    /// Past its deadline.
    Expired,
    /// Bad input.
    Invalid,
    /// No attempt succeeded, or the decode failed.
    Failed,
    /// The client left first.
    Cancelled,
}

impl Ending {
    fn label(self) -> &'static str {
        match self {
            Ending::Ok => "ok",
            Ending::Refused => "refused",
            Ending::Expired => "expired",
            Ending::Invalid => "invalid",
            Ending::Failed => "failed",
            Ending::Cancelled => "cancelled",
        }
    }

    /// How a request that failed before its first token ended.
    pub(crate) fn of(e: &FrontendError) -> Self {
        match e {
            FrontendError::Overloaded { .. } => Ending::Refused,
            FrontendError::Deadline(_) => Ending::Expired,
            FrontendError::Invalid(_) | FrontendError::UnknownModel(_) => Ending::Invalid,
            _ => Ending::Failed,
        }
    }
}

fn cause_label(c: Cause) -> &'static str {
    match c {
        Cause::Instance => "instance",
        Cause::Overloaded => "overloaded",
        Cause::Deadline => "deadline",
        Cause::Invalid => "invalid",
        Cause::Decode => "decode",
        Cause::Mismatch => "mismatch",
    }
}

impl Metrics {
    /// The frontend's metrics, in a registry of their own.
    pub(crate) fn new() -> Self {
        let r = Registry::new();
        Metrics {
            requests: r.counters(
                "handoff_frontend_requests_total",
                "Requests by how they ended (ok, refused, expired, invalid, failed, cancelled).",
                &["outcome"],
            ),
            refusals: r.counters(
                "handoff_frontend_refusals_total",
                "Requests refused (429), by the limit that refused them (requests, tokenizer, \
                 decode_slots, decode_memory, scheduler, prefills).",
                &["limit"],
            ),
            tokens: r.counter("handoff_frontend_generated_tokens_total", "Tokens streamed."),
            in_flight: r.level("handoff_frontend_requests_in_flight", "Requests being served."),
            ttft: r.histogram(
                "handoff_frontend_ttft_seconds",
                "Time from a request's arrival to its first token.",
                LATENCY_BUCKETS,
            ),
            inter_token: r.histogram(
                "handoff_frontend_inter_token_seconds",
                "Time between consecutive tokens of a stream.",
                LATENCY_BUCKETS,
            ),
            end_to_end: r.histogram(
                "handoff_frontend_request_seconds",
                "Time from a request's arrival to its last token.",
                LATENCY_BUCKETS,
            ),
            stages: r.histograms(
                "handoff_frontend_stage_seconds",
                "Time each stage of the request path took (select, resolve_topology, \
                 resolve_rank, register, connect, transfer, consume).",
                &["stage"],
                LATENCY_BUCKETS,
            ),
            attempt_failures: r.counters(
                "handoff_frontend_attempt_failures_total",
                "Failed prefill attempts by the stage that failed and whose fault it was.",
                &["stage", "cause"],
            ),
            kv_bytes: r.counter(
                "handoff_frontend_kv_received_bytes_total",
                "KV bytes received and verified.",
            ),
            kv_size: r.histogram(
                "handoff_frontend_kv_transfer_bytes",
                "KV bytes per request.",
                BYTE_BUCKETS,
            ),
            registry: r,
            step_ns: AtomicU64::new(0),
        }
    }

    /// Requests being served.
    pub(crate) fn in_flight(&self) -> i64 {
        self.in_flight.get()
    }

    /// A request arrived: counted in flight until its [`InFlight`] is dropped.
    pub(crate) fn arrived(self: &Arc<Self>) -> InFlight {
        self.in_flight.inc();
        InFlight(self.clone())
    }

    /// A request ended.
    pub(crate) fn ended(&self, how: Ending) {
        self.requests.with(&[how.label()]).inc();
    }

    /// A request failed with `e` before its first token: [`Metrics::ended`], and a refusal
    /// counted by the limit that refused it.
    pub(crate) fn failed(&self, e: &FrontendError) {
        self.ended(Ending::of(e));
        if let FrontendError::Overloaded { limit, .. } = e {
            self.refusals.with(&[limit.label()]).inc();
        }
    }

    pub(crate) fn first_token(&self, took: Duration) {
        self.ttft.observe_duration(took);
    }

    pub(crate) fn next_token(&self, gap: Duration) {
        self.inter_token.observe_duration(gap);
    }

    pub(crate) fn finished(&self, took: Duration) {
        self.end_to_end.observe_duration(took);
    }

    pub(crate) fn selected(&self, took: Duration) {
        self.stages.with(&["select"]).observe_duration(took);
    }

    /// An attempt's stage timings (cumulative microseconds) as the time each stage took.
    pub(crate) fn attempt_stages(&self, t: &StageTimings) {
        let marks = [
            ("resolve_topology", t.resolve_topology_us),
            ("resolve_rank", t.resolve_rank_us),
            ("register", t.register_us),
            ("connect", t.connect_us),
            ("transfer", t.verify_us),
            ("consume", t.consume_us),
        ];
        let mut last = 0u64;
        for (stage, at) in marks {
            if at == 0 {
                break;
            }
            let took = Duration::from_micros(at.saturating_sub(last));
            self.stages.with(&[stage]).observe_duration(took);
            last = at;
        }
    }

    pub(crate) fn attempt_failed(&self, e: &FrontendError) {
        if let FrontendError::Attempt { stage, cause, .. } = e {
            self.attempt_failures.with(&[stage, cause_label(*cause)]).inc();
        }
    }

    pub(crate) fn kv_received(&self, bytes: u64) {
        self.kv_bytes.add(bytes);
        self.kv_size.observe(bytes as f64);
    }

    /// Adds a decode step's duration to the moving average.
    pub(crate) fn note_step(&self, took: Duration) {
        let sample = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        let old = self.step_ns.load(Relaxed);
        let new = if old == 0 { sample } else { (old * 15 + sample) / 16 };
        self.step_ns.store(new, Relaxed);
    }

    /// Time `tokens` decode steps are expected to take.
    pub(crate) fn decode_time(&self, tokens: u32) -> Duration {
        let step = self.step_ns.load(Relaxed);
        Duration::from_nanos(step.saturating_mul(u64::from(tokens)))
    }
}

/// A request counted in flight until dropped.
#[derive(Debug)]
pub(crate) struct InFlight(Arc<Metrics>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.in_flight.dec();
    }
}

/// The frontend's [`Ops`]: its metrics plus gauges read from `fe` at each scrape, and its
/// readiness. Holds `fe` weakly (the frontend caches its ops).
pub(crate) fn ops(fe: &Arc<crate::Frontend>) -> Ops {
    let r = fe.metrics.registry.clone();
    let regions = r.gauge("handoff_frontend_receive_regions", "KV receive regions open.");
    let replicas = r.gauge("handoff_frontend_schedulers", "Scheduler replicas known.");
    let suspect =
        r.gauge("handoff_frontend_schedulers_suspect", "Scheduler replicas passed over for now.");
    let prefills = r.gauge(
        "handoff_frontend_prefills",
        "Prefill instances registered, and engines this frontend drives.",
    );
    let decoding = r.gauge("handoff_frontend_decoding", "Sequences holding a decode slot.");
    let admitted = r.gauge(
        "handoff_frontend_decode_admitted",
        "Requests admitted to the decode's slots, not ended (prefilling, waiting or decoding).",
    );
    let kv = r.gauge(
        "handoff_frontend_decode_kv_bytes",
        "Bytes of prompt KV the requests admitted to the decode's slots hold (or will).",
    );
    let (a, b) = (Arc::downgrade(fe), Arc::downgrade(fe));
    Ops::new(r)
        .on_scrape(move || {
            if let Some(fe) = a.upgrade() {
                regions.set(fe.agent().inbox().regions() as f64);
                replicas.set(fe.schedulers().addrs().len() as f64);
                suspect.set(fe.schedulers().suspects().len() as f64);
                prefills.set(fe.prefills_known() as f64);
                if let Some(slots) = &fe.decoding {
                    decoding.set(slots.decoding() as f64);
                    admitted.set(slots.admitted() as f64);
                    kv.set(slots.kv_bytes() as f64);
                }
            }
        })
        .ready_when(move || {
            let fe = b.upgrade().ok_or("shutting down")?;
            if fe.is_draining() {
                return Err("draining".into());
            }
            let (all, suspect) = (fe.schedulers().addrs(), fe.schedulers().suspects());
            if all.is_empty() {
                return Err("no scheduler replica known".into());
            }
            if all.len() == suspect.len() {
                return Err("every scheduler replica failed lately".into());
            }
            if fe.cfg.require_registered_prefill && fe.prefills_known() == 0 {
                return Err("no prefill instance registered".into());
            }
            if !fe.is_serving() {
                return Err("its API is not served yet".into());
            }
            Ok(())
        })
}
