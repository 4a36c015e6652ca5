//! Settings of the frontend.

use handoff_core::tls::{ClusterTls, ServerTls};
use std::time::Duration;

use handoff_transfer::{InboxConfig, TransferKind};

/// Settings of the frontend.
#[derive(Debug, Clone)]
pub struct FrontendConfig {
    /// The decode's own attention tp size: KV arrives split across this many receive
    /// regions, one per decode rank, as a tp-sharded decode would hold it.
    pub decode_tp: u32,
    /// Attempts per request before the first token (each on another instance, fresh room).
    pub max_attempts: u32,
    /// Wait before the second attempt; each later one waits 1.5x longer (+-20 % jitter),
    /// up to `max_backoff`, and never past the deadline.
    pub backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
    /// Whole-request deadline when the request names none, and the longest one it may name.
    pub request_timeout: Duration,
    /// Deadline of one attempt beyond the queue wait the scheduler expects for it (bounded by
    /// the request's deadline): queueing is not failure, a silent instance is.
    pub attempt_timeout: Duration,
    /// Longest wait for one scheduler replica's selection before asking another.
    pub select_timeout: Duration,
    /// Tokens generated when a text or token-id request names no `max_tokens` (a chat may
    /// fill the context).
    pub default_max_tokens: u32,
    /// Requests served at once; more are refused at once (429 / `RESOURCE_EXHAUSTED`).
    pub max_concurrent: usize,
    /// Sequences decoded at once; more wait for a slot in turn, and a request
    /// whose wait would leave it too little time is refused at once (429 /
    /// `RESOURCE_EXHAUSTED`; see [`crate::decoding`]). `None`: the engine's decode batch, or
    /// no bound if it names none.
    pub max_decoding: Option<usize>,
    /// How long a stream's decode, as far ahead of its client as it may run, waits for the
    /// client to take its next message (each message taken starts the wait again): then the
    /// decode stops (its slot and KV given back), what it decoded waits for the client until
    /// the deadline, and the stream ends in `RESOURCE_EXHAUSTED` if the client took it all by
    /// then, else `DEADLINE_EXCEEDED` (a client with a shut window held a slot until its
    /// deadline).
    pub client_stall: Duration,
    /// The public listeners' connections: open at once (on the HTTP API and on gRPC
    /// Generate, each), and how long an HTTP request's head may take.
    pub http: handoff_core::http::HttpLimits,
    /// The frontend's transfer backend.
    pub transfer: TransferKind,
    /// Bounds of its receive inbox.
    pub inbox: InboxConfig,
    /// The cluster's token: sent in transfer handshakes and hellos, and as a bearer token on
    /// calls to the scheduler and prefill services.
    pub transfer_token: Option<String>,
    /// The cluster's mutual TLS on calls to the scheduler, prefill and directory services
    /// (the transfer's own TLS is part of `transfer`).
    pub tls: Option<ClusterTls>,
    /// The public listeners' certificate (Generate gRPC and the HTTP API): clients then
    /// connect with TLS and need no certificate of their own.
    pub public_tls: Option<ServerTls>,
    /// Ready (`/readyz`) only once a prefill instance is registered in discovery: off when
    /// the frontend follows no registry that prefills register in (a static `--scheduler`
    /// without etcd), where it learns prefills from its selections alone.
    pub require_registered_prefill: bool,
    /// Drive vLLM prefill servers (protocol `vllm`: their KV READ over NIXL, whose library
    /// and UCX settings the process must have): the frontend asks schedulers for them too.
    pub drive_vllm: bool,
    /// Serve `/metrics`, `/livez` and `/readyz` on the public HTTP API too: off when they
    /// have a listener of their own (`--ops-listen`), so clients cannot read them.
    pub ops_on_public: bool,
}

impl Default for FrontendConfig {
    fn default() -> Self {
        FrontendConfig {
            decode_tp: 1,
            max_attempts: 5,
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(30),
            request_timeout: Duration::from_secs(60),
            attempt_timeout: Duration::from_secs(15),
            select_timeout: Duration::from_secs(1),
            default_max_tokens: 16,
            max_concurrent: 4096,
            max_decoding: None,
            client_stall: Duration::from_secs(10),
            http: handoff_core::http::HttpLimits::default(),
            transfer: TransferKind::loopback(),
            inbox: InboxConfig::default(),
            transfer_token: None,
            tls: None,
            public_tls: None,
            require_registered_prefill: true,
            drive_vllm: false,
            ops_on_public: true,
        }
    }
}
