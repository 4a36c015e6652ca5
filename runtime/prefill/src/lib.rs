//! One prefill instance.
//!
//! - [`config`] — [`PrefillConfig`], its topology, addresses and bounds.
//! - [`cache`] — [`PrefixCache`], KV pages keyed by block hash, LRU under a byte budget,
//!   one per dp rank.
//! - [`rank`] — a rank (dp, cp, tp, pp) with its transfer agent; sends its KV shard to the
//!   decode ranks that connected for a room.
//! - [`service`] — the `handoff.v1.Prefill` gRPC service: prefix reuse, compute, KV events,
//!   and the ranks' sends.
//! - `handshakes` — the decode's transfer handshakes when the Prefill call carries them.
//! - `cost` — what it measures of itself for the schedulers: compute per token, and the
//!   time its KV takes after the compute (a slow link).
//! - [`metrics`] — its counters, `/metrics` and readiness.
//! - [`instance`] — [`PrefillInstance::start`]: binds the directory, the ranks and the gRPC
//!   service, registers the ranks in the directory and the instance in discovery.

pub mod cache;
pub mod config;
mod cost;
mod error;
mod guards;
mod handshakes;
pub mod instance;
pub mod metrics;
pub mod rank;
pub mod service;

pub use cache::PrefixCache;
pub use config::PrefillConfig;
pub use error::PrefillError;
pub use instance::PrefillInstance;
