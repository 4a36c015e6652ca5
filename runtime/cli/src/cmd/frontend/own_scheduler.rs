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
        learn_registered(&scheduler, &*registry, LEARN_WITHIN).await?;
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

/// Waits (at most `within`) until `scheduler` knows as many prefill instances as `registry`
/// lists now.
async fn learn_registered(
    scheduler: &Scheduler,
    registry: &dyn Registry,
    within: Duration,
) -> anyhow::Result<()> {
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
    if tokio::time::timeout(within, learned).await.is_err() {
        bail!(
            "the scheduler in this frontend did not learn the {registered} registered prefill instances within {within:?}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use handoff_discovery::{Instance, MemoryBus, MemoryRegistry, Topology};

    use super::*;

    fn prefill(id: &str) -> Instance {
        Instance {
            id: id.parse().unwrap(),
            role: Role::Prefill,
            model: "mock".into(),
            bootstrap_addr: "127.0.0.1:1".into(),
            grpc_addr: "127.0.0.1:2".into(),
            topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
            page_size: 16,
            version: 1,
            engine: None,
        }
    }

    /// The wait ends when the replica knows the registered prefills, and fails when it
    /// cannot learn them (here: it follows another, empty registry).
    #[tokio::test]
    async fn the_replica_is_waited_for_until_it_knows_the_registered_prefills() {
        let registry = Arc::new(MemoryRegistry::new());
        for id in ["p0", "p1"] {
            registry.register(prefill(id)).await.unwrap();
        }
        let tasks = Tasks::new();
        let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
        let cfg = SchedulerConfig::default();
        let knowing = Scheduler::start(cfg.clone(), registry.clone(), bus.clone(), &tasks).await;
        let knowing = knowing.unwrap();
        learn_registered(&knowing, &*registry, Duration::from_secs(10)).await.unwrap();
        assert_eq!(knowing.state().instances().len(), 2);

        let elsewhere = Arc::new(MemoryRegistry::new());
        let blind = Scheduler::start(cfg, elsewhere, bus, &tasks).await.unwrap();
        let e = learn_registered(&blind, &*registry, Duration::from_millis(50)).await;
        assert!(e.unwrap_err().to_string().contains("did not learn the 2"));
        tasks.shutdown().await;
    }
}
