//! `handoff`: one binary for every process of a handoff deployment.

use clap::Parser;
use handoff::args::{Cli, Command};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Up(args) => handoff::cmd::up::run(args).await,
        Command::Scheduler(args) => handoff::cmd::scheduler::run(args).await,
        Command::Prefill(args) => handoff::cmd::prefill::run(args).await,
        Command::Frontend(args) => handoff::cmd::frontend::run(args).await,
        Command::Ctl(args) => handoff::cmd::ctl::run(args).await,
    }
}
