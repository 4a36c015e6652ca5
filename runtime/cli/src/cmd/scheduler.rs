//! `handoff scheduler`: the KV-aware scheduler as its own process. It registers itself (role
//! scheduler) so frontends can find it.

use anyhow::Context;
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{Instance, Role, Topology};
use handoff_scheduler::{Scheduler, SchedulerConfig, service};
use tokio::net::TcpListener;

use crate::args::SchedulerArgs;
use crate::cmd::discovery;
use crate::stop::Stop;

/// Runs until Ctrl-C or SIGTERM (told while starting, stops there).
pub async fn run(args: SchedulerArgs, mut stop: Stop) -> anyhow::Result<()> {
    let mut binds = vec![("the scheduler", args.listen)];
    binds.extend(args.http_listen.map(|a| ("the scheduler's JSON API", a)));
    binds.extend(args.ops_listen.map(|a| ("the scheduler's metrics", a)));
    crate::cmd::check_exposure(&args.discovery, &binds)?;
    crate::cmd::check_advertised("--advertise-host", &args.advertise_host)?;
    let dialed = [("the scheduler", args.listen)];
    if let Some(w) = crate::cmd::loopback_advertised(&args.discovery, &args.advertise_host, &dialed)
    {
        tracing::warn!("{w}");
    }
    let tasks = Tasks::new();
    let Some(started) = stop.starting(&tasks, start(&args, &tasks)).await? else {
        return Ok(());
    };
    let Started { scheduler, registry, listener, id } = started;
    args.discovery.watch_tls(None, &tasks);
    let t = tasks.clone();
    let serving =
        service::serve(
            listener,
            scheduler.state().clone(),
            async move { t.shutdown_requested().await },
        );
    // A server that fails still takes its registration back (frontends would go on asking
    // a dead address for a lease) and its tasks down.
    let served = tokio::select! {
        r = serving => r,
        _ = stop.wait() => Ok(()),
    };
    let _ = registry.deregister(&id).await;
    tasks.shutdown().await;
    Ok(served?)
}

/// A scheduler started: registered, and listening.
struct Started {
    scheduler: Scheduler,
    registry: std::sync::Arc<dyn handoff_discovery::Registry>,
    listener: TcpListener,
    id: InstanceId,
}

/// Starts the scheduler, its listeners and its registration.
async fn start(args: &SchedulerArgs, tasks: &Tasks) -> anyhow::Result<Started> {
    let (registry, bus) = discovery(&args.discovery, tasks).await?;
    let cfg = SchedulerConfig {
        token: args.discovery.token.clone(),
        tls: args.discovery.cluster_tls()?,
        ..args.policy.config()
    };
    let scheduler = Scheduler::start(cfg, registry.clone(), bus, tasks).await?;
    let mut ids = std::collections::HashSet::new();
    for e in &args.engines {
        let spec = e.spec(args.page_size);
        if !ids.insert(spec.instance.id.clone()) {
            anyhow::bail!("--engine id={} given twice", spec.instance.id);
        }
        if !scheduler.follow_engine(spec, tasks) {
            anyhow::bail!("--engine id={}: the id is taken", e.id());
        }
    }
    // And the engines registered in discovery (`handoff register-engine`).
    scheduler.follow_registered_engines(registry.clone(), tasks).await?;
    let listener = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let addr = handoff_core::net::host_port(&args.advertise_host, listener.local_addr()?.port());
    let id = InstanceId::random("scheduler");
    let me = Instance {
        id: id.clone(),
        role: Role::Scheduler,
        model: String::new(),
        bootstrap_addr: String::new(),
        grpc_addr: addr.clone(),
        topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
        page_size: 0,
        version: 1,
        engine: None,
    };
    let s = if args.discovery.tls_cert.is_some() { "s" } else { "" };
    let mut ready = format!("scheduler {id} ready: grpc{s}://{addr}");
    if let Some(bind) = args.http_listen {
        let l = TcpListener::bind(bind).await.with_context(|| format!("listening on {bind}"))?;
        ready.push_str(&format!(" http{s}://{}", l.local_addr()?));
        let (state, t, page) = (scheduler.state().clone(), tasks.clone(), args.page_size as usize);
        tasks.spawn(async move {
            let stop = async move { t.shutdown_requested().await };
            if let Err(e) = handoff_scheduler::http::serve(l, state, page, stop).await {
                tracing::warn!(error = %e, "scheduler JSON API stopped");
            }
        });
    }
    let ops = handoff_scheduler::metrics::ops(scheduler.state());
    if let Some(a) = crate::cmd::serve_ops(args.ops_listen, ops, tasks).await? {
        ready.push_str(&format!(" ops http://{a}"));
    }
    // Listed once it knows the prefills registered now: a frontend asking it sooner would be
    // told none is there.
    if let Err(e) =
        crate::cmd::learn_registered(&scheduler, &*registry, std::time::Duration::from_secs(30))
            .await
    {
        tracing::warn!(error = %e, "registering all the same");
    }
    // Registered once every listener is bound: one that fails (its port taken) ends this
    // process before discovery lists it, not leaving a dead address listed for a lease.
    registry.register(me).await?;
    scheduler.state().metrics().set_registered(true);
    crate::cmd::announce(&ready)?;
    Ok(Started { scheduler, registry, listener, id })
}
