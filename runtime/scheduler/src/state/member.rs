//! One registered prefill instance as the scheduler keeps it: its index slots (one per dp
//! rank), liveness, KV event sequence and circuit breaker. Everything selection reads per
//! candidate is here or in a slot-indexed vector, so choosing among a thousand instances is
//! a walk over plain memory.

use std::time::Instant;

use handoff_discovery::Instance;
use handoff_kv_index::{KvIndex, Slot, WorkerKey};
use tracing::{info, warn};
use xxhash_rust::xxh3::xxh3_64;

use super::BreakerConfig;
use crate::Protocol;

/// What selection reads of one slot, mirrored from its member whenever the member changes,
/// so choosing among a thousand workers walks dense vectors by slot.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Route {
    /// The slot belongs to a registered instance in routing (not silent).
    pub(super) live: bool,
    /// Its instance's breaker, summarized.
    pub(super) gate: Gate,
    /// prefix_hash ring point.
    pub(super) ring: u64,
    /// Tokens per block.
    pub(super) page_size: u32,
    /// Its instance's measured prefill cost, in microseconds per computed token (0: unknown).
    pub(super) token_cost_us: f32,
    /// Its instance's measured time for the KV after the compute, microseconds per token.
    pub(super) send_cost_us: f32,
    /// How its instance is driven.
    pub(super) protocol: Protocol,
    /// Uncached tokens ahead in its queue that no replica booked, as of its instance's last
    /// heartbeat (0: none, or not said).
    pub(super) ahead: u64,
}

/// A breaker as selection sees it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) enum Gate {
    /// Requests go through (closed, or half-open with no probe out).
    #[default]
    Pass,
    /// Open until then; after it, a request goes through as the half-open probe.
    Until(Instant),
    /// Half-open with its probe out.
    Shut,
}

impl Gate {
    /// Whether a request may go through at `now`.
    #[inline]
    pub(super) fn passes(self, now: Instant) -> bool {
        match self {
            Gate::Pass => true,
            Gate::Shut => false,
            Gate::Until(t) => now >= t,
        }
    }
}

/// One instance's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Breaker {
    Closed { failures: u32 },
    Open { until: Instant },
    HalfOpen { successes: u32, probing: bool },
}

impl Breaker {
    /// How selection sees it.
    pub(super) fn gate(&self) -> Gate {
        match *self {
            Breaker::Closed { .. } | Breaker::HalfOpen { probing: false, .. } => Gate::Pass,
            Breaker::Open { until } => Gate::Until(until),
            Breaker::HalfOpen { probing: true, .. } => Gate::Shut,
        }
    }

    /// Whether a request may go through now (turning open into half-open after the
    /// cooldown; half-open lets one probe at a time, taken when `probe`).
    pub(super) fn admits(&mut self, probe: bool) -> bool {
        match *self {
            Breaker::Closed { .. } => true,
            Breaker::Open { until } if Instant::now() >= until => {
                *self = Breaker::HalfOpen { successes: 0, probing: probe };
                true
            }
            Breaker::Open { .. } => false,
            Breaker::HalfOpen { probing, successes } => {
                if probe && !probing {
                    *self = Breaker::HalfOpen { successes, probing: true };
                }
                !probing
            }
        }
    }

    /// Closed: requests go through and nothing is being probed.
    pub(super) fn is_closed(&self) -> bool {
        matches!(self, Breaker::Closed { .. })
    }

    /// A probe ended without a verdict (cancelled, overloaded, ...): the next request probes.
    pub(super) fn release_probe(&mut self) {
        if let Breaker::HalfOpen { successes, probing: true } = *self {
            *self = Breaker::HalfOpen { successes, probing: false };
        }
    }

    /// Its instance restarted (a new version): an open breaker turns half-open at once, so
    /// the new process is probed now rather than after the old one's cooldown; a probe out
    /// was forgotten with the old process's bookings, and is given back. A crash-looping
    /// instance still gets one probe per restart, and each failed one opens it again.
    pub(super) fn restarted(&mut self) {
        *self = match *self {
            Breaker::Open { .. } => Breaker::HalfOpen { successes: 0, probing: false },
            Breaker::HalfOpen { successes, .. } => Breaker::HalfOpen { successes, probing: false },
            closed @ Breaker::Closed { .. } => closed,
        };
    }

    /// Whether it is half-open (letting probes through one at a time).
    pub(super) fn half_open(&self) -> bool {
        matches!(self, Breaker::HalfOpen { .. })
    }

    /// Feeds an outcome: success, or a prefill-side failure.
    pub(super) fn record(&mut self, ok: bool, cfg: &BreakerConfig, instance: &str) {
        *self = match (*self, ok) {
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
                warn!(%instance, "circuit breaker probe failed; open again");
                Breaker::Open { until: Instant::now() + cfg.cooldown }
            }
            (open @ Breaker::Open { .. }, _) => open,
        };
    }
}

/// A registered prefill instance (see the module docs).
#[derive(Debug)]
pub(super) struct Member {
    pub(super) instance: Instance,
    /// Index slot of each dp rank.
    pub(super) slots: Vec<Slot>,
    /// prefix_hash ring point of each dp rank.
    pub(super) ring: Vec<u64>,
    /// When it was last heard from (registration counts).
    pub(super) seen: Instant,
    /// Out of routing: its heartbeats stopped.
    pub(super) silent: bool,
    /// Last KV event applied; `None` until a snapshot or first event syncs it (or again when
    /// a gap's resync could not start: its heartbeats then ask).
    pub(super) seq: Option<u64>,
    /// The process whose numbering `seq` is in (`KvEvent::incarnation`; 0: not known, or an
    /// older version that does not say).
    pub(super) incarnation: u64,
    /// Times its index entries were cleared for silence (an engine's stream starts over).
    pub(super) cleared: u64,
    pub(super) breaker: Breaker,
    /// How its bookings ended since it registered.
    pub(super) endings: super::Endings,
    /// Prefill cost per computed token, in microseconds, as its heartbeats last said.
    pub(super) token_cost_us: f32,
    /// The KV's time after the compute per prompt token, in microseconds, as its heartbeats
    /// last said.
    pub(super) send_cost_us: f32,
    /// Uncached tokens ahead in each dp rank's queue that no replica booked, as of its last
    /// heartbeat (a replica that died or restarted left its requests there), priced with
    /// the bookings.
    pub(super) ahead: Vec<u64>,
}

impl Member {
    /// A member for `instance`, with slots registered in `index`.
    pub(super) fn new(instance: Instance, index: &mut KvIndex, now: Instant) -> Self {
        let dp = instance.topology.dp;
        let keys = (0..dp).map(|dp_rank| WorkerKey { instance: instance.id.clone(), dp_rank });
        let slots = keys.map(|k| index.register(&k)).collect();
        let ring = (0..dp).map(|d| xxh3_64(format!("{}#{d}", instance.id).as_bytes())).collect();
        Member {
            instance,
            slots,
            ring,
            seen: now,
            silent: false,
            seq: None,
            incarnation: 0,
            cleared: 0,
            endings: super::Endings::default(),
            breaker: Breaker::Closed { failures: 0 },
            token_cost_us: 0.0,
            send_cost_us: 0.0,
            ahead: Vec::new(),
        }
    }

    /// Whether requests may be routed to it.
    pub(super) fn routable(&self) -> bool {
        !self.silent
    }

    /// Its slots with what selection reads of them.
    pub(super) fn routes(&self) -> impl Iterator<Item = (Slot, Route)> + '_ {
        let (live, gate, page_size, token_cost_us) =
            (self.routable(), self.breaker.gate(), self.instance.page_size, self.token_cost_us);
        let (protocol, send_cost_us) = (Protocol::of(&self.instance), self.send_cost_us);
        self.slots.iter().zip(&self.ring).enumerate().map(move |(dp, (&s, &ring))| {
            let ahead = self.ahead.get(dp).copied().unwrap_or(0);
            (s, Route { live, gate, ring, page_size, token_cost_us, send_cost_us, protocol, ahead })
        })
    }
}
