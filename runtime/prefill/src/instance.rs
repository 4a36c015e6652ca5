//! Starting a prefill instance.

use std::sync::Arc;

use handoff_bootstrap::mapping::{self, Parallel};
use handoff_bootstrap::{Directory, DirectoryClient, Registration, server};
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{EventBus, Instance, Registry, Role, Topology};
use handoff_engine::Engine;
use handoff_transfer::FaultSwitch;
use tokio::net::TcpListener;
use tracing::{info, warn};

use crate::rank::Rank;
use crate::service::{DpState, Inner, PrefillService};
use crate::{PrefillConfig, PrefillError, PrefixCache};

/// A running prefill instance.
#[derive(Debug, Clone)]
pub struct PrefillInstance {
    /// Its id.
    pub id: InstanceId,
    /// host:port of its bootstrap directory.
    pub bootstrap_addr: String,
    /// host:port of its Prefill gRPC service.
    pub grpc_addr: String,
    /// Its directory.
    pub directory: Arc<Directory>,
    /// Its registration in discovery.
    pub registration: Instance,
}

fn startup(e: impl std::fmt::Display) -> PrefillError {
    PrefillError::Startup(e.to_string())
}

impl PrefillInstance {
    /// Binds the directory, the ranks and the gRPC service on `tasks`, registers every rank
    /// in the directory (over HTTP, as any rank would) and the instance in `registry`. On
    /// shutdown of `tasks` it deregisters. `faults` (tests) arms fault injection on every
    /// rank's writes.
    pub async fn start(
        cfg: PrefillConfig,
        engine: Arc<dyn Engine>,
        registry: Arc<dyn Registry>,
        bus: Arc<dyn EventBus>,
        tasks: &Tasks,
        faults: Option<Arc<FaultSwitch>>,
    ) -> Result<Self, PrefillError> {
        let info = engine.info().clone();
        let heads = info.shape.kv_heads as u32;
        if [cfg.dp, cfg.tp, cfg.pp, cfg.cp].contains(&0) {
            return Err(PrefillError::Invalid("dp, tp, pp and cp must be positive".into()));
        }
        if !mapping::tp_compatible(heads as usize, cfg.tp as usize)
            || cfg.pp as usize > info.shape.layers
        {
            return Err(PrefillError::Invalid(format!(
                "tp {} / pp {} do not fit a model of {heads} KV heads and {} layers",
                cfg.tp, cfg.pp, info.shape.layers
            )));
        }
        let directory = Arc::new(Directory::new(cfg.directory.clone()));
        let bl = TcpListener::bind(cfg.bootstrap_bind).await.map_err(startup)?;
        let bootstrap_addr =
            format!("{}:{}", cfg.advertise_host, bl.local_addr().map_err(startup)?.port());
        let t = tasks.clone();
        let dir = directory.clone();
        tasks.spawn(async move {
            if let Err(e) = server::run(bl, dir, async move { t.shutdown_requested().await }).await
            {
                warn!(error = %e, "bootstrap directory stopped");
            }
        });

        let client = DirectoryClient::new(cfg.directory.token.clone());
        let mut dps = Vec::new();
        for dp in 0..cfg.dp {
            let mut senders = Vec::new();
            for cp in 0..cfg.cp {
                for tp in 0..cfg.tp {
                    for pp in 0..cfg.pp {
                        let agent = cfg
                            .transfer
                            .start(cfg.inbox.clone(), tasks, faults.clone())
                            .await
                            .map_err(startup)?;
                        let addr = agent.addr();
                        let reg =
                            registration(&cfg, dp, cp, tp, pp, &addr.ip, addr.port, info.page_size);
                        client.register(&bootstrap_addr, &reg).await.map_err(startup)?;
                        if cp == 0 {
                            senders.push(Rank { dp, cp, tp, pp, agent });
                        }
                    }
                }
            }
            dps.push(DpState::new(
                PrefixCache::new(cfg.cache_bytes_per_dp, info.page_size),
                senders,
            ));
        }

        let par = Parallel { tp: cfg.tp as usize, pp: cfg.pp as usize, cp: cfg.cp as usize };
        let svc = PrefillService::new(Inner {
            id: cfg.id.clone(),
            engine,
            par,
            dps,
            directory: directory.clone(),
            bus,
            seq: tokio::sync::Mutex::new(0),
            max_queue: cfg.max_queue_per_dp,
            handshake_timeout: cfg.handshake_timeout,
        });
        let gl = TcpListener::bind(cfg.grpc_bind).await.map_err(startup)?;
        let grpc_addr =
            format!("{}:{}", cfg.advertise_host, gl.local_addr().map_err(startup)?.port());
        let t = tasks.clone();
        tasks.spawn(async move {
            let res = tonic::transport::Server::builder()
                .add_service(svc.into_server())
                .serve_with_incoming_shutdown(
                    handoff_core::net::nodelay_incoming(gl),
                    t.shutdown_requested(),
                )
                .await;
            if let Err(e) = res {
                warn!(error = %e, "prefill gRPC stopped");
            }
        });

        let registration = Instance {
            id: cfg.id.clone(),
            role: Role::Prefill,
            model: info.name.clone(),
            bootstrap_addr: bootstrap_addr.clone(),
            grpc_addr: grpc_addr.clone(),
            topology: Topology { dp: cfg.dp, tp: cfg.tp, pp: cfg.pp, cp: cfg.cp },
            page_size: info.page_size as u32,
            version: rand_version(),
        };
        registry.register(registration.clone()).await.map_err(startup)?;
        let (t, id) = (tasks.clone(), cfg.id.clone());
        tasks.spawn(async move {
            t.shutdown_requested().await;
            if let Err(e) = registry.deregister(&id).await {
                warn!(instance = %id, error = %e, "deregistration failed");
            }
        });
        info!(instance = %cfg.id, %bootstrap_addr, %grpc_addr, dp = cfg.dp, tp = cfg.tp, pp = cfg.pp, "prefill instance ready");
        Ok(PrefillInstance { id: cfg.id, bootstrap_addr, grpc_addr, directory, registration })
    }
}

fn rand_version() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(1, |d| d.as_nanos() as u64)
}

#[expect(clippy::too_many_arguments, reason = "one field per rank coordinate")]
fn registration(
    cfg: &PrefillConfig,
    dp: u32,
    cp: u32,
    tp: u32,
    pp: u32,
    ip: &str,
    port: u16,
    page_size: usize,
) -> Registration {
    Registration {
        attn_tp_size: cfg.tp.into(),
        attn_tp_rank: tp.into(),
        attn_cp_size: cfg.cp.into(),
        attn_cp_rank: cp.into(),
        attn_dp_size: cfg.dp.into(),
        attn_dp_rank: dp.into(),
        pp_size: cfg.pp.into(),
        pp_rank: pp.into(),
        system_dp_size: 1,
        system_dp_rank: 0,
        rank_ip: ip.to_owned(),
        rank_port: port.into(),
        page_size: page_size as i64,
        kv_cache_dtype: "auto".into(),
        // The scheduler names the dp rank of every request; decode never guesses room % dp.
        load_balance_method: Some("routed".into()),
        kv_layout: None,
        decode_allocation_policy: None,
        prefill_http_port: None,
        enable_dsa_cache_layer_split: false,
        enable_kv_cache_sharding: false,
        dsv41_spec_layout: None,
    }
}
