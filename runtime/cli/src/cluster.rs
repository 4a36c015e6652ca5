//! A whole handoff cluster in one process: a scheduler, prefill instances and a frontend,
//! over in-memory discovery and real sockets (gRPC, bootstrap HTTP, tcp transfer).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use handoff_core::tls::ClusterTls;
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{EventBus, MemoryBus, MemoryRegistry, Registry};
use handoff_engine::Engine;
use handoff_frontend::schedulers::channel::in_process;
use handoff_frontend::{Frontend, FrontendConfig};
use handoff_prefill::{PrefillConfig, PrefillInstance};
use handoff_scheduler::{Scheduler, SchedulerConfig, service};
use handoff_transfer::{FaultSwitch, TransferKind};
use tokio::net::TcpListener;
use tracing::warn;

/// The name a scheduler replica in the frontend's process goes by (in place of an address).
pub const IN_PROCESS: &str = "in-process";

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterConfig {
    /// Prefill instances.
    pub prefills: usize,
    /// Scheduler replicas (at least one).
    pub schedulers: usize,
    /// The frontend asks its one scheduler replica in its own process, not over gRPC (the
    /// replica is still served on `scheduler_bind`, for `handoff ctl`).
    pub scheduler_in_frontend: bool,
    /// Their dp size.
    pub prefill_dp: u32,
    /// Their tp size.
    pub prefill_tp: u32,
    /// Their pp size.
    pub prefill_pp: u32,
    /// The frontend's decode tp size.
    pub decode_tp: u32,
    /// Transfer backend of every agent.
    pub transfer: TransferKind,
    /// Frontend gRPC listener.
    pub frontend_bind: SocketAddr,
    /// Frontend HTTP (OpenAI API) listener.
    pub http_bind: SocketAddr,
    /// Scheduler gRPC listener.
    pub scheduler_bind: SocketAddr,
    /// First prefill's bootstrap port (the i-th uses +i); 0 for ephemeral.
    pub bootstrap_port: u16,
    /// First prefill's gRPC port (the i-th uses +i); 0 for ephemeral.
    pub prefill_port: u16,
    /// Scheduler settings.
    pub scheduler: SchedulerConfig,
    /// Frontend settings (its `decode_tp` and `transfer` are taken from above).
    pub frontend: FrontendConfig,
    /// Per prefill instance, a fault switch on its ranks' writes (tests).
    pub faults: Vec<Option<Arc<FaultSwitch>>>,
    /// Shared secret for directory writes and transfer handshakes.
    pub token: Option<String>,
    /// Each prefill's prefix cache budget per dp rank, in bytes.
    pub prefill_cache_bytes: usize,
    /// The cluster's mutual TLS on gRPC and the bootstrap directories (the transfer's is
    /// part of `transfer`; the public listeners' certificate is `frontend.public_tls`).
    pub tls: Option<ClusterTls>,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        ClusterConfig {
            prefills: 2,
            schedulers: 1,
            scheduler_in_frontend: false,
            prefill_dp: 1,
            prefill_tp: 2,
            prefill_pp: 1,
            decode_tp: 1,
            transfer: TransferKind::loopback(),
            frontend_bind: ([127, 0, 0, 1], 50051).into(),
            http_bind: ([127, 0, 0, 1], 8080).into(),
            scheduler_bind: ([127, 0, 0, 1], 50052).into(),
            bootstrap_port: 8998,
            prefill_port: 50060,
            scheduler: SchedulerConfig::default(),
            frontend: FrontendConfig::default(),
            faults: Vec::new(),
            token: None,
            prefill_cache_bytes: PrefillConfig::default().cache_bytes_per_dp,
            tls: None,
        }
    }
}

impl ClusterConfig {
    /// Everything on ephemeral loopback ports (tests, benchmarks).
    pub fn ephemeral() -> Self {
        ClusterConfig {
            frontend_bind: ([127, 0, 0, 1], 0).into(),
            http_bind: ([127, 0, 0, 1], 0).into(),
            scheduler_bind: ([127, 0, 0, 1], 0).into(),
            bootstrap_port: 0,
            prefill_port: 0,
            ..Self::default()
        }
    }
}

/// One scheduler replica of a cluster, with its own tasks (stop them to take it down).
pub struct SchedulerReplica {
    /// The first scheduler replica.
    pub scheduler: Scheduler,
    /// Its gRPC address.
    pub addr: SocketAddr,
    /// Its tasks (its watches and its server).
    pub tasks: Tasks,
}

/// A running cluster.
pub struct Cluster {
    /// Every task of the cluster.
    pub tasks: Tasks,
    /// The frontend's gRPC address.
    pub frontend_addr: SocketAddr,
    /// The frontend's HTTP address.
    pub http_addr: SocketAddr,
    /// The first scheduler replica's gRPC address.
    pub scheduler_addr: SocketAddr,
    /// Every scheduler replica.
    pub schedulers: Vec<SchedulerReplica>,
    /// The prefill instances.
    pub prefills: Vec<PrefillInstance>,
    /// The frontend.
    pub frontend: Arc<Frontend>,
    /// The first scheduler replica.
    pub scheduler: Scheduler,
    /// The discovery registry.
    pub registry: Arc<dyn Registry>,
    /// The event bus.
    pub bus: Arc<dyn EventBus>,
}

/// The i-th port from `base` (0 stays 0: ephemeral); past 65535, an error.
fn port_plus(base: u16, i: usize) -> anyhow::Result<u16> {
    match base {
        0 => Ok(0),
        _ => u16::try_from(usize::from(base) + i)
            .map_err(|_| anyhow::anyhow!("port {base} + {i} is past 65535")),
    }
}

impl Cluster {
    /// Starts every part, each with an engine from `engines`, and waits until the scheduler
    /// sees every prefill instance.
    pub async fn start(
        cfg: ClusterConfig,
        engines: &dyn Fn() -> anyhow::Result<Arc<dyn Engine>>,
    ) -> anyhow::Result<Cluster> {
        let registry: Arc<dyn Registry> = Arc::new(MemoryRegistry::new());
        let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
        Self::start_with(cfg, engines, registry, bus, Tasks::new()).await
    }

    /// Like [`Cluster::start`], over the given discovery, with its tasks on `tasks`. Sets the
    /// process's allocator to keep freed memory a minute ([`crate::alloc::keep_freed_memory`]),
    /// as the binary does: tests and benches run as it does.
    pub async fn start_with(
        cfg: ClusterConfig,
        engines: &dyn Fn() -> anyhow::Result<Arc<dyn Engine>>,
        registry: Arc<dyn Registry>,
        bus: Arc<dyn EventBus>,
        tasks: Tasks,
    ) -> anyhow::Result<Cluster> {
        crate::alloc::keep_freed_memory();
        if cfg.scheduler_in_frontend && cfg.schedulers > 1 {
            bail!("a scheduler in the frontend's process is one replica, not {}", cfg.schedulers);
        }
        let mut schedulers = Vec::new();
        for i in 0..cfg.schedulers.max(1) {
            let bind =
                if i == 0 { cfg.scheduler_bind } else { (cfg.scheduler_bind.ip(), 0).into() };
            let sc = SchedulerConfig {
                token: cfg.token.clone(),
                tls: cfg.tls.clone(),
                ..cfg.scheduler.clone()
            };
            schedulers.push(start_scheduler(&sc, bind, &registry, &bus, &tasks).await?);
        }
        let scheduler_addr = schedulers[0].addr;
        let scheduler = schedulers[0].scheduler.clone();

        let mut prefills = Vec::new();
        for i in 0..cfg.prefills {
            let pc = PrefillConfig {
                id: InstanceId::try_from(format!("prefill-{i}"))?,
                dp: cfg.prefill_dp,
                tp: cfg.prefill_tp,
                pp: cfg.prefill_pp,
                bootstrap_bind: ([127, 0, 0, 1], port_plus(cfg.bootstrap_port, i)?).into(),
                grpc_bind: ([127, 0, 0, 1], port_plus(cfg.prefill_port, i)?).into(),
                transfer: cfg.transfer.clone(),
                tls: cfg.tls.clone(),
                cache_bytes_per_dp: cfg.prefill_cache_bytes,
                ..PrefillConfig::default()
            }
            .with_token(cfg.token.clone());
            let faults = cfg.faults.get(i).cloned().flatten();
            let p = PrefillInstance::start(
                pc,
                engines()?,
                registry.clone(),
                bus.clone(),
                &tasks,
                faults,
            )
            .await
            .with_context(|| format!("prefill instance {i}"))?;
            prefills.push(p);
        }

        let fc = FrontendConfig {
            decode_tp: cfg.decode_tp,
            transfer: cfg.transfer.clone(),
            transfer_token: cfg.frontend.transfer_token.clone().or(cfg.token.clone()),
            tls: cfg.tls.clone(),
            ..cfg.frontend.clone()
        };
        let addrs: Vec<String> = match cfg.scheduler_in_frontend {
            true => Vec::new(),
            false => schedulers.iter().map(|s| s.addr.to_string()).collect(),
        };
        let frontend = Frontend::new(fc, engines()?, &addrs, &tasks).await?;
        if cfg.scheduler_in_frontend {
            ask_in_process(&frontend, &scheduler);
        }
        frontend.follow(registry.clone()).await?;
        let fl = TcpListener::bind(cfg.frontend_bind)
            .await
            .with_context(|| format!("frontend on {}", cfg.frontend_bind))?;
        let frontend_addr = fl.local_addr()?;
        let (t, fe) = (tasks.clone(), frontend.clone());
        tasks.spawn(async move {
            if let Err(e) = handoff_frontend::service::serve(fl, fe, t.shutdown_requested()).await {
                warn!(error = %e, "frontend stopped");
            }
        });

        let hl = TcpListener::bind(cfg.http_bind)
            .await
            .with_context(|| format!("HTTP on {}", cfg.http_bind))?;
        let http_addr = hl.local_addr()?;
        let (t, fe) = (tasks.clone(), frontend.clone());
        tasks.spawn(async move {
            if let Err(e) =
                handoff_frontend::http::serve(hl, fe, async move { t.shutdown_requested().await })
                    .await
            {
                warn!(error = %e, "frontend HTTP stopped");
            }
        });

        let ready = async {
            while scheduler.state().instances().len() < cfg.prefills {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(10), ready).await.is_err() {
            bail!("the scheduler did not see every prefill instance within 10 s");
        }
        Ok(Cluster {
            tasks,
            frontend_addr,
            http_addr,
            scheduler_addr,
            schedulers,
            prefills,
            frontend,
            scheduler,
            registry,
            bus,
        })
    }

    /// Starts a cluster where every part shares one engine (stateless engines: mock).
    pub async fn start_shared(
        cfg: ClusterConfig,
        engine: Arc<dyn Engine>,
    ) -> anyhow::Result<Cluster> {
        Self::start(cfg, &move || Ok(engine.clone())).await
    }

    /// Starts another scheduler replica with `cfg`, serving on `bind` (the address of one
    /// stopped, to restart it there), over the cluster's discovery.
    pub async fn start_scheduler(
        &mut self,
        cfg: &SchedulerConfig,
        bind: SocketAddr,
    ) -> anyhow::Result<()> {
        let replica = start_scheduler(cfg, bind, &self.registry, &self.bus, &self.tasks).await?;
        self.schedulers.push(replica);
        Ok(())
    }

    /// Stops every part and waits for its tasks.
    pub async fn shutdown(self) {
        self.tasks.shutdown().await;
        for s in &self.schedulers {
            s.tasks.shutdown().await;
        }
    }
}

/// Makes `scheduler` a replica `frontend` asks in this process, through its service.
pub fn ask_in_process(frontend: &Frontend, scheduler: &Scheduler) {
    let service = service::SchedulerService::new(scheduler.state().clone()).into_server();
    frontend.schedulers().add_in_process(IN_PROCESS, in_process(service));
}

/// Starts one scheduler replica on its own tasks (a child of `parent`), serving on `bind`.
async fn start_scheduler(
    cfg: &SchedulerConfig,
    bind: SocketAddr,
    registry: &Arc<dyn Registry>,
    bus: &Arc<dyn EventBus>,
    parent: &Tasks,
) -> anyhow::Result<SchedulerReplica> {
    let tasks = parent.child();
    let scheduler = Scheduler::start(cfg.clone(), registry.clone(), bus.clone(), &tasks).await?;
    let sl = TcpListener::bind(bind).await.with_context(|| format!("scheduler on {bind}"))?;
    let addr = sl.local_addr()?;
    let (t, state) = (tasks.clone(), scheduler.state().clone());
    tasks.spawn(async move {
        if let Err(e) = service::serve(sl, state, t.shutdown_requested()).await {
            warn!(error = %e, "scheduler stopped");
        }
    });
    Ok(SchedulerReplica { scheduler, addr, tasks })
}

#[cfg(test)]
mod tests {
    /// The i-th port from a base: 0 stays ephemeral, past 65535 is an error (it wrapped).
    #[test]
    fn ports_past_65535_are_refused() {
        assert_eq!(super::port_plus(0, 7).unwrap(), 0);
        assert_eq!(super::port_plus(65534, 1).unwrap(), 65535);
        assert!(super::port_plus(65535, 1).unwrap_err().to_string().contains("past 65535"));
    }
}
