//! `handoff frontend --scheduler-in-frontend`: a scheduler replica in the frontend's process,
//! the only one it asks (see `docs/architecture.md`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use handoff_core::Tasks;
use handoff_discovery::{EventBus, Registry};
use handoff_frontend::Frontend;
use handoff_scheduler::{Scheduler, SchedulerConfig, metrics};
use tokio::net::TcpListener;

use crate::args::FrontendArgs;
use crate::cmd::learn_registered;

/// How long the replica gets to learn the prefill instances registered at start.
const LEARN_WITHIN: Duration = Duration::from_secs(30);

/// The replica, and where its operations endpoint and gRPC API listen.
pub(super) struct OwnScheduler {
    scheduler: Scheduler,
    /// `--scheduler-ops-listen`'s bound address.
    pub(super) ops: Option<SocketAddr>,
    /// `--scheduler-listen`'s bound address.
    pub(super) grpc: Option<SocketAddr>,
}

impl OwnScheduler {
    /// Starts the replica on `tasks` (following `registry` and `bus` as `handoff scheduler`
    /// does, engines registered with `handoff register-engine` too), makes it the frontend's
    /// replica, and waits until it knows every prefill instance registered now, so the
    /// frontend is not announced before its replica can route. It is not registered in
    /// discovery: other processes reach it only at `--scheduler-listen`'s address, when given.
    pub(super) async fn start(
        args: &FrontendArgs,
        frontend: &Frontend,
        registry: Arc<dyn Registry>,
        bus: Arc<dyn EventBus>,
        tasks: &Tasks,
    ) -> anyhow::Result<OwnScheduler> {
        let cfg = SchedulerConfig {
            token: args.discovery.token.clone(),
            tls: args.discovery.cluster_tls()?,
            ..args.policy.config()
        };
        let scheduler = Scheduler::start(cfg, registry.clone(), bus, tasks).await?;
        scheduler.follow_registered_engines(registry.clone(), tasks).await?;
        crate::cluster::ask_in_process(frontend, &scheduler);
        learn_registered(&scheduler, &*registry, LEARN_WITHIN).await?;
        // The frontend's own `/metrics` serves the process's traffic.
        let ops = metrics::ops_in_frontend(scheduler.state());
        let ops = crate::cmd::serve_ops(args.scheduler_ops_listen, ops, tasks).await?;
        let grpc = match args.scheduler_listen {
            Some(bind) => Some(serve_grpc(bind, &scheduler, tasks).await?),
            None => None,
        };
        Ok(OwnScheduler { scheduler, ops, grpc })
    }

    /// Whether its `/readyz` says ready: as the frontend is registered and not draining.
    pub(super) fn set_ready(&self, ready: bool) {
        self.scheduler.state().metrics().set_registered(ready);
    }
}

/// Serves `scheduler`'s gRPC API on `bind` until `tasks` shut down (for `handoff ctl`; it is
/// not registered in discovery); returns the bound address.
async fn serve_grpc(
    bind: SocketAddr,
    scheduler: &Scheduler,
    tasks: &Tasks,
) -> anyhow::Result<SocketAddr> {
    let listener = TcpListener::bind(bind).await.with_context(|| format!("listening on {bind}"))?;
    let addr = listener.local_addr()?;
    let (state, t) = (scheduler.state().clone(), tasks.clone());
    tasks.spawn(async move {
        let stop = async move { t.shutdown_requested().await };
        if let Err(e) = handoff_scheduler::service::serve(listener, state, stop).await {
            tracing::warn!(error = %e, "the in-frontend scheduler's gRPC API stopped");
        }
    });
    Ok(addr)
}

#[cfg(test)]
mod tests;
