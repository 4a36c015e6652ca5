//! The bootstrap directory of a prefill instance, wire-compatible with SGLang's
//! `CommonKVBootstrapServer` (see `docs/bootstrap.md`).
//!
//! - [`wire`] — the JSON bodies (rank registration, server info, rank address).
//! - [`directory`] — the directory's state: rank table, readiness by distinct coordinates,
//!   the bounded dp-rank table with expiry.
//! - [`server`] — the HTTP server (axum): `run(listener, shutdown)`.
//! - [`client`] — a pooled keep-alive client and the per-instance topology cache.
//! - [`mapping`] — rank mapping and KV head slicing between prefill and decode topologies.

pub mod client;
pub mod directory;
mod error;
pub mod mapping;
pub mod server;
pub mod wire;

pub use client::{DirectoryCache, DirectoryClient};
pub use directory::{Directory, DirectoryConfig, PeerVersion};
pub use error::{BootstrapError, ClientError};
pub use wire::{RankAddr, Registration, ServerInfo};
