//! The KV-aware scheduler: picks the (prefill instance, dp rank) for each request.
//!
//! - [`state`] — [`SchedulerState`]: the instances (from a discovery watch), the KV index
//!   (from KV events) and the in-flight load per (instance, dp rank); selection and outcomes.
//! - [`policy`] — the policies, one file each, chosen by [`PolicyKind`].
//! - [`service`] — the `handoff.v1.Scheduler` gRPC service and `serve(listener, shutdown)`.
//! - [`Scheduler::start`] (this file): wires a state to a registry and an event bus with
//!   owned tasks.

mod error;
pub mod policy;
pub mod service;
pub mod state;

use std::sync::Arc;

use futures::StreamExt;
use handoff_core::Tasks;
use handoff_discovery::{EventBus, KvEvent, Registry, Role, events::KV_SUBJECT_PREFIX};
use tracing::warn;

pub use error::SchedulerError;
pub use policy::PolicyKind;
pub use state::{SchedulerConfig, SchedulerState, Selection};

/// A running scheduler: its state, kept current by owned watch tasks.
#[derive(Debug, Clone)]
pub struct Scheduler {
    state: Arc<SchedulerState>,
}

impl Scheduler {
    /// Starts following `registry` (prefill instances) and `bus` (KV events) on `tasks`.
    pub async fn start(
        cfg: SchedulerConfig,
        registry: Arc<dyn Registry>,
        bus: Arc<dyn EventBus>,
        tasks: &Tasks,
    ) -> Result<Self, SchedulerError> {
        let state = Arc::new(SchedulerState::new(cfg));
        let mut updates = registry.watch(Role::Prefill).await.map_err(SchedulerError::Discovery)?;
        let mut events =
            bus.subscribe(KV_SUBJECT_PREFIX).await.map_err(SchedulerError::Discovery)?;
        let (s, t) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = t.shutdown_requested() => break,
                    u = updates.next() => match u {
                        Some(u) => s.apply_update(u),
                        None => break,
                    },
                }
            }
        });
        let (s, t) = (state.clone(), tasks.clone());
        tasks.spawn(async move {
            loop {
                tokio::select! {
                    _ = t.shutdown_requested() => break,
                    m = events.next() => match m {
                        Some(m) => match serde_json::from_slice::<KvEvent>(&m.payload) {
                            Ok(ev) => s.apply_event(ev),
                            Err(e) => warn!(subject = %m.subject, error = %e, "malformed KV event dropped"),
                        },
                        None => break,
                    },
                }
            }
        });
        Ok(Scheduler { state })
    }

    /// The state behind the service.
    pub fn state(&self) -> &Arc<SchedulerState> {
        &self.state
    }
}
