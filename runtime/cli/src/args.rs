//! The command line: the one place handoff reads its configuration (flags, and the
//! environment variables they name).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use handoff_core::tls::ServerTls;
use handoff_discovery::ServerAccess;
use handoff_scheduler::policy::{KvAwareWeights, PolicyParams};
use handoff_scheduler::{PolicyKind, SchedulerConfig};
use handoff_transfer::TransferKind;

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
}

/// `handoff ctl`.
#[derive(Debug, Clone, Args)]
pub struct CtlArgs {
    /// A scheduler replica to ask (host:port); default: the replicas registered in etcd.
    #[arg(long, global = true)]
    pub scheduler: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// How to reach the cluster (etcd/NATS, token, TLS).
    #[command(flatten)]
    pub discovery: DiscoveryArgs,
    /// What to ask.
    #[command(subcommand)]
    pub command: CtlCommand,
}

/// What `handoff ctl` asks.
#[derive(Debug, Clone, Subcommand)]
pub enum CtlCommand {
    /// Every instance: role, dp/tp, load, breaker, last heard, indexed blocks.
    Instances,
    /// An instance's bootstrap directory: its rank table and whether it is complete.
    Directory {
        /// The instance id.
        id: String,
    },
    /// Takes a prefill instance out of routing and waits for its requests in flight; the
    /// process keeps running until stopped.
    Drain {
        /// The instance id.
        id: String,
        /// Seconds to wait for its requests in flight.
        #[arg(long, default_value_t = 30, value_parser = clap::value_parser!(u32).range(0..=3600))]
        grace_secs: u32,
    },
    /// A recent request's evidence, by one of its rooms: attempts, stages, error codes.
    Trace {
        /// The `bootstrap_room` (decimal), as in a request's evidence or a log line.
        room: u64,
        /// A frontend's HTTP address (host:port) to ask; default: every frontend registered.
        #[arg(long)]
        frontend: Vec<String>,
    },
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
    /// The cluster's shared secret: required as a bearer token on bootstrap directory writes,
    /// on the scheduler and prefill gRPC services, and on every KV transfer connection and
    /// handshake; sent by this process on its own.
    #[arg(long, env = "HANDOFF_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Let a role without a token listen on a non-loopback address (anyone who can reach
    /// it can then write directories and open transfer connections).
    #[arg(long)]
    pub insecure: bool,
    /// This process's certificate chain (PEM): with --tls-key and --tls-ca, the cluster's own
    /// traffic (KV transfers, the scheduler and prefill gRPC services, the bootstrap
    /// directories) runs over mutual TLS with the cluster's CA. The certificate must name the
    /// host the others dial (the advertised host).
    #[arg(long, requires_all = ["tls_key", "tls_ca"])]
    pub tls_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires_all = ["tls_cert", "tls_ca"])]
    pub tls_key: Option<std::path::PathBuf>,
    /// The cluster's CA certificate (PEM): peers must hold a certificate it signed.
    #[arg(long, requires_all = ["tls_cert", "tls_key"])]
    pub tls_ca: Option<std::path::PathBuf>,
    /// TLS and credentials for etcd and NATS.
    #[command(flatten)]
    pub access: BackendAccessArgs,
    /// How KV moves between prefill ranks and the frontend (prefill, frontend and up; the
    /// scheduler moves no KV and ignores it).
    #[arg(long, value_enum, default_value_t = TransferArg::Tcp)]
    pub transfer: TransferArg,
    /// The address KV transfer listeners bind (each on an ephemeral port). Beyond loopback
    /// (another host, a pod), give this host's address, or 0.0.0.0 with --transfer-advertise.
    #[arg(long, default_value = "127.0.0.1")]
    pub transfer_bind: std::net::IpAddr,
    /// The host peers dial for this process's KV transfers (default: --transfer-bind).
    #[arg(long)]
    pub transfer_advertise: Option<String>,
}

/// TLS and credentials for the etcd and NATS servers, handed to their client libraries.
#[derive(Debug, Clone, Default, Args)]
pub struct BackendAccessArgs {
    /// The CA of etcd's server certificate (PEM); endpoints are then `https://`.
    #[arg(long)]
    pub etcd_ca: Option<PathBuf>,
    /// A client certificate for etcd (PEM), with --etcd-key.
    #[arg(long, requires = "etcd_key")]
    pub etcd_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "etcd_cert")]
    pub etcd_key: Option<PathBuf>,
    /// etcd user, with --etcd-password.
    #[arg(long, env = "HANDOFF_ETCD_USER", requires = "etcd_password")]
    pub etcd_user: Option<String>,
    /// etcd password.
    #[arg(long, env = "HANDOFF_ETCD_PASSWORD", hide_env_values = true, requires = "etcd_user")]
    pub etcd_password: Option<String>,
    /// The CA of the NATS server's certificate (PEM); the connection then requires TLS.
    #[arg(long)]
    pub nats_ca: Option<PathBuf>,
    /// A client certificate for NATS (PEM), with --nats-key.
    #[arg(long, requires = "nats_key")]
    pub nats_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "nats_cert")]
    pub nats_key: Option<PathBuf>,
    /// NATS user, with --nats-password.
    #[arg(long, env = "HANDOFF_NATS_USER", requires = "nats_password")]
    pub nats_user: Option<String>,
    /// NATS password.
    #[arg(long, env = "HANDOFF_NATS_PASSWORD", hide_env_values = true, requires = "nats_user")]
    pub nats_password: Option<String>,
    /// A NATS credentials file (JWT and NKey seed).
    #[arg(long, env = "HANDOFF_NATS_CREDS")]
    pub nats_creds: Option<PathBuf>,
}

impl BackendAccessArgs {
    /// How to reach etcd.
    pub fn etcd(&self) -> ServerAccess {
        ServerAccess {
            ca: self.etcd_ca.clone(),
            identity: self.etcd_cert.clone().zip(self.etcd_key.clone()),
            user: self.etcd_user.clone().zip(self.etcd_password.clone()),
            credentials: None,
        }
    }

    /// How to reach NATS.
    pub fn nats(&self) -> ServerAccess {
        ServerAccess {
            ca: self.nats_ca.clone(),
            identity: self.nats_cert.clone().zip(self.nats_key.clone()),
            user: self.nats_user.clone().zip(self.nats_password.clone()),
            credentials: self.nats_creds.clone(),
        }
    }
}

/// The public listeners' certificate (the frontend's Generate gRPC and OpenAI HTTP).
#[derive(Debug, Clone, Default, Args)]
pub struct PublicTlsArgs {
    /// Certificate chain (PEM) of the public listeners: with --public-tls-key, clients
    /// connect with TLS (https, grpcs) and need no certificate of their own.
    #[arg(long, requires = "public_tls_key")]
    pub public_tls_cert: Option<PathBuf>,
    /// Its private key (PEM).
    #[arg(long, requires = "public_tls_cert")]
    pub public_tls_key: Option<PathBuf>,
    /// A CA (PEM) whose certificates clients of the public listeners must present (mutual
    /// TLS for clients); without it, clients need none.
    #[arg(long, requires = "public_tls_cert")]
    pub public_tls_client_ca: Option<PathBuf>,
}

impl PublicTlsArgs {
    /// The certificate, when the flags give one.
    pub fn server_tls(&self) -> anyhow::Result<Option<ServerTls>> {
        match (&self.public_tls_cert, &self.public_tls_key) {
            (Some(c), Some(k)) => {
                Ok(Some(ServerTls::from_files(c, k, self.public_tls_client_ca.as_deref())?))
            }
            _ => Ok(None),
        }
    }
}

impl DiscoveryArgs {
    /// The cluster's mutual TLS, when the flags give it.
    pub fn cluster_tls(&self) -> anyhow::Result<Option<handoff_core::tls::ClusterTls>> {
        match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(ca)) => {
                Ok(Some(handoff_core::tls::ClusterTls::from_files(c, k, ca)?))
            }
            _ => Ok(None),
        }
    }

    /// The transfer backend on --transfer-bind: tcp (with the flags' TLS) or mooncake; `fake`
    /// only within one process (`handoff up`).
    pub fn transfer(&self) -> anyhow::Result<TransferKind> {
        let bind_ip = self.transfer_bind;
        if bind_ip.is_unspecified() && self.transfer_advertise.is_none() {
            anyhow::bail!(
                "--transfer-bind {bind_ip} needs --transfer-advertise: peers cannot dial an unspecified address"
            );
        }
        let advertise_ip = self.transfer_advertise.clone();
        Ok(match self.transfer {
            TransferArg::Tcp => {
                TransferKind::Tcp { bind_ip, advertise_ip, tls: self.cluster_tls()? }
            }
            TransferArg::Mooncake if self.tls_cert.is_some() => anyhow::bail!(
                "--transfer mooncake cannot use --tls-cert: Mooncake's wire has no TLS (use --transfer tcp for mutual TLS on KV)"
            ),
            TransferArg::Mooncake => TransferKind::Mooncake { bind_ip, advertise_ip },
            TransferArg::Fake => TransferKind::Fake(handoff_transfer::FakeNetwork::new()),
        })
    }

    /// As [`DiscoveryArgs::transfer`], refusing `fake` (its agents live in one process).
    pub fn network_transfer(&self) -> anyhow::Result<TransferKind> {
        if self.transfer == TransferArg::Fake {
            anyhow::bail!("--transfer fake works only within one process (handoff up)");
        }
        self.transfer()
    }
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
#[derive(Debug, Clone, Args)]
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
    /// Host other processes (and `handoff ctl`) use to reach this one.
    #[arg(long, default_value = "127.0.0.1")]
    pub advertise_host: String,
    /// Scheduler replicas (host:port, comma-separated); default: every replica registered
    /// in discovery, followed as they come and go.
    #[arg(long, value_delimiter = ',')]
    pub scheduler: Vec<String>,
    /// Decode tp size.
    #[arg(long, default_value_t = 1)]
    pub decode_tp: u32,
    /// The public listeners' TLS.
    #[command(flatten)]
    pub public_tls: PublicTlsArgs,
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
    /// Real bytes over TCP sockets, handoff's own framing (token, optional mutual TLS).
    Tcp,
    /// Mooncake Transfer Engine's TCP wire (interoperates with Mooncake peers; no TLS).
    Mooncake,
    /// In-process, no sockets (`handoff up` only).
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
    /// Scheduler replicas (the first on --scheduler-listen, the others on ephemeral ports);
    /// the frontend fails over between them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    pub schedulers: u16,
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

pub mod engine;
#[cfg(test)]
mod tests;
