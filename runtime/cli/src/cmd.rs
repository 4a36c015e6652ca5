//! One module per subcommand, and what they share.

pub mod ctl;
pub mod frontend;
pub mod prefill;
pub mod register_engine;
pub mod scheduler;
pub mod up;

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{
    EtcdRegistry, EventBus, MemoryBus, MemoryRegistry, NatsBus, Registry, Role, Update,
};
use handoff_scheduler::Scheduler;

use crate::args::DiscoveryArgs;

/// The registry and event bus the flags name: etcd and NATS, or in-memory.
pub async fn discovery(
    args: &DiscoveryArgs,
    tasks: &Tasks,
) -> anyhow::Result<(Arc<dyn Registry>, Arc<dyn EventBus>)> {
    match (&args.etcd, &args.nats) {
        (Some(etcd), Some(nats)) => {
            let ttl = Duration::from_secs(args.lease_ttl_secs);
            let registry =
                EtcdRegistry::connect_with(etcd, &args.access.etcd(args.tls_reload()), ttl, tasks)
                    .await
                    .with_context(|| format!("etcd at {etcd}"))?;
            let bus = NatsBus::connect_with(nats, &args.access.nats())
                .await
                .with_context(|| format!("NATS at {nats}"))?;
            Ok((Arc::new(registry), Arc::new(bus)))
        }
        _ => Ok((Arc::new(MemoryRegistry::new()), Arc::new(MemoryBus::new()))),
    }
}

/// Refuses to listen beyond loopback with neither a token nor TLS, unless told `--insecure`: a
/// role without them accepts directory writes and transfer connections from anyone who can reach
/// it. `binds` names each listener.
pub fn check_exposure(args: &DiscoveryArgs, binds: &[(&str, SocketAddr)]) -> anyhow::Result<()> {
    if args.token.is_some() || args.tls_cert.is_some() {
        return Ok(());
    }
    let transfers = SocketAddr::new(args.transfer_bind, 0);
    let exposed: Vec<String> = binds
        .iter()
        .chain(std::iter::once(&("KV transfers", transfers)))
        .filter(|(_, a)| !a.ip().is_loopback())
        .map(|(what, a)| format!("{what} on {a}"))
        .collect();
    if exposed.is_empty() {
        return Ok(());
    }
    if args.insecure {
        tracing::warn!(listeners = %exposed.join(", "), "listening beyond loopback without a token (--insecure)");
        return Ok(());
    }
    anyhow::bail!(
        "refusing to listen beyond loopback without a token ({}): anyone who can reach it could \
         write its directory and open transfer connections. Set --token (or HANDOFF_TOKEN) to \
         the cluster's shared secret, or pass --insecure to run open anyway",
        exposed.join(", ")
    )
}

/// Checks an address this process advertises (`flag` names it): an error for one no peer can
/// dial (0.0.0.0), a warning for an IP that is not this host's (peers dialing it reach this
/// process only if something forwards it). Host names are not checked.
pub fn check_advertised(flag: &str, host: &str) -> anyhow::Result<()> {
    let bare = bare_host(host);
    let Ok(ip) = bare.parse::<std::net::IpAddr>() else { return Ok(()) };
    if ip.is_unspecified() {
        anyhow::bail!("{flag} {host}: peers cannot dial an unspecified address; give this host's");
    }
    if let Err(e) = std::net::UdpSocket::bind((ip, 0)) {
        tracing::warn!(
            "{flag} {host} is not an address of this host ({e}): peers dialing it reach this \
             process only if something forwards it"
        );
    }
    Ok(())
}

/// `host` without the brackets of an IPv6 literal.
fn bare_host(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// What to warn of a role in a cluster (`--etcd`) that advertises loopback while `dialed` (the
/// listeners its peers dial) listen beyond it: peers on other hosts would dial their own
/// loopback (and a frontend take the role for one on its own host). Only a warning: every
/// role on one host, listening widely, works.
pub fn loopback_advertised(
    args: &DiscoveryArgs,
    host: &str,
    dialed: &[(&str, SocketAddr)],
) -> Option<String> {
    let bare = bare_host(host);
    let loopback =
        bare == "localhost" || bare.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback());
    let wide: Vec<String> = dialed
        .iter()
        .filter(|(_, a)| !a.ip().is_loopback())
        .map(|(what, a)| format!("{what} on {a}"))
        .collect();
    (args.etcd.is_some() && loopback && !wide.is_empty()).then(|| {
        format!(
            "--advertise-host {host} is registered in etcd for {}: peers on other hosts will dial their own loopback; give this host's address",
            wide.join(", ")
        )
    })
}

/// Serves `ops` on `bind` on `tasks` (when given): returns the bound address.
pub async fn serve_ops(
    bind: Option<SocketAddr>,
    ops: Arc<handoff_core::ops::Ops>,
    tasks: &Tasks,
) -> anyhow::Result<Option<SocketAddr>> {
    let Some(bind) = bind else { return Ok(None) };
    let l = tokio::net::TcpListener::bind(bind)
        .await
        .with_context(|| format!("listening on {bind}"))?;
    let addr = l.local_addr()?;
    let t = tasks.clone();
    tasks.spawn(async move {
        let stop = async move { t.shutdown_requested().await };
        if let Err(e) = handoff_core::ops::serve(l, ops, stop).await {
            tracing::warn!(error = %e, "operations endpoint stopped");
        }
    });
    Ok(Some(addr))
}

/// A fresh random cluster token (256 bits, hex).
pub fn generated_token() -> String {
    (0..32).map(|_| format!("{:02x}", rand::random::<u8>())).collect()
}

/// Prints a process's ready line on stdout (what scripts and tests wait for) and flushes it.
pub fn announce(line: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}

/// Waits (at most `within`) until `scheduler` knows every prefill instance `registry` lists
/// now, or that instance has left the registry meanwhile.
pub(crate) async fn learn_registered(
    scheduler: &Scheduler,
    registry: &dyn Registry,
    within: Duration,
) -> anyhow::Result<()> {
    let mut watch = registry.watch(Role::Prefill).await?;
    let learned = async {
        // The registry's list first (etcd not reached yet: as long as that takes, within).
        let mut waiting: HashSet<InstanceId> = match watch.next().await {
            Some(Update::Reset(all)) => all.into_iter().map(|i| i.id).collect(),
            _ => HashSet::new(),
        };
        let mut look = tokio::time::interval(Duration::from_millis(20));
        let mut watching = true;
        loop {
            let known: HashSet<InstanceId> =
                scheduler.state().instances().into_iter().map(|s| s.instance.id).collect();
            waiting.retain(|id| !known.contains(id));
            if waiting.is_empty() {
                return;
            }
            tokio::select! {
                _ = look.tick() => {}
                u = watch.next(), if watching => match u {
                    Some(Update::Remove(id)) => {
                        waiting.remove(&id);
                    }
                    Some(Update::Reset(all)) => {
                        let now: HashSet<InstanceId> = all.into_iter().map(|i| i.id).collect();
                        waiting.retain(|id| now.contains(id));
                    }
                    Some(Update::Add(_)) => {}
                    // The watch ended: what it listed is what is waited for.
                    None => watching = false,
                },
            }
        }
    };
    if tokio::time::timeout(within, learned).await.is_err() {
        bail!(
            "the scheduler replica did not learn the registered prefill instances within {within:?}"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(token: Option<&str>, insecure: bool) -> DiscoveryArgs {
        DiscoveryArgs {
            etcd: None,
            nats: None,
            lease_ttl_secs: 10,
            token: token.map(String::from),
            insecure,
            tls_cert: None,
            tls_key: None,
            tls_ca: None,
            tls_reload_secs: 60,
            cluster_tls_read: Default::default(),
            access: Default::default(),
            transfer: crate::args::TransferArg::Tcp,
            transfer_bind: std::net::Ipv4Addr::LOCALHOST.into(),
            transfer_advertise: None,
            no_shared_memory: false,
        }
    }

    #[test]
    fn advertised_addresses_peers_cannot_dial_are_refused() {
        assert!(check_advertised("--advertise-host", "127.0.0.1").is_ok());
        assert!(check_advertised("--advertise-host", "prefill-0.example").is_ok());
        // Not this host's: a warning, not an error (NAT may forward it).
        assert!(check_advertised("--advertise-host", "192.0.2.7").is_ok());
        let e = check_advertised("--advertise-host", "0.0.0.0").unwrap_err().to_string();
        assert!(e.contains("unspecified"), "{e}");
    }

    /// In a cluster, loopback advertised for listeners bound beyond it is warned of (peers on
    /// other hosts would dial their own loopback); bound on loopback, or with no etcd, not.
    #[test]
    fn loopback_advertised_for_wide_listeners_is_warned_of() {
        let open: SocketAddr = "0.0.0.0:50060".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:50060".parse().unwrap();
        let mut cluster = args(None, false);
        cluster.etcd = Some("http://etcd:2379".into());
        let w = loopback_advertised(&cluster, "127.0.0.1", &[("the prefill", open)]).unwrap();
        assert!(w.contains("the prefill on 0.0.0.0:50060"), "{w}");
        assert!(loopback_advertised(&cluster, "localhost", &[("p", open)]).is_some());
        assert!(loopback_advertised(&cluster, "[::1]", &[("p", open)]).is_some());
        assert!(loopback_advertised(&cluster, "10.0.0.7", &[("p", open)]).is_none());
        assert!(loopback_advertised(&cluster, "127.0.0.1", &[("p", local)]).is_none());
        assert!(loopback_advertised(&args(None, false), "127.0.0.1", &[("p", open)]).is_none());
    }

    #[test]
    fn listening_beyond_loopback_needs_a_token_or_insecure() {
        let open: SocketAddr = "0.0.0.0:50052".parse().unwrap();
        let local: SocketAddr = "127.0.0.1:50052".parse().unwrap();
        let v6: SocketAddr = "[::1]:1".parse().unwrap();
        assert!(check_exposure(&args(None, false), &[("a", local), ("b", v6)]).is_ok());
        let e = check_exposure(&args(None, false), &[("a", local), ("the scheduler", open)])
            .unwrap_err()
            .to_string();
        assert!(e.contains("the scheduler on 0.0.0.0:50052") && e.contains("--token"), "{e}");
        assert!(check_exposure(&args(Some("t"), false), &[("a", open)]).is_ok());
        assert!(check_exposure(&args(None, true), &[("a", open)]).is_ok());
        let mut pod = args(None, false);
        pod.transfer_bind = "10.0.0.7".parse().unwrap();
        let e = check_exposure(&pod, &[("a", local)]).unwrap_err().to_string();
        assert!(e.contains("KV transfers on 10.0.0.7:0"), "{e}");
        pod.transfer_bind = "0.0.0.0".parse().unwrap();
        let e = pod.transfer().unwrap_err().to_string();
        assert!(e.contains("--transfer-advertise"), "{e}");
        let (a, b) = (generated_token(), generated_token());
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
    }
}
