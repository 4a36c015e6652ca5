//! `handoff frontend`: the decode frontend as its own process.

use std::time::Duration;

use anyhow::Context;
use handoff_core::net::host_port;
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{Instance, Role, Topology};
use handoff_frontend::{Frontend, FrontendConfig};
use tokio::net::TcpListener;

use crate::args::FrontendArgs;
use crate::cmd::{discovery, up::engines};
use crate::stop::Stop;

mod own_scheduler;

use own_scheduler::OwnScheduler;

/// Waits until at least one scheduler replica is registered in discovery, for as long as it
/// takes (a cluster started at once: the scheduler may come up last), saying so every 30 s.
async fn await_scheduler(fe: &Frontend) {
    let since = tokio::time::Instant::now();
    let mut said = since;
    while fe.schedulers().addrs().is_empty() {
        if said.elapsed() >= Duration::from_secs(30) {
            tracing::warn!(
                waited_secs = since.elapsed().as_secs(),
                "no scheduler registered in etcd yet (or etcd not reached); waiting (or pass --scheduler)"
            );
            said = tokio::time::Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Runs until Ctrl-C or SIGTERM, then drains (a second one ends the drain). Told to stop
/// while starting, stops there.
pub async fn run(args: FrontendArgs, mut stop: Stop) -> anyhow::Result<()> {
    args.check_own_scheduler()?;
    crate::cmd::check_exposure(&args.discovery, &args.listeners())?;
    crate::cmd::check_advertised("--advertise-host", &args.advertise_host)?;
    if let Some(t) = &args.discovery.transfer_advertise {
        crate::cmd::check_advertised("--transfer-advertise", t)?;
    }
    if args.drive_vllm {
        crate::args::nixl_environment("--drive-vllm")?;
    }
    let tasks = Tasks::new();
    let Some(started) = stop.starting(&tasks, start(&args, &tasks)).await? else {
        return Ok(());
    };
    let Started { frontend, registry, own_scheduler, grpc, http, id } = started;
    args.discovery.watch_tls(Some(&args.public_tls), &tasks);
    let (t1, t2) = (tasks.clone(), tasks.clone());
    let fe = frontend.clone();
    tasks.spawn(async move {
        if let Err(e) =
            handoff_frontend::http::serve(http, fe, async move { t1.shutdown_requested().await })
                .await
        {
            tracing::warn!(error = %e, "HTTP stopped");
        }
    });
    // A drain tells gRPC clients to go (GOAWAY) at once; their streams go on until shutdown.
    let serving = handoff_frontend::service::serve(grpc, frontend.clone(), async move {
        t2.shutdown_requested().await
    });
    tokio::pin!(serving);
    let told = tokio::select! {
        r = &mut serving => {
            let _ = registry.deregister(&id).await;
            tasks.shutdown().await;
            return Ok(r?);
        }
        told = stop.wait() => told,
    };
    // Drain: not ready at once; clients told to go (gRPC's GOAWAY, an HTTP/1 connection
    // closed after its answer); streams in flight finish, for at most --drain-secs. Out of
    // discovery at its end: the scheduler replicas cut short the bookings of a frontend
    // that leaves, and those in flight are still being prefilled.
    frontend.start_draining();
    if let Some(own) = &own_scheduler {
        own.set_ready(false);
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(args.drain_secs);
    let drained = async {
        while frontend.in_flight() > 0 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The gRPC server ends once its connections have (told to go, they close): the HTTP
    // API's streams may still be in flight.
    tokio::pin!(drained);
    let mut served = None;
    loop {
        tokio::select! {
            r = &mut serving, if served.is_none() => served = Some(r),
            _ = &mut drained => break,
            _ = stop.again(told) => {
                tracing::warn!("told to stop again: ending the drain");
                break;
            }
        }
    }
    tracing::info!(left = frontend.in_flight(), "frontend drained");
    let _ = registry.deregister(&id).await;
    // The listeners stop and hand out what their streams still hold (cut after their grace).
    match served {
        Some(r) => {
            tasks.shutdown().await;
            r?;
        }
        None => {
            let (_, r) = tokio::join!(tasks.shutdown(), &mut serving);
            r?;
        }
    }
    Ok(())
}

/// A frontend started: registered, its listeners bound.
struct Started {
    frontend: std::sync::Arc<Frontend>,
    registry: std::sync::Arc<dyn handoff_discovery::Registry>,
    own_scheduler: Option<OwnScheduler>,
    grpc: TcpListener,
    http: TcpListener,
    id: InstanceId,
}

/// Starts the frontend (a scheduler to ask found), binds its listeners and registers it.
async fn start(args: &FrontendArgs, tasks: &Tasks) -> anyhow::Result<Started> {
    let (registry, bus) = discovery(&args.discovery, tasks).await?;
    let cfg = FrontendConfig {
        decode_tp: args.decode_tp,
        transfer_token: args.discovery.token.clone(),
        transfer: args.discovery.network_transfer()?,
        tls: args.discovery.cluster_tls()?,
        public_tls: args.public_tls.server_tls()?,
        require_registered_prefill: args.discovery.etcd.is_some(),
        drive_vllm: args.drive_vllm,
        request_timeout: args.requests.request_timeout(),
        max_decoding: args.requests.max_decoding(),
        http: args.requests.http(),
        inbox: args.requests.inbox(),
        ops_on_public: args.ops_listen.is_none(),
        ..FrontendConfig::default()
    };
    let frontend = Frontend::new(cfg, engines(&args.engine)?()?, &args.scheduler, tasks).await?;
    // Up before the wait for a scheduler: alive, not ready, while it lasts.
    let ops = crate::cmd::serve_ops(args.ops_listen, frontend.ops(), tasks).await?;
    let mut own_scheduler = None;
    if args.scheduler_in_frontend {
        let own = OwnScheduler::start(args, &frontend, registry.clone(), bus, tasks).await?;
        own_scheduler = Some(own);
    } else if args.scheduler.is_empty() {
        frontend.follow_schedulers(registry.clone()).await?;
        await_scheduler(&frontend).await;
    }
    frontend.follow(registry.clone()).await?;
    let scheduler = frontend.schedulers().addrs().join(",");
    let grpc = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let http = TcpListener::bind(args.http_listen)
        .await
        .with_context(|| format!("listening on {}", args.http_listen))?;
    let me = Instance {
        id: InstanceId::random("frontend"),
        role: Role::Frontend,
        model: frontend.model_name().to_owned(),
        // A frontend's "bootstrap" address is its HTTP API (where ctl finds its traces).
        bootstrap_addr: host_port(&args.advertise_host, http.local_addr()?.port()),
        grpc_addr: host_port(&args.advertise_host, grpc.local_addr()?.port()),
        topology: Topology { dp: 1, tp: args.decode_tp, pp: 1, cp: 1 },
        page_size: 0,
        version: 1,
        engine: None,
    };
    let id = me.id.clone();
    // Named in its selections: the scheduler replicas have its open bookings expire soon
    // when this registration ends (a frontend killed reports none of them).
    frontend.schedulers().set_owner(id.as_str());
    registry.register(me).await?;
    let s = if args.public_tls.public_tls_cert.is_some() { "s" } else { "" };
    let mut ready = format!(
        "frontend ready: grpc{s}://{} http{s}://{} scheduler {scheduler}",
        grpc.local_addr()?,
        http.local_addr()?
    );
    if let Some(addr) = ops {
        ready.push_str(&format!(", ops http://{addr}"));
    }
    if let Some(own) = &own_scheduler {
        own.set_ready(true);
        if let Some(addr) = own.ops {
            ready.push_str(&format!(", its ops http://{addr}"));
        }
        if let Some(addr) = own.grpc {
            let s = if args.discovery.tls_cert.is_some() { "s" } else { "" };
            ready.push_str(&format!(", its grpc{s}://{addr}"));
        }
    }
    crate::cmd::announce(&ready)?;
    Ok(Started { frontend, registry, own_scheduler, grpc, http, id })
}
