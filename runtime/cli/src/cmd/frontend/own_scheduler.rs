//! `handoff frontend --scheduler-in-frontend`: a scheduler replica in the frontend's process,
//! the only one it asks (see `docs/architecture.md`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::bail;
use futures::StreamExt;
use handoff_core::Tasks;
use handoff_discovery::{EventBus, Registry, Role, Update};
use handoff_frontend::Frontend;
use handoff_scheduler::{Scheduler, SchedulerConfig, metrics};

use crate::args::FrontendArgs;

/// How long the replica gets to learn the prefill instances registered at start.
const LEARN_WITHIN: Duration = Duration::from_secs(30);

/// The replica, and where its operations endpoint listens.
pub(super) struct OwnScheduler {
    scheduler: Scheduler,
    /// `--scheduler-ops-listen`'s bound address.
    pub(super) ops: Option<SocketAddr>,
}

impl OwnScheduler {
    /// Starts the replica on `tasks` (following `registry` and `bus` as `handoff scheduler`
    /// does, engines registered with `handoff register-engine` too), makes it the frontend's
    /// replica, and waits until it knows every prefill instance registered now, so the
    /// frontend is not announced before its replica can route. It is not registered in
    /// discovery: no other process can call it.
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
        learn_registered(&scheduler, &*registry).await?;
        // The frontend's own `/metrics` serves the process's traffic.
        let ops = metrics::ops_beside_a_role(scheduler.state());
        let ops = crate::cmd::serve_ops(args.scheduler_ops_listen, ops, tasks).await?;
        Ok(OwnScheduler { scheduler, ops })
    }

    /// Whether its `/readyz` says ready: as the frontend is in discovery and not draining.
    pub(super) fn set_ready(&self, ready: bool) {
        self.scheduler.state().metrics().set_registered(ready);
    }
}

/// Waits until `scheduler` knows as many prefill instances as `registry` lists now.
async fn learn_registered(scheduler: &Scheduler, registry: &dyn Registry) -> anyhow::Result<()> {
    let mut watch = registry.watch(Role::Prefill).await?;
    let registered = match watch.next().await {
        Some(Update::Reset(all)) => all.len(),
        _ => 0,
    };
    let learned = async {
        while scheduler.state().instances().len() < registered {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    if tokio::time::timeout(LEARN_WITHIN, learned).await.is_err() {
        bail!(
            "the scheduler in this frontend did not learn the {registered} registered prefill instances within {LEARN_WITHIN:?}"
        );
    }
    Ok(())
}
