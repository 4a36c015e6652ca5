//! The command line: the one place handoff reads its configuration (flags, and the
//! environment variables they name).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, FromArgMatches, Parser, Subcommand, ValueEnum};
use handoff_scheduler::policy::{KvAwareWeights, PolicyParams};
use handoff_scheduler::{PolicyKind, SchedulerConfig};

/// handoff: prefill/decode disaggregated LLM serving, entered from the decode side.
#[derive(Debug, Parser)]
#[command(name = "handoff", version, about)]
pub struct Cli {
    /// Log format on stderr: text (coloured only on a terminal) or JSON lines.
    #[arg(long, global = true, value_enum, env = "HANDOFF_LOG_FORMAT", default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// Export spans to this OpenTelemetry collector (OTLP over gRPC, e.g.
    /// `http://127.0.0.1:4317`), linked across processes by the requests' trace context.
    #[arg(long, global = true, env = "OTEL_EXPORTER_OTLP_ENDPOINT")]
    pub otlp_endpoint: Option<String>,
    /// What to run.
    #[command(subcommand)]
    pub command: Command,
}

/// How logs are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
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
    /// Ask a running cluster what it believes (instances, directories).
    Ctl(CtlArgs),
    /// Register an engine instance (vLLM, SGLang) in etcd for every scheduler to follow, for
    /// as long as this process runs (a sidecar next to the engine).
    RegisterEngine(RegisterEngineArgs),
}

/// `handoff register-engine`.
#[derive(Debug, Clone, Args)]
pub struct RegisterEngineArgs {
    /// The engine, as `handoff scheduler --engine` takes it: `id=NAME,events=tcp://HOST:PORT
    /// [,replay=tcp://HOST:PORT][,dp=N][,page=N][,url=HOST:PORT][,health=HOST:PORT]
    /// [,model=NAME][,topic=TOPIC][,kind=vllm|sglang]`.
    #[arg(long, value_parser = engine::engine_arg)]
    pub engine: engine::EngineArg,
    /// Tokens per page requests hash their prompts with, unless the spec gives `page=`.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub page_size: u32,
    /// Discovery (etcd and NATS are required).
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}

/// `handoff scheduler`.
#[derive(Debug, Clone, Args)]
pub struct SchedulerArgs {
    /// An engine instance (vLLM, SGLang) to route to, followed through its KV events:
    /// `id=NAME,events=tcp://HOST:PORT[,replay=tcp://HOST:PORT][,dp=N][,page=N][,url=HOST:PORT]
    /// [,health=HOST:PORT][,model=NAME][,topic=TOPIC]` (repeat for more).
    #[arg(long = "engine", value_parser = engine::engine_arg)]
    pub engines: Vec<engine::EngineArg>,
    /// A JSON select/report API for routers that do not speak gRPC (`POST /v1/select`,
    /// `POST /v1/report`).
    #[arg(long)]
    pub http_listen: Option<SocketAddr>,
    /// Operations listener: `/metrics`, `/livez`, `/readyz` (ready once registered).
    #[arg(long)]
    pub ops_listen: Option<SocketAddr>,
    /// Tokens per page when the JSON API hashes `token_ids` (the page size requests and
    /// `--engine` share).
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub page_size: u32,
    /// gRPC listener.
    #[arg(long, default_value = "127.0.0.1:50052")]
    pub listen: SocketAddr,
    /// Host other processes use to reach this one.
    #[arg(long, default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Selection.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}

/// The selection policies (each request may name its own).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Least cost: prefill tokens left after the cached prefix, plus queued prefill work.
    KvAware,
    /// Each instance in turn.
    RoundRobin,
    /// Uniformly at random.
    Random,
    /// The less loaded of two random instances.
    PowerOfTwo,
    /// Consistent hashing of the prompt's first block, with a load factor.
    PrefixHash,
}

/// How the scheduler picks prefill instances.
#[derive(Debug, Clone, PartialEq, Args)]
pub struct PolicyArgs {
    /// The policy for requests that name none.
    #[arg(long, value_enum, default_value_t = PolicyArg::KvAware)]
    pub policy: PolicyArg,
    /// kv_aware: weight of the prefill tokens a request would compute on a candidate.
    #[arg(long, value_parser = weight, default_value_t = KvAwareWeights::default().prefill)]
    pub kv_prefill_weight: f64,
    /// kv_aware: weight of the prefill work already queued on a candidate.
    #[arg(long, value_parser = weight, default_value_t = KvAwareWeights::default().load)]
    pub kv_load_weight: f64,
    /// kv_aware: softmax temperature, relative to the prompt length (0: the cheapest wins).
    #[arg(long, value_parser = weight, default_value_t = KvAwareWeights::default().temperature)]
    pub kv_temperature: f64,
    /// prefix_hash: a candidate queued beyond this factor of the mean is passed over.
    #[arg(long, value_parser = weight, default_value_t = PolicyParams::default().load_factor)]
    pub prefix_load_factor: f64,
    /// Admission bound: the longest prefill queue wait a request is admitted to, in ms (work
    /// queued on the instance times its measured cost per token). Beyond it, and beyond a
    /// request's own deadline, requests are refused at once (HTTP 429 with Retry-After).
    #[arg(long, default_value_t = SchedulerConfig::default().max_queue_wait.as_millis() as u64)]
    pub max_queue_wait_ms: u64,
}

/// A finite, non-negative number.
fn weight(s: &str) -> Result<f64, String> {
    let v: f64 = s.parse().map_err(|e| format!("{s:?} is not a number: {e}"))?;
    if v.is_finite() && v >= 0.0 {
        Ok(v)
    } else {
        Err(format!("{s} must be finite and at least 0"))
    }
}

impl PolicyArgs {
    /// The scheduler settings these flags give.
    pub fn config(&self) -> SchedulerConfig {
        let default_policy = match self.policy {
            PolicyArg::KvAware => PolicyKind::KvAware,
            PolicyArg::RoundRobin => PolicyKind::RoundRobin,
            PolicyArg::Random => PolicyKind::Random,
            PolicyArg::PowerOfTwo => PolicyKind::PowerOfTwo,
            PolicyArg::PrefixHash => PolicyKind::PrefixHash,
        };
        let params = PolicyParams {
            kv_aware: KvAwareWeights {
                prefill: self.kv_prefill_weight,
                load: self.kv_load_weight,
                temperature: self.kv_temperature,
            },
            load_factor: self.prefix_load_factor,
        };
        SchedulerConfig {
            default_policy,
            params,
            max_queue_wait: std::time::Duration::from_millis(self.max_queue_wait_ms),
            ..SchedulerConfig::default()
        }
    }
}

impl FrontendArgs {
    /// What this frontend listens on, each named for the exposure check: its gRPC, its
    /// OpenAI API, its operations listener, and its scheduler's operations listener and gRPC API when there are.
    pub fn listeners(&self) -> Vec<(&'static str, SocketAddr)> {
        let mut binds = vec![("the frontend", self.listen), ("the OpenAI API", self.http_listen)];
        binds.extend(self.ops_listen.map(|a| ("the frontend's metrics", a)));
        binds.extend(self.scheduler_ops_listen.map(|a| ("its scheduler's metrics", a)));
        binds.extend(self.scheduler_listen.map(|a| ("its scheduler's gRPC API", a)));
        binds
    }

    /// Refuses a frontend with no scheduler to ask (neither `--scheduler` nor etcd to find
    /// one: it would wait for ever), a scheduler in the frontend without etcd and NATS (it
    /// could learn of no prefill instance), and selection flags without one (nothing would
    /// read them).
    pub fn check_own_scheduler(&self) -> anyhow::Result<()> {
        if !self.scheduler_in_frontend && self.scheduler.is_empty() && self.discovery.etcd.is_none()
        {
            anyhow::bail!(
                "no scheduler to ask: give --scheduler ADDR, or --etcd and --nats (or HANDOFF_ETCD and HANDOFF_NATS) to find the replicas registered there"
            );
        }
        if self.scheduler_in_frontend && self.discovery.etcd.is_none() {
            anyhow::bail!(
                "--scheduler-in-frontend needs --etcd and --nats (or HANDOFF_ETCD and HANDOFF_NATS): its scheduler learns the prefill instances and their KV events there"
            );
        }
        let defaults = PolicyArgs::from_arg_matches(
            &PolicyArgs::augment_args(clap::Command::new("policy")).get_matches_from(["policy"]),
        )?;
        if !self.scheduler_in_frontend && self.policy != defaults {
            anyhow::bail!(
                "the selection flags (--policy, --kv-*, --prefix-load-factor, --max-queue-wait-ms) are the scheduler's: give them to `handoff scheduler`, or run one in this frontend with --scheduler-in-frontend"
            );
        }
        Ok(())
    }
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
    /// Operations listener: `/metrics`, `/livez`, `/readyz` (ready while registered, not
    /// while draining).
    #[arg(long)]
    pub ops_listen: Option<SocketAddr>,
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
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
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
    /// Operations listener: `/metrics`, `/livez`, `/readyz` apart from the public API (which
    /// then no longer serves them; without it, it does): plain HTTP whatever its TLS,
    /// outside its connection limit, and up while the frontend waits for a scheduler.
    #[arg(long)]
    pub ops_listen: Option<SocketAddr>,
    /// Host other processes (and `handoff ctl`) use to reach this one.
    #[arg(long, default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Scheduler replicas (host:port, comma-separated); default: every replica registered
    /// in discovery, followed as they come and go.
    #[arg(long, value_delimiter = ',')]
    pub scheduler: Vec<String>,
    /// Run a scheduler replica in this process and ask only it: no gRPC call to a scheduler
    /// per request. It follows the prefill instances, their KV events and the other
    /// replicas' load through discovery as `handoff scheduler` does (engines registered with
    /// `handoff register-engine` too), and takes the selection flags.
    #[arg(long, conflicts_with = "scheduler")]
    pub scheduler_in_frontend: bool,
    /// With --scheduler-in-frontend: the replica's operations listener (`/metrics`,
    /// `/livez`, `/readyz`).
    #[arg(long, requires = "scheduler_in_frontend")]
    pub scheduler_ops_listen: Option<SocketAddr>,
    /// With --scheduler-in-frontend: serve the replica's whole gRPC API here (as `handoff
    /// scheduler` does, with the cluster's token and TLS), for `handoff ctl --scheduler
    /// HOST:PORT` (instances, directory, drain). It stays out of discovery: only a process
    /// given this address calls it.
    #[arg(long, requires = "scheduler_in_frontend")]
    pub scheduler_listen: Option<SocketAddr>,
    /// Selection (with --scheduler-in-frontend).
    #[command(flatten, next_help_heading = "Selection (with --scheduler-in-frontend)")]
    pub policy: PolicyArgs,
    /// Decode tp size.
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// Also decode for vLLM prefill servers (registered `kind=vllm` with `side=`): their KV
    /// is READ over NIXL, so this needs NIXL's library and UCX's settings
    /// (`eval "$(scripts/fetch-nixl --env)"`).
    #[arg(long)]
    pub drive_vllm: bool,
    /// Seconds requests in flight get to finish on SIGTERM (drain: out of discovery and not
    /// ready at once, still serving).
    #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u64).range(0..=3600))]
    pub drain_secs: u64,
    /// The public listeners' TLS.
    #[command(flatten)]
    pub public_tls: PublicTlsArgs,
    /// What a client's request may take.
    #[command(flatten)]
    pub requests: RequestArgs,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
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
    #[arg(long, default_value_t = 2,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub prefills: usize,
    /// Scheduler replicas (the first on --scheduler-listen, the others on ephemeral ports);
    /// the frontend fails over between them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub schedulers: u16,
    /// The frontend asks the scheduler in its own process, not over gRPC (one replica; it
    /// is still served on --scheduler-listen, for `handoff ctl`).
    #[arg(long, conflicts_with = "schedulers")]
    pub scheduler_in_frontend: bool,
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
    /// The public listeners' TLS.
    #[command(flatten)]
    pub public_tls: PublicTlsArgs,
    /// What a client's request may take.
    #[command(flatten)]
    pub requests: RequestArgs,
    /// Selection.
    #[command(flatten)]
    pub policy: PolicyArgs,
    /// The engine.
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Discovery.
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
}

mod ctl;
mod discovery;
pub mod engine;
mod requests;

pub use ctl::{CtlArgs, CtlCommand};
pub use discovery::{
    BackendAccessArgs, DiscoveryArgs, PublicTlsArgs, TransferArg, nixl_environment,
};
pub use requests::RequestArgs;
#[cfg(test)]
mod tests;
