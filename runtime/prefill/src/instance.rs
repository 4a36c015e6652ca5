//! Starting a prefill instance.

use std::sync::Arc;

use futures::StreamExt;
use handoff_bootstrap::mapping::{self, Parallel};
use handoff_bootstrap::{Directory, DirectoryClient, DirectoryConfig, Registration, server};
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::events::{liveness_subject, snapshot_subject};
use handoff_discovery::{EventBus, Instance, Publisher, Registry, Role, SnapshotAsk, Topology};
use handoff_engine::Engine;
use handoff_transfer::FaultSwitch;
use tokio::net::TcpListener;
use tracing::{debug, info, warn};

use crate::rank::Rank;
use crate::service::{DpState, Inner, PrefillService};
use crate::{PrefillConfig, PrefillError, PrefixCache};

/// A running prefill instance.
#[derive(Clone)]
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
    service: PrefillService,
    ops: Arc<handoff_core::ops::Ops>,
}

impl std::fmt::Debug for PrefillInstance {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefillInstance")
            .field("registration", &self.registration)
            .finish_non_exhaustive()
    }
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
        let directory = Arc::new(Directory::new(DirectoryConfig {
            tls: cfg.tls.clone(),
            ..cfg.directory.clone()
        }));
        let bl = TcpListener::bind(cfg.bootstrap_bind).await.map_err(startup)?;
        let bootstrap_addr = handoff_core::net::host_port(
            &cfg.advertise_host,
            bl.local_addr().map_err(startup)?.port(),
        );
        let t = tasks.clone();
        let dir = directory.clone();
        tasks.spawn(async move {
            if let Err(e) = server::run(bl, dir, async move { t.shutdown_requested().await }).await
            {
                warn!(error = %e, "bootstrap directory stopped");
            }
        });

        let client = DirectoryClient::with_tls(cfg.directory.token.clone(), cfg.tls.as_ref());
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
        let publisher =
            Publisher::start(bus.clone(), cfg.publish_queue, cfg.publish_timeout, tasks);
        let svc = PrefillService::new(Inner {
            id: cfg.id.clone(),
            engine: engine.clone(),
            par,
            dps,
            directory: directory.clone(),
            publisher: publisher.clone(),
            seq: Default::default(),
            incarnation: handoff_discovery::events::new_incarnation(),
            cost: Default::default(),
            send_cost: Default::default(),
            snapshots: handoff_discovery::Snapshots::new(cfg.id.clone()),
            max_queue: cfg.max_queue_per_dp,
            token: cfg.inbox.token.clone(),
            handshake_timeout: cfg.handshake_timeout,
            running: Default::default(),
            draining: Default::default(),
            queued_tokens: Default::default(),
            metrics: Default::default(),
            registry: registry.clone(),
            tasks: tasks.clone(),
            storing: Arc::new(tokio::sync::Semaphore::new(crate::service::MAX_STORES)),
        });
        let service = svc.clone();
        warm_up(&service, &*engine).await?;
        let gl = TcpListener::bind(cfg.grpc_bind).await.map_err(startup)?;
        let mut grpc = handoff_proto::grpc::cluster_server();
        let grpc_addr = handoff_core::net::host_port(
            &cfg.advertise_host,
            gl.local_addr().map_err(startup)?.port(),
        );
        let tls = cfg.tls.clone();
        let t = tasks.clone();
        tasks.spawn(async move {
            let router = grpc.add_service(svc.into_server());
            let stop = t.shutdown_requested();
            let res = handoff_proto::grpc::serve_cluster(router, gl, tls.as_ref(), stop).await;
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
            engine: None,
        };
        // The id first (refused while another live process holds it, waited for while a dead
        // one's lease runs out): nothing goes on the bus under it before, neither heartbeats
        // (they would bring the old holder back into routing, or mix with a live one's) nor
        // snapshot answers (a live holder's resync would get this empty cache). Then snapshot
        // requests, so a scheduler that hears our first heartbeat can resync at once.
        registry.register(registration.clone()).await.map_err(startup)?;
        let mut asks = bus.subscribe(&snapshot_subject(&cfg.id)).await.map_err(startup)?;
        let (t, svc, b) = (tasks.clone(), service.clone(), bus.clone());
        tasks.spawn(async move {
            loop {
                let m = tokio::select! {
                    _ = t.shutdown_requested() => break,
                    m = asks.next() => match m { Some(m) => m, None => break },
                };
                let Some(reply) = m.reply else { continue };
                let Some(body) = snapshot_reply(&svc, &m.payload) else { continue };
                let sent = tokio::time::timeout(
                    std::time::Duration::from_secs(2),
                    b.publish(reply, body.into()),
                );
                match sent.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(error = %e, "KV snapshot page not sent"),
                    Err(_) => warn!("KV snapshot page not sent: the bus timed out"),
                }
            }
        });
        let (t, svc, every) = (tasks.clone(), service.clone(), cfg.heartbeat_interval);
        let subject = liveness_subject(&cfg.id);
        tasks.spawn(async move {
            let mut tick = tokio::time::interval(every);
            loop {
                tokio::select! {
                    _ = t.shutdown_requested() => break,
                    _ = tick.tick() => {}
                }
                if svc.draining() {
                    continue;
                }
                let Ok(body) = serde_json::to_vec(&svc.heartbeat()) else { continue };
                publisher.try_publish(subject.clone(), body.into());
            }
        });
        service.metrics().set_registered(true);
        let (t, id, reg) = (tasks.clone(), cfg.id.clone(), registry.clone());
        tasks.spawn(async move {
            t.shutdown_requested().await;
            if let Err(e) = reg.deregister(&id).await {
                warn!(instance = %id, error = %e, "deregistration failed");
            }
        });
        info!(instance = %cfg.id, %bootstrap_addr, %grpc_addr, dp = cfg.dp, tp = cfg.tp, pp = cfg.pp, "prefill instance ready");
        Ok(PrefillInstance {
            id: cfg.id,
            bootstrap_addr,
            grpc_addr,
            directory,
            registration,
            ops: Arc::new(crate::metrics::ops(&service)),
            service,
        })
    }

    /// What the instance's prefix caches hold (what it answers snapshot requests with).
    pub fn snapshot(&self) -> handoff_discovery::KvSnapshot {
        self.service.snapshot()
    }

    /// Its operations surface: metrics and readiness (registered and not draining).
    pub fn ops(&self) -> Arc<handoff_core::ops::Ops> {
        self.ops.clone()
    }

    /// What its next heartbeat says.
    pub fn heartbeat(&self) -> handoff_discovery::Heartbeat {
        self.service.heartbeat()
    }

    /// Requests being served (queued or computing or sending).
    pub fn running(&self) -> usize {
        self.service.running()
    }

    /// Nothing running and nothing being stored in its prefix caches: every request it took
    /// is done with, its prompt stored if it was to be. A request's store (after its KV was
    /// sent) begins before the request stops counting as [`running`](Self::running), and
    /// counts until the cache holds the prompt. A request that failed or was cancelled
    /// stores nothing, and neither does one finding `MAX_STORES` (4) stores in flight.
    pub fn idle(&self) -> bool {
        self.service.idle()
    }

    /// Handshakes that came over its ranks' transfer connections and no request has taken
    /// yet, counted by room and rank.
    pub fn pending_handshakes(&self) -> usize {
        self.service.pending_handshakes()
    }

    /// A graceful drain: out of routing first (deregistered), then waits until the requests
    /// in flight have finished (at most `grace`). Shut the instance's tasks down afterwards.
    pub async fn drain(&self, grace: std::time::Duration) -> Result<(), PrefillError> {
        self.service.drain(grace).await.map(|_| ())
    }
}

/// The answer to a snapshot request: the page asked for, or an empty reply when the
/// snapshot is gone (the scheduler starts again); `None` for a request that is not one.
fn snapshot_reply(svc: &PrefillService, payload: &[u8]) -> Option<Vec<u8>> {
    // Draining, it is no longer this id's cache: a replacement started under the same id
    // before this process stops would have the schedulers resync from this one's cache (a
    // higher sequence number, which would also hide the new one's first events as old).
    if svc.draining() {
        return None;
    }
    let ask = if payload.is_empty() {
        SnapshotAsk::default()
    } else {
        match serde_json::from_slice::<SnapshotAsk>(payload) {
            Ok(a) => a,
            Err(e) => {
                debug!(error = %e, "malformed snapshot request ignored");
                return None;
            }
        }
    };
    match svc.snapshot_page(ask) {
        Ok(page) => serde_json::to_vec(&page)
            .inspect_err(|e| warn!(error = %e, "KV snapshot page not encodable"))
            .ok(),
        Err(e) => {
            debug!(error = %e, "snapshot page not served");
            Some(Vec::new())
        }
    }
}

/// Tokens of the warm-up prefill.
const WARM_UP_TOKENS: u32 = 64;

/// Runs two prefills before the instance registers (the second measured), so the engine is
/// warm and the first heartbeat already says what a token costs (the scheduler's admission
/// prices queues with it from the first request on).
async fn warm_up(service: &PrefillService, engine: &dyn Engine) -> Result<(), PrefillError> {
    let vocab = engine.info().vocab.max(2);
    let n = WARM_UP_TOKENS.min(engine.info().max_context.saturating_sub(1) as u32).max(1);
    let tokens: Vec<u32> = (0..n).map(|i| 1 + (i * 7919) % (vocab - 1)).collect();
    // The first pass is cold (caches, lazy pools): only the second is measured.
    engine.prefill(&tokens, None, &Default::default()).await?;
    let started = tokio::time::Instant::now();
    engine.prefill(&tokens, None, &Default::default()).await?;
    let took = started.elapsed();
    service.measured_solo(tokens.len(), took);
    info!(tokens = tokens.len(), ?took, "engine warmed up");
    Ok(())
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
