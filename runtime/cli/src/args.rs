//! The command line: the one place handoff reads its configuration (flags, and the
//! environment variables they name).

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
    /// Scheduler, prefill instances and frontend in one process (in-memory discovery unless
    /// --etcd/--nats are given).
    Up(UpArgs),
    /// The KV-aware scheduler alone.
    Scheduler(SchedulerArgs),
    /// One prefill instance alone.
    Prefill(PrefillArgs),
    /// The decode frontend alone.
    Frontend(FrontendArgs),
}

/// Where instances find each other.
#[derive(Debug, Clone, Args)]
pub struct DiscoveryArgs {
    /// etcd endpoints (comma-separated URLs) for the registry; with --nats. Without both,
    /// discovery is in-memory (one process).
    #[arg(long, env = "HANDOFF_ETCD", requires = "nats")]
    pub etcd: Option<String>,
    /// NATS server URL for heartbeats and KV events; with --etcd.
    #[arg(long, env = "HANDOFF_NATS", requires = "etcd")]
    pub nats: Option<String>,
    /// Lease TTL of registrations, in seconds (kept alive every TTL/3).
    #[arg(long, default_value_t = 10)]
    pub lease_ttl_secs: u64,
    /// Shared secret: required as a bearer token on bootstrap directory writes and on KV
    /// transfer handshakes, and sent by this process on its own.
    #[arg(long, env = "HANDOFF_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// `handoff scheduler`.
#[derive(Debug, Clone, Args)]
pub struct SchedulerArgs {
    /// gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Host other processes use to reach this one.
    #[arg(long, default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}

/// `handoff prefill`.
#[derive(Debug, Clone, Args)]
pub struct PrefillArgs {
    /// Instance id (default: random).
    #[arg(long)]
    pub id: Option<String>,
    /// Bootstrap directory listener.
    #[arg(long, default_value = "127.0.0.1:8998")]
    pub bootstrap_listen: SocketAddr,
    /// Prefill gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50060")]
    pub grpc_listen: SocketAddr,
    /// Host other processes use to reach this one.
    #[arg(long, default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// tp size.
    #[arg(long, default_value_t = 1)]
    pub tp: u32,
    /// dp size.
    #[arg(long, default_value_t = 1)]
    pub dp: u32,
    /// pp size.
    #[arg(long, default_value_t = 1)]
    pub pp: u32,
    /// Seconds in-flight requests get to finish on SIGTERM (drain).
    #[arg(long, default_value_t = 30)]
    pub drain_secs: u64,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// `handoff frontend`.
#[derive(Debug, Clone, Args)]
pub struct FrontendArgs {
    /// gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub listen: SocketAddr,
    /// HTTP (OpenAI API) listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http_listen: SocketAddr,
    /// The scheduler (host:port); default: the one registered in discovery.
    #[arg(long)]
    pub scheduler: Option<String>,
    /// Decode tp size.
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
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
    /// SmolLM2-135M-Instruct from its GGUF file, on CPU.
    Smollm,
    /// The mock engine: checkable KV, configurable timing.
    Mock,
}

/// The engine and its settings.
#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// Engine.
    #[arg(long, value_enum, default_value_t = EngineArg::Smollm)]
    pub engine: EngineArg,
    /// The GGUF model file (smollm); default: the cache `scripts/fetch-model` fills.
    #[arg(long, env = "HANDOFF_MODEL")]
    pub model: Option<PathBuf>,
    /// Model cache directory.
    #[arg(long, env = "HANDOFF_MODEL_DIR")]
    pub model_dir: Option<PathBuf>,
    /// Longest sequence the smollm engine serves.
    #[arg(long, default_value_t = 4096)]
    pub max_context: usize,
    /// Mock prefill time per computed token, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub mock_prefill_us: u64,
    /// Mock decode time per token, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub mock_decode_us: u64,
}

impl EngineArgs {
    /// The model file: `--model`, else the cache.
    pub fn model_path(&self) -> PathBuf {
        if let Some(p) = &self.model {
            return p.clone();
        }
        let dir = self.model_dir.clone().unwrap_or_else(|| {
            let cache =
                std::env::var_os("XDG_CACHE_HOME").map(PathBuf::from).unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache")
                });
            cache.join("handoff/models")
        });
        dir.join("SmolLM2-135M-Instruct.Q4_1.gguf")
    }
}

/// `handoff up`.
#[derive(Debug, Clone, Args)]
pub struct UpArgs {
    /// Frontend gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50051")]
    pub frontend_listen: SocketAddr,
    /// Frontend HTTP (OpenAI API) listener.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub http_listen: SocketAddr,
    /// Scheduler gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub scheduler_listen: SocketAddr,
    /// Prefill instances.
    #[arg(long, default_value_t = 2)]
    pub prefills: usize,
    /// Prefill tp size.
    #[arg(long, default_value_t = 1)]
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
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}
