//! Where a process finds the others, how it authenticates to them, and how its KV moves.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use handoff_core::tls::ServerTls;
use handoff_discovery::ServerAccess;
use handoff_transfer::TransferKind;

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
    /// Lease TTL of registrations, in seconds (kept alive every TTL/3): 2 to 300 (etcd grants
    /// no less than about 2, and a dead instance stays listed for up to a TTL).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u64).range(2..=300))]
    pub lease_ttl_secs: u64,
    /// The cluster's shared secret: required as a bearer token on bootstrap directory writes,
    /// on the scheduler and prefill gRPC services, and on every KV transfer connection and
    /// handshake; sent by this process on its own.
    /// An empty one (`HANDOFF_TOKEN=`) is refused, not taken as a secret anyone can send.
    #[arg(long, env = "HANDOFF_TOKEN", hide_env_values = true,
          value_parser = clap::builder::NonEmptyStringValueParser::new())]
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
    /// How often the certificate files (--tls-* and --public-tls-*) are read again, in
    /// seconds: changed and usable ones (a renewal, a CA bundle for a CA change) are taken at
    /// the next handshake, with no restart; unusable ones are refused and logged, and the
    /// ones in use kept. 0: read once, at startup. The etcd client's (--etcd-*) likewise: a new
    /// etcd client is made with them at once, used once etcd has answered it; NATS's library
    /// reads its own at each reconnect.
    #[arg(long, default_value_t = 60, value_name = "SECS",
        value_parser = clap::value_parser!(u64).range(0..=86_400))]
    pub tls_reload_secs: u64,
    /// The cluster's TLS settings once read: one per process, so a reload reaches every part
    /// that uses them.
    #[arg(skip)]
    pub cluster_tls_read: std::sync::OnceLock<Option<handoff_core::tls::ClusterTls>>,
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
    /// With --transfer tcp, send every KV byte over the socket, even to a peer on this host
    /// (by default those go through shared memory, unless transfer TLS is on).
    #[arg(long)]
    pub no_shared_memory: bool,
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
    /// How to reach etcd, its TLS files read again every `tls_reload` (`None`: once).
    pub fn etcd(&self, tls_reload: Option<std::time::Duration>) -> ServerAccess {
        ServerAccess {
            ca: self.etcd_ca.clone(),
            identity: self.etcd_cert.clone().zip(self.etcd_key.clone()),
            user: self.etcd_user.clone().zip(self.etcd_password.clone()),
            credentials: None,
            tls_reload,
        }
    }

    /// How to reach NATS.
    pub fn nats(&self) -> ServerAccess {
        ServerAccess {
            ca: self.nats_ca.clone(),
            identity: self.nats_cert.clone().zip(self.nats_key.clone()),
            user: self.nats_user.clone().zip(self.nats_password.clone()),
            credentials: self.nats_creds.clone(),
            tls_reload: None,
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
    /// The certificate once read (one per process, so a reload reaches both listeners).
    #[arg(skip)]
    pub read: std::sync::OnceLock<Option<ServerTls>>,
}

impl PublicTlsArgs {
    /// The certificate, when the flags give one (read once: later calls share it).
    pub fn server_tls(&self) -> anyhow::Result<Option<ServerTls>> {
        if let Some(read) = self.read.get() {
            return Ok(read.clone());
        }
        let tls = match (&self.public_tls_cert, &self.public_tls_key) {
            (Some(c), Some(k)) => {
                Some(ServerTls::from_files(c, k, self.public_tls_client_ca.as_deref())?)
            }
            _ => None,
        };
        Ok(self.read.get_or_init(|| tls).clone())
    }
}

impl DiscoveryArgs {
    /// The cluster's mutual TLS, when the flags give it (read once: later calls share it).
    pub fn cluster_tls(&self) -> anyhow::Result<Option<handoff_core::tls::ClusterTls>> {
        if let Some(read) = self.cluster_tls_read.get() {
            return Ok(read.clone());
        }
        let tls = match (&self.tls_cert, &self.tls_key, &self.tls_ca) {
            (Some(c), Some(k), Some(ca)) => {
                Some(handoff_core::tls::ClusterTls::from_files(c, k, ca)?)
            }
            _ => None,
        };
        Ok(self.cluster_tls_read.get_or_init(|| tls).clone())
    }

    /// How often certificate files are read again (`None`: once, at startup).
    pub fn tls_reload(&self) -> Option<std::time::Duration> {
        let every = std::time::Duration::from_secs(self.tls_reload_secs);
        (!every.is_zero()).then_some(every)
    }

    /// Reads this process's certificate files again every --tls-reload-secs until shutdown:
    /// those it read ([`DiscoveryArgs::cluster_tls`], and `public`'s when given), unless 0.
    pub fn watch_tls(&self, public: Option<&PublicTlsArgs>, tasks: &handoff_core::Tasks) {
        use handoff_core::tls::reload::{Reloadable, watch_on};
        let cluster = self.cluster_tls_read.get().cloned().flatten().map(Reloadable::Cluster);
        let public = public.and_then(|p| p.read.get().cloned().flatten()).map(Reloadable::Public);
        let held: Vec<Reloadable> = cluster.into_iter().chain(public).collect();
        if let Some(every) = self.tls_reload() {
            watch_on(tasks, held, every);
        }
    }

    /// The transfer backend on --transfer-bind: tcp (with the flags' TLS), mooncake or nixl; `fake`
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
                let (tls, shared_memory) = (self.cluster_tls()?, !self.no_shared_memory);
                TransferKind::Tcp { bind_ip, advertise_ip, tls, shared_memory }
            }
            TransferArg::Mooncake if self.tls_cert.is_some() => anyhow::bail!(
                "--transfer mooncake cannot use --tls-cert: Mooncake's wire has no TLS (use --transfer tcp for mutual TLS on KV)"
            ),
            TransferArg::Mooncake => TransferKind::Mooncake { bind_ip, advertise_ip },
            TransferArg::Nixl if self.tls_cert.is_some() => anyhow::bail!(
                "--transfer nixl cannot use --tls-cert: NIXL over UCX/TCP has no TLS (use --transfer tcp for mutual TLS on KV)"
            ),
            TransferArg::Nixl => {
                nixl_environment("--transfer nixl")?;
                TransferKind::Nixl { bind_ip, advertise_ip }
            }
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

/// Refuses `what` (a flag that starts a NIXL agent) without `UCX_MODULES`: the NIXL wheel's
/// UCX loads its InfiniBand modules by default, and with them the process crashes at exit.
pub fn nixl_environment(what: &str) -> anyhow::Result<()> {
    if std::env::var_os("UCX_MODULES").is_none() {
        anyhow::bail!(
            "{what} needs UCX_MODULES set: the NIXL wheel's UCX loads its InfiniBand modules by default, and with them the process crashes at exit (without RDMA set UCX_MODULES=^ib; `eval \"$(scripts/fetch-nixl --env)\"` sets it with NIXL's library path)"
        );
    }
    Ok(())
}

/// Which transfer backend agents use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum TransferArg {
    /// Real bytes over TCP sockets, handoff's own framing (token, optional mutual TLS).
    Tcp,
    /// Mooncake Transfer Engine's TCP wire (interoperates with Mooncake peers; no TLS).
    Mooncake,
    /// NIXL WRITEs over UCX (TCP here), through the library `scripts/fetch-nixl` installs
    /// (put its directory on LD_LIBRARY_PATH); no TLS.
    Nixl,
    /// In-process, no sockets (`handoff up` only).
    Fake,
}
