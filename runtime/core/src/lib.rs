//! Shared vocabulary of handoff's crates.
//!
//! - [`ids`] — newtypes for the ids that bind a request end to end ([`Room`], [`InstanceId`],
//!   [`BlockHash`]).
//! - [`hash`] — the chained block hashes of a prompt, the same function on every side.
//! - [`http`] — an axum router served with a head timeout and a bound on connections.
//! - [`log_every`] — something frequent logged at most once a while, with its count.
//! - [`metrics`] — Prometheus counters, gauges and histograms, and their text format.
//! - [`net`] — listeners whose connections set `TCP_NODELAY`.
//! - [`otel`] — spans linked into OpenTelemetry traces across processes.
//! - [`ops`] — `/metrics`, `/livez` and `/readyz`, served by every role.
//! - [`tasks`] — owned background tasks and a shutdown signal (no detached tasks).
//! - [`tls`] — mutual TLS within a cluster, and public endpoints' certificates.
//! - [`traffic`] — gRPC and HTTP requests served, counted and timed by route and status.
//! - [`zmtp`] — ZMTP 3 (ZMQ's wire) with every length a peer declares bounded.

pub mod body;
pub mod hash;
pub mod http;
pub mod ids;
pub mod log_every;
pub mod metrics;
pub mod net;
pub mod ops;
pub mod otel;
pub mod tasks;
pub mod tls;
pub mod traffic;
pub mod zmtp;

pub use hash::{BLOCK_HASH_SEED, block_hashes};
pub use ids::{BlockHash, InstanceId, InvalidId, Room};
pub use tasks::Tasks;
