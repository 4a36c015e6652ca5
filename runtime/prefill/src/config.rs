//! Settings of a prefill instance.

use std::net::SocketAddr;
use std::time::Duration;

use handoff_bootstrap::DirectoryConfig;
use handoff_core::InstanceId;
use handoff_core::tls::ClusterTls;
use handoff_transfer::{InboxConfig, TransferKind};

/// Settings of a prefill instance.
#[derive(Debug, Clone)]
pub struct PrefillConfig {
    /// Its id in discovery.
    pub id: InstanceId,
    /// Data-parallel ranks (each with its own prefix cache and engine slot).
    pub dp: u32,
    /// Tensor-parallel ranks (KV heads split between them).
    pub tp: u32,
    /// Pipeline ranks (layers split between them).
    pub pp: u32,
    /// Context-parallel ranks (register in the directory; cp rank 0 sends).
    pub cp: u32,
    /// Where the bootstrap directory listens.
    pub bootstrap_bind: SocketAddr,
    /// Where the Prefill gRPC service listens.
    pub grpc_bind: SocketAddr,
    /// Host other processes use to reach this instance's listeners.
    pub advertise_host: String,
    /// The ranks' transfer backend.
    pub transfer: TransferKind,
    /// Bounds and token of the ranks' transfer inboxes.
    pub inbox: InboxConfig,
    /// The directory's settings (token, peer version, bounds; its TLS is taken from `tls`).
    pub directory: DirectoryConfig,
    /// The cluster's mutual TLS on the gRPC and directory listeners, and on the ranks' own
    /// registrations.
    pub tls: Option<ClusterTls>,
    /// Prefix cache budget per dp rank, in bytes.
    pub cache_bytes_per_dp: usize,
    /// Requests queued per dp rank before new ones are refused.
    pub max_queue_per_dp: usize,
    /// Longest a request may wait for its decode's handshakes.
    pub handshake_timeout: Duration,
    /// How often the instance publishes a heartbeat with its load.
    pub heartbeat_interval: Duration,
    /// KV events and heartbeats waiting to be published; beyond it they are dropped (a
    /// dropped KV event shows as a sequence gap and schedulers resync).
    pub publish_queue: usize,
    /// Longest one publish may take before the next message is tried.
    pub publish_timeout: Duration,
}

impl PrefillConfig {
    /// Requires `token` on directory writes and transfer handshakes (and uses it for the
    /// ranks' own registrations).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.directory.token = token.clone();
        self.inbox.token = token;
        self
    }
}

impl Default for PrefillConfig {
    fn default() -> Self {
        PrefillConfig {
            id: InstanceId::random("prefill"),
            dp: 1,
            tp: 1,
            pp: 1,
            cp: 1,
            bootstrap_bind: ([127, 0, 0, 1], 8998).into(),
            grpc_bind: ([127, 0, 0, 1], 50060).into(),
            advertise_host: "127.0.0.1".into(),
            transfer: TransferKind::loopback(),
            inbox: InboxConfig::default(),
            directory: DirectoryConfig::default(),
            tls: None,
            cache_bytes_per_dp: 256 << 20,
            max_queue_per_dp: 1024,
            handshake_timeout: Duration::from_secs(10),
            heartbeat_interval: Duration::from_secs(1),
            publish_queue: 4096,
            publish_timeout: Duration::from_secs(1),
        }
    }
}
