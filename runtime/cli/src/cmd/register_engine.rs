//! `handoff register-engine`: an engine instance's registration in etcd, held (leased) while
//! this process runs, for every scheduler to follow (`Scheduler::follow_registered_engines`).

use anyhow::bail;
use handoff_core::Tasks;

use crate::args::RegisterEngineArgs;
use crate::cmd::{discovery, up::shutdown_signal};

/// Registers the engine, runs until Ctrl-C or SIGTERM, then deregisters it.
pub async fn run(args: RegisterEngineArgs) -> anyhow::Result<()> {
    if args.discovery.etcd.is_none() {
        bail!("register-engine needs --etcd and --nats (or HANDOFF_ETCD and HANDOFF_NATS)");
    }
    let tasks = Tasks::new();
    let (registry, _bus) = discovery(&args.discovery, &tasks).await?;
    let me = args.engine.registration(args.page_size);
    let id = me.id.clone();
    registry.register(me).await?;
    crate::cmd::announce(&format!("engine {id} registered"))?;
    shutdown_signal().await;
    let _ = registry.deregister(&id).await;
    tasks.shutdown().await;
    Ok(())
}
