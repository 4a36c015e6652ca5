//! `handoff register-engine`: an engine instance's registration in etcd, held (leased) while
//! this process runs, for every scheduler to follow (`Scheduler::follow_registered_engines`).

use anyhow::bail;
use handoff_core::Tasks;

use crate::args::RegisterEngineArgs;
use crate::cmd::discovery;
use crate::stop::Stop;

/// Registers the engine, runs until Ctrl-C or SIGTERM, then deregisters it.
pub async fn run(args: RegisterEngineArgs, mut stop: Stop) -> anyhow::Result<()> {
    if args.discovery.etcd.is_none() {
        bail!("register-engine needs --etcd and --nats (or HANDOFF_ETCD and HANDOFF_NATS)");
    }
    let tasks = Tasks::new();
    let me = args.engine.registration(args.page_size);
    let id = me.id.clone();
    let registering = async {
        let (registry, _bus) = discovery(&args.discovery, &tasks).await?;
        registry.register(me).await?;
        // Said within the start: a failure to say it takes the registration back.
        crate::cmd::announce(&format!("engine {id} registered"))?;
        anyhow::Ok(registry)
    };
    let Some(registry) = stop.starting(&tasks, registering).await? else {
        return Ok(());
    };
    stop.wait().await;
    let _ = registry.deregister(&id).await;
    tasks.shutdown().await;
    Ok(())
}
