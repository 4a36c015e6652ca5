//! One module per subcommand, and what they share.

pub mod frontend;
pub mod prefill;
pub mod scheduler;
pub mod up;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use handoff_core::Tasks;
use handoff_discovery::{EtcdRegistry, EventBus, MemoryBus, MemoryRegistry, NatsBus, Registry};

use crate::args::DiscoveryArgs;

/// The registry and event bus the flags name: etcd and NATS, or in-memory.
pub async fn discovery(
    args: &DiscoveryArgs,
    tasks: &Tasks,
) -> anyhow::Result<(Arc<dyn Registry>, Arc<dyn EventBus>)> {
    match (&args.etcd, &args.nats) {
        (Some(etcd), Some(nats)) => {
            let ttl = Duration::from_secs(args.lease_ttl_secs);
            let registry = EtcdRegistry::connect(etcd, ttl, tasks)
                .await
                .with_context(|| format!("etcd at {etcd}"))?;
            let bus = NatsBus::connect(nats).await.with_context(|| format!("NATS at {nats}"))?;
            Ok((Arc::new(registry), Arc::new(bus)))
        }
        _ => Ok((Arc::new(MemoryRegistry::new()), Arc::new(MemoryBus::new()))),
    }
}

/// Prints a process's ready line on stdout (what scripts and tests wait for) and flushes it.
pub fn announce(line: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")?;
    out.flush()
}
