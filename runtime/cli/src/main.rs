//! `handoff`: one binary for every process of a handoff deployment.

use clap::Parser;
use std::io::IsTerminal;

use handoff::args::{Cli, Command, LogFormat};
use tracing_subscriber::EnvFilter;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match cli.log_format {
        LogFormat::Json => logs.json().init(),
        // Colour codes only on a terminal.
        LogFormat::Text => logs.with_ansi(std::io::stderr().is_terminal()).init(),
    }
    match cli.command {
        Command::Up(args) => handoff::cmd::up::run(args).await,
        Command::Scheduler(args) => handoff::cmd::scheduler::run(args).await,
        Command::Prefill(args) => handoff::cmd::prefill::run(args).await,
        Command::Frontend(args) => handoff::cmd::frontend::run(args).await,
        Command::Ctl(args) => handoff::cmd::ctl::run(args).await,
    }
}
