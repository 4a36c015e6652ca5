//! [`InstanceStatus`]: what the scheduler believes of each instance, for `ListInstances`,
//! metrics and operators.

use std::time::{Duration, Instant};

use handoff_core::{BlockHash, InstanceId};
use handoff_discovery::Instance;
use handoff_kv_index::WorkerKey;

use super::{Outcome, SchedulerState};

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
    /// Its measured prefill cost per computed token, in microseconds (0: not known yet).
    pub token_cost_us: f32,
    /// The time its KV takes after the compute, per prompt token, in microseconds.
    pub send_cost_us: f32,
    /// Whether its circuit breaker is closed (not open or half-open).
    pub breaker_closed: bool,
    /// Time since it was last heard from.
    pub silent_for: Duration,
    /// How its bookings ended since it registered.
    pub endings: Endings,
}

/// How one instance's bookings ended: each outcome its frontends reported (indexed as
/// [`Outcome::ALL`]), and those never reported (expired: their frontend died, or its
/// reports were lost).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Endings {
    /// Bookings ended by a report, by outcome.
    pub reported: [u64; Outcome::ALL.len()],
    /// Bookings that expired unreported.
    pub expired: u64,
}

impl SchedulerState {
    /// The blocks indexed for (instance, dp rank).
    pub fn indexed_blocks(&self, instance: &InstanceId, dp_rank: u32) -> Vec<BlockHash> {
        self.lock().index.blocks(&WorkerKey { instance: instance.clone(), dp_rank })
    }

    /// Every known instance with its load and indexed blocks.
    pub fn instances(&self) -> Vec<InstanceStatus> {
        self.instances_at(Instant::now())
    }

    /// [`SchedulerState::instances`] as of `now`.
    pub fn instances_at(&self, now: Instant) -> Vec<InstanceStatus> {
        let inner = self.lock();
        inner
            .members
            .values()
            .map(|m| {
                let (mut in_flight, mut cached_blocks) = (0, 0);
                for s in &m.slots {
                    in_flight += inner.load[s.index()].in_flight;
                    cached_blocks += inner.index.held_at(*s) as u64;
                }
                InstanceStatus {
                    instance: m.instance.clone(),
                    in_flight,
                    cached_blocks,
                    routable: m.routable(),
                    token_cost_us: m.token_cost_us,
                    send_cost_us: m.send_cost_us,
                    breaker_closed: m.breaker.is_closed(),
                    silent_for: now.saturating_duration_since(m.seen),
                    endings: m.endings,
                }
            })
            .collect()
    }
}
