//! The command line: the one place handoff reads its configuration.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

/// handoff: prefill/decode disaggregated LLM serving, entered from the decode side.
#[derive(Debug, Parser)]
#[command(name = "handoff", version, about)]
pub struct Cli {
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// Subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Scheduler, prefill instances and frontend in one process, in-memory discovery.
    Up(UpArgs),
}

/// Which transfer backend agents use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransferArg {
    /// Real bytes over TCP sockets.
    Tcp,
    /// In-process, no sockets.
    Fake,
}

/// Which engine serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EngineArg {
    /// The mock engine: checkable KV, configurable timing.
    Mock,
}

/// Mock engine timing.
#[derive(Debug, Clone, Args)]
pub struct MockArgs {
    /// Mock prefill time per computed token, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub mock_prefill_us: u64,
    /// Mock decode time per token, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub mock_decode_us: u64,
}

/// `handoff up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Frontend gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub frontend_listen: SocketAddr,
    /// Scheduler gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub scheduler_listen: SocketAddr,
    /// Prefill instances.
    #[arg(long, default_value_t = 2)]
    pub prefills: usize,
    /// Prefill tp size.
    #[arg(long, default_value_t = 2)]
    pub prefill_tp: u32,
    /// Prefill dp size.
    #[arg(long, default_value_t = 1)]
    pub prefill_dp: u32,
    /// Decode tp size.
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// First prefill's bootstrap directory port (the next ones count up).
    #[arg(long, default_value_t = 8998)]
    pub bootstrap_port: u16,
    /// First prefill's gRPC port (the next ones count up).
    #[arg(long, default_value_t = 50060)]
    pub prefill_port: u16,
    /// Transfer backend.
    #[arg(long, value_enum, default_value_t = TransferArg::Tcp)]
    pub transfer: TransferArg,
    /// Engine.
    #[arg(long, value_enum, default_value_t = EngineArg::Mock)]
    pub engine: EngineArg,
    /// Model file (for real engines).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Mock engine timing.
    #[command(flatten)]
    pub mock: MockArgs,
}
