//! handoff's discovery seams.
//!
//! - [`Registry`] (this file): instances with leases; a watch is a stream of
//!   [`Update::Reset`] / [`Update::Add`] / [`Update::Remove`].
//! - [`EventBus`] (this file): publish/subscribe by subject prefix.
//! - [`access`] — [`ServerAccess`]: TLS and credentials for the etcd and NATS servers.
//! - [`events`] — what travels on the bus (KV events) and the subject layout.
//! - [`memory`] — in-process backends, the real backend of single-node mode.
//! - [`etcd`] — [`EtcdRegistry`]: keys under leases kept alive, prefix watches from a snapshot.
//! - [`nats`] — [`NatsBus`]: subjects with request/reply.
//! - [`snapshot`] — [`Snapshots`]: an instance's recent KV snapshots, served in pages.
//! - [`publisher`] — [`Publisher`]: a bounded queue in front of a bus, drained by one task
//!   with a publish timeout, so no caller waits on the bus.

pub mod access;
mod error;
pub mod etcd;
pub mod events;
pub mod memory;
pub mod nats;
pub mod publisher;
pub mod snapshot;

use async_trait::async_trait;
use bytes::Bytes;
use futures::stream::BoxStream;
use handoff_core::InstanceId;
use serde::{Deserialize, Serialize};

pub use access::ServerAccess;
pub use error::DiscoveryError;
pub use etcd::EtcdRegistry;
pub use events::{
    Heartbeat, KvEvent, KvEventKind, KvSnapshot, LoadReport, RoutedPrefix, SnapshotAsk, WorkerLoad,
};
pub use memory::{MemoryBus, MemoryRegistry};
pub use nats::NatsBus;
pub use publisher::Publisher;
pub use snapshot::Snapshots;

/// What an instance does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A prefill instance.
    Prefill,
    /// A decode frontend.
    Frontend,
    /// A scheduler.
    Scheduler,
    /// An engine instance (vLLM, SGLang) that schedulers route to by its KV events; its
    /// registration carries [`EngineEndpoints`].
    Engine,
}

/// Where an engine instance publishes its KV events, for the schedulers that follow it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EngineEndpoints {
    /// What it is (`vllm`, `sglang`, ...; for people).
    #[serde(default)]
    pub kind: String,
    /// Each dp rank's KV event PUB socket (`tcp://host:port`), in rank order.
    pub events: Vec<String>,
    /// Each dp rank's replay ROUTER socket, in rank order (empty: none).
    #[serde(default)]
    pub replay: Vec<String>,
    /// The topic to subscribe to (empty: every topic).
    #[serde(default)]
    pub topic: String,
    /// `host:port` answering `GET /health` while the engine is up.
    #[serde(default)]
    pub health: Option<String>,
}

/// An instance's parallel topology.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Topology {
    /// Data-parallel ranks.
    pub dp: u32,
    /// Tensor-parallel ranks.
    pub tp: u32,
    /// Pipeline ranks.
    pub pp: u32,
    /// Context-parallel ranks.
    pub cp: u32,
}

/// One registered instance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    /// Its id.
    pub id: InstanceId,
    /// What it does.
    pub role: Role,
    /// The model it serves.
    pub model: String,
    /// host:port of its bootstrap directory (prefill); a frontend's HTTP API.
    pub bootstrap_addr: String,
    /// host:port of its gRPC service; an engine's: where routers send its requests.
    pub grpc_addr: String,
    /// Its ranks.
    pub topology: Topology,
    /// Tokens per KV page.
    pub page_size: u32,
    /// Bumped on every re-registration, so caches keyed by it are invalidated.
    pub version: u64,
    /// For an engine instance (role engine): where it publishes its KV events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<Box<EngineEndpoints>>,
}

impl Instance {
    /// The name of the protocol it is driven by: `handoff` (a handoff prefill); `sglang`
    /// or `vllm` for such an engine registered with its bootstrap directory (SGLang's) or
    /// NIXL side channel (vLLM's, kept where SGLang's directory is), which a frontend can
    /// drive; `engine` for any other engine, which routers drive over its own API.
    pub fn protocol_name(&self) -> &'static str {
        match &self.engine {
            None => "handoff",
            Some(e) if e.kind == "sglang" && !self.bootstrap_addr.is_empty() => "sglang",
            Some(e) if e.kind == "vllm" && !self.bootstrap_addr.is_empty() => "vllm",
            Some(_) => "engine",
        }
    }

    /// A fixture for tests and benches: `id` in `role`, serving the model `mock` at loopback
    /// addresses nothing listens on (bootstrap port 1, gRPC port 2), one rank of each kind,
    /// pages of 16 tokens, version 1. Change fields with struct update syntax.
    pub fn fixture(id: InstanceId, role: Role) -> Instance {
        Instance {
            id,
            role,
            model: "mock".into(),
            bootstrap_addr: "127.0.0.1:1".into(),
            grpc_addr: "127.0.0.1:2".into(),
            topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
            page_size: 16,
            version: 1,
            engine: None,
        }
    }
}

/// A change in the set of instances of one role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// The complete set, replacing whatever the watcher knew (first update; after a
    /// reconnect or missed updates).
    Reset(Vec<Instance>),
    /// An instance appeared or changed.
    Add(Instance),
    /// An instance is gone.
    Remove(InstanceId),
}

/// A registry of instances.
#[async_trait]
pub trait Registry: Send + Sync + 'static {
    /// Registers (or re-registers) an instance; it stays until deregistered or its lease
    /// lapses.
    async fn register(&self, instance: Instance) -> Result<(), DiscoveryError>;

    /// Removes an instance.
    async fn deregister(&self, id: &InstanceId) -> Result<(), DiscoveryError>;

    /// The instances of `role`: a `Reset` first, then changes.
    async fn watch(&self, role: Role) -> Result<BoxStream<'static, Update>, DiscoveryError>;
}

/// A message on the bus.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    /// Its subject.
    pub subject: String,
    /// Its payload.
    pub payload: Bytes,
    /// Where a request wants its answer.
    pub reply: Option<String>,
}

/// Publish/subscribe.
#[async_trait]
pub trait EventBus: Send + Sync + 'static {
    /// Publishes `payload` on `subject`.
    async fn publish(&self, subject: String, payload: Bytes) -> Result<(), DiscoveryError>;

    /// Messages whose subject starts with `prefix` (a prefix ends with `.`; anything else is
    /// one exact subject), from now on.
    async fn subscribe(&self, prefix: &str) -> Result<BoxStream<'static, Message>, DiscoveryError>;

    /// Sends a request on `subject` and waits up to `timeout` for the first answer.
    async fn request(
        &self,
        subject: String,
        payload: Bytes,
        timeout: std::time::Duration,
    ) -> Result<Bytes, DiscoveryError>;

    /// Whether it is connected to its server now (an in-memory bus always is): what is
    /// published while not may never arrive.
    fn connected(&self) -> bool {
        true
    }
}

/// Whether `subject` is covered by a subscription to `prefix`.
pub fn subject_matches(prefix: &str, subject: &str) -> bool {
    if prefix.ends_with('.') { subject.starts_with(prefix) } else { subject == prefix }
}
