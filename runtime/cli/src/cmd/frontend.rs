//! `handoff frontend`: the decode frontend as its own process.

use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use handoff_core::Tasks;
use handoff_discovery::{Registry, Role, Update};
use handoff_frontend::{Frontend, FrontendConfig};
use tokio::net::TcpListener;

use crate::args::FrontendArgs;
use crate::cmd::{discovery, up::engines, up::shutdown_signal};

/// A scheduler registered in discovery: one at random of those already there (frontends
/// spread over scheduler replicas, which share their in-flight load), else the first to come.
async fn find_scheduler(registry: &dyn Registry) -> anyhow::Result<String> {
    let mut watch = registry.watch(Role::Scheduler).await?;
    let found = async {
        while let Some(u) = watch.next().await {
            let first = match u {
                Update::Reset(all) if all.is_empty() => None,
                Update::Reset(mut all) => {
                    let i = rand::random_range(0..all.len());
                    Some(all.swap_remove(i))
                }
                Update::Add(i) => Some(i),
                Update::Remove(_) => None,
            };
            if let Some(i) = first {
                return Some(i.grpc_addr);
            }
        }
        None
    };
    match tokio::time::timeout(Duration::from_secs(30), found).await {
        Ok(Some(addr)) => Ok(addr),
        _ => bail!("no scheduler registered in discovery within 30 s (or pass --scheduler)"),
    }
}

/// Runs until Ctrl-C or SIGTERM.
pub async fn run(args: FrontendArgs) -> anyhow::Result<()> {
    let tasks = Tasks::new();
    let (registry, _bus) = discovery(&args.discovery, &tasks).await?;
    let scheduler = match &args.scheduler {
        Some(s) => s.clone(),
        None => find_scheduler(&*registry).await?,
    };
    let cfg = FrontendConfig {
        decode_tp: args.decode_tp,
        transfer_token: args.discovery.token.clone(),
        ..FrontendConfig::default()
    };
    let frontend = Frontend::new(cfg, engines(&args.engine)?()?, &scheduler, &tasks).await?;
    frontend.follow(registry).await?;
    let grpc = TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("listening on {}", args.listen))?;
    let http = TcpListener::bind(args.http_listen)
        .await
        .with_context(|| format!("listening on {}", args.http_listen))?;
    crate::cmd::announce(&format!(
        "frontend ready: grpc://{} http://{} scheduler {scheduler}",
        grpc.local_addr()?,
        http.local_addr()?
    ))?;
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
    let serving =
        handoff_frontend::service::serve(
            grpc,
            frontend,
            async move { t2.shutdown_requested().await },
        );
    tokio::select! {
        r = serving => r?,
        _ = shutdown_signal() => {}
    }
    tasks.shutdown().await;
    Ok(())
}
