//! What a client's request may take at the frontend, and what the frontend holds for them.

use clap::Args;

/// What a client's request may take, at the frontend.
#[derive(Debug, Clone, Args)]
pub struct RequestArgs {
    /// Seconds a request has when it names no deadline, and at most when it names one (gRPC
    /// `deadline_ms`; the HTTP API's requests always take this): past it, a request fails
    /// with 504 / `DEADLINE_EXCEEDED` (a chat without `max_tokens` ends with
    /// `finish_reason: "length"`).
    #[arg(long, default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub request_timeout_secs: u64,
    /// Client connections open at once on each public listener (the HTTP API, gRPC
    /// Generate); past it, new ones wait in the listen backlog until one closes.
    #[arg(long, alias = "http-max-connections", default_value_t = 16_384, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_connections: u32,
    /// Seconds an HTTP connection may wait for a request's head, an idle kept-alive one too,
    /// and a gRPC connection may go without a byte from its client (45 s at least: a client
    /// answers the server's pings, sent after 30 s without a word): then it is closed. Keep it above the idle timeout of a
    /// load balancer in front (AWS's is 60 s), which would otherwise reuse a connection
    /// being closed.
    #[arg(long, default_value_t = 90, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    pub http_idle_secs: u64,
    /// MiB the request bodies being received may hold at once on each public listener
    /// (bodies are buffered whole before they are read); a body whose next bytes would pass
    /// it is refused (429 / `RESOURCE_EXHAUSTED`). At least 32: room for the largest body.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(32..=1_048_576))]
    pub max_receiving_mib: u32,
    /// Sequences the frontend decodes at once (by default the engine's batch: SmolLM2
    /// advances 32 a pass); more wait for a slot in turn, and a request whose wait
    /// would leave it too little of its deadline is refused at once (429 /
    /// `RESOURCE_EXHAUSTED`).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=1_000_000))]
    pub max_decoding: Option<u32>,
    /// MiB of prompt KV the frontend holds at once, receiving it from prefills and decoding
    /// over it; a request whose KV would pass it is refused at once (429 /
    /// `RESOURCE_EXHAUSTED`, "decode KV budget full"). Keep it under the process's memory
    /// limit, with room for the model, the connections' buffers and freed memory not yet
    /// returned (a minute): past the limit the process is killed with every stream on it.
    #[arg(long, default_value_t = 8192, value_parser = clap::value_parser!(u64).range(1..=1 << 30))]
    pub max_kv_mib: u64,
}

impl RequestArgs {
    /// The whole-request deadline of requests that name none.
    pub fn request_timeout(&self) -> std::time::Duration {
        std::time::Duration::from_secs(self.request_timeout_secs)
    }

    /// The bound on sequences decoded at once, if one is given.
    pub fn max_decoding(&self) -> Option<usize> {
        self.max_decoding.map(|n| n as usize)
    }

    /// The receive inbox's bounds: at most `--max-kv-mib` in all, and in one request.
    pub fn inbox(&self) -> handoff_transfer::InboxConfig {
        let d = handoff_transfer::InboxConfig::default();
        let total = self.max_kv_mib << 20;
        handoff_transfer::InboxConfig {
            max_total_bytes: total,
            max_region_bytes: d.max_region_bytes.min(total),
            ..d
        }
    }

    /// The HTTP API's connection bounds.
    pub fn http(&self) -> handoff_core::http::HttpLimits {
        handoff_core::http::HttpLimits {
            max_connections: self.max_connections as usize,
            head_timeout: std::time::Duration::from_secs(self.http_idle_secs),
            // Never below a ping's round (see the field's docs).
            grpc_quiet: std::time::Duration::from_secs(self.http_idle_secs.max(45)),
            receiving_bytes: (self.max_receiving_mib as usize) << 20,
            ..Default::default()
        }
    }
}
