//! KV-cache events of real engines (vLLM, SGLang), for the global index.
//!
//! - [`decode`] — a `KVEventBatch` payload, read tolerantly: map-tagged events (vLLM 0.24
//!   and later, SGLang 0.5.21 and later) and array-tagged ones (earlier), unknown fields
//!   ignored, hashes as unsigned, signed or bytes.
//! - [`chain`] — [`WorkerChains`]: one engine worker's blocks mapped onto handoff's own
//!   chained page hashes, computed from each event's tokens (engine hashes are only handles
//!   for parents and removals).
//! - [`subscriber`] — [`EngineStream`]: an engine endpoint's events in order over ZMQ, gaps
//!   filled by replay or by clearing and rebuilding the worker.
//!
//! Wire facts: `../shared/interop/kv-events.md`.

pub mod chain;
pub mod decode;
pub mod subscriber;

pub use chain::{IndexOp, WorkerChains};
pub use decode::{Batch, EngineHash, Event, EventsError, decode_batch};
pub use subscriber::{EngineEndpoint, EngineStream, StreamStats};
