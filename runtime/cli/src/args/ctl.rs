//! `handoff ctl`'s arguments.

use clap::{Args, Subcommand};

use super::DiscoveryArgs;

/// `handoff ctl`.
#[derive(Debug, Clone, Args)]
pub struct CtlArgs {
    /// A scheduler replica to ask (host:port); default: the replicas registered in etcd.
    #[arg(long, global = true)]
    pub scheduler: Option<String>,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// The CA (PEM) that signed the frontends' public certificate (their --public-tls-cert):
    /// `trace` then asks them over HTTPS, checking that the certificate names the host asked
    /// (or --public-name).
    #[arg(long, global = true)]
    pub public_ca: Option<std::path::PathBuf>,
    /// The name the frontends' public certificate must hold, instead of the host of the
    /// address asked (registered addresses are pod IPs; a public certificate names the
    /// Service).
    #[arg(long, global = true)]
    pub public_name: Option<String>,
    /// A client certificate (PEM) for frontends that require one (--public-tls-client-ca),
    /// with --public-key.
    #[arg(long, global = true)]
    pub public_cert: Option<std::path::PathBuf>,
    /// Its private key (PEM). (These flags' pairings are checked when ctl starts: clap
    /// checks global flags before it gathers them from both sides of the subcommand.)
    #[arg(long, global = true)]
    pub public_key: Option<std::path::PathBuf>,
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
