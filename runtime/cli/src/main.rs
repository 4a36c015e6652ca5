//! `handoff`: one binary for every process of a handoff deployment.

use clap::Parser;
use handoff::args::{Cli, Command};

fn main() -> anyhow::Result<()> {
    // Before the runtime's threads start allocating.
    handoff::alloc::keep_freed_memory();
    tokio::runtime::Builder::new_multi_thread().enable_all().build()?.block_on(run())
}

async fn run() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // First, before a role does anything: a stop told during startup is kept, not dropped
    // (see `stop`). Not for `ctl`, which a signal ends at once.
    let mut stop = match cli.command {
        Command::Ctl(_) => None,
        _ => Some(handoff::stop::Stop::listen()),
    };
    let mut listen = || stop.take().unwrap_or_else(handoff::stop::Stop::listen);
    let role = match &cli.command {
        Command::Up(_) => "handoff",
        Command::Scheduler(_) => "handoff-scheduler",
        Command::Prefill(_) => "handoff-prefill",
        Command::Frontend(_) => "handoff-frontend",
        Command::Ctl(_) => "handoff-ctl",
        Command::RegisterEngine(_) => "handoff-register-engine",
    };
    let _telemetry = handoff::telemetry::init(cli.log_format, cli.otlp_endpoint.as_deref(), role)?;
    match handoff::fds::raise_open_files_limit() {
        Ok(limit) => tracing::debug!(limit, "open files"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open files limit"),
    }
    match cli.command {
        Command::Up(args) => handoff::cmd::up::run(args, listen()).await,
        Command::Scheduler(args) => handoff::cmd::scheduler::run(args, listen()).await,
        Command::Prefill(args) => handoff::cmd::prefill::run(args, listen()).await,
        Command::Frontend(args) => handoff::cmd::frontend::run(args, listen()).await,
        Command::Ctl(args) => handoff::cmd::ctl::run(args).await,
        Command::RegisterEngine(args) => handoff::cmd::register_engine::run(args, listen()).await,
    }
}
