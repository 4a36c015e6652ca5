//! `handoff prefill`: one prefill instance as its own process. SIGTERM drains it: out of
//! routing first, then in-flight requests finish, then it stops.

use std::time::Duration;

use handoff_core::{InstanceId, Tasks};
use handoff_prefill::{PrefillConfig, PrefillInstance};

use crate::args::PrefillArgs;
use crate::cmd::{discovery, up::engines};
use crate::stop::Stop;

/// How long a stopping prefill answers at least, refusing new requests as draining, before
/// its listeners close: a scheduler replica that has not seen it leave etcd yet (lagging, or
/// cut off) routes to it until its heartbeats have been missing for the liveness timeout
/// (3 s). A refusal as draining sends the frontend elsewhere; a closed port was counted as
/// the instance's fault, an idle prefill's drain being over at once.
const DRAIN_NOTICE: Duration = Duration::from_secs(4);

/// Runs until Ctrl-C or SIGTERM, then drains (a second one ends the drain). Told to stop
/// while starting, stops there.
pub async fn run(args: PrefillArgs, mut stop: Stop) -> anyhow::Result<()> {
    if args.discovery.etcd.is_none() {
        anyhow::bail!(
            "a prefill without --etcd and --nats (or HANDOFF_ETCD and HANDOFF_NATS) is found by no scheduler or frontend: give them (`handoff up` runs one cluster in a process)"
        );
    }
    crate::cmd::check_exposure(
        &args.discovery,
        &[("the bootstrap directory", args.bootstrap_listen), ("the prefill", args.grpc_listen)]
            .into_iter()
            .chain(args.ops_listen.map(|a| ("the prefill's metrics", a)))
            .collect::<Vec<_>>(),
    )?;
    crate::cmd::check_advertised("--advertise-host", &args.advertise_host)?;
    let dialed =
        [("the bootstrap directory", args.bootstrap_listen), ("the prefill", args.grpc_listen)];
    if let Some(w) = crate::cmd::loopback_advertised(&args.discovery, &args.advertise_host, &dialed)
    {
        tracing::warn!("{w}");
    }
    if let Some(t) = &args.discovery.transfer_advertise {
        crate::cmd::check_advertised("--transfer-advertise", t)?;
    }
    let tasks = Tasks::new();
    let Some((p, ops)) = stop.starting(&tasks, start(&args, &tasks)).await? else {
        return Ok(());
    };
    args.discovery.watch_tls(None, &tasks);
    let s = if args.discovery.tls_cert.is_some() { "s" } else { "" };
    let mut ready = format!(
        "prefill {} ready: bootstrap http{s}://{} grpc{s}://{}",
        p.id, p.bootstrap_addr, p.grpc_addr
    );
    if let Some(a) = ops {
        ready.push_str(&format!(" ops http://{a}"));
    }
    if let Err(e) = crate::cmd::announce(&ready) {
        tasks.shutdown().await;
        return Err(e.into());
    }
    let told = stop.wait().await;
    let (began, grace) = (tokio::time::Instant::now(), Duration::from_secs(args.drain_secs));
    let draining = async {
        p.drain(grace).await?;
        tokio::time::sleep_until(began + DRAIN_NOTICE.min(grace)).await;
        anyhow::Ok(())
    };
    let drained = tokio::select! {
        r = draining => r,
        _ = stop.again(told) => {
            tracing::warn!("told to stop again: ending the drain");
            Ok(())
        }
    };
    tasks.shutdown().await;
    drained
}

/// Starts the instance (registered, serving) and its ops listener.
async fn start(
    args: &PrefillArgs,
    tasks: &Tasks,
) -> anyhow::Result<(PrefillInstance, Option<std::net::SocketAddr>)> {
    let (registry, bus) = discovery(&args.discovery, tasks).await?;
    let engine = engines(&args.engine)?()?;
    let id = match &args.id {
        Some(s) => s.parse::<InstanceId>()?,
        None => InstanceId::random("prefill"),
    };
    let cfg = PrefillConfig {
        id,
        dp: args.dp,
        tp: args.tp,
        pp: args.pp,
        bootstrap_bind: args.bootstrap_listen,
        grpc_bind: args.grpc_listen,
        advertise_host: args.advertise_host.clone(),
        transfer: args.discovery.network_transfer()?,
        tls: args.discovery.cluster_tls()?,
        ..PrefillConfig::default()
    }
    .with_token(args.discovery.token.clone());
    let p = PrefillInstance::start(cfg, engine, registry, bus, tasks, None).await?;
    let ops = crate::cmd::serve_ops(args.ops_listen, p.ops(), tasks).await?;
    Ok((p, ops))
}
