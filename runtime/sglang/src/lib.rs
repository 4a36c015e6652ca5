//! SGLang's PD KV protocol, decode side: handoff receiving KV from SGLang's own prefill code.
//!
//! - [`wire`] — the ZMQ messages (registration, transfer info, status, `AUX_DATA`).
//! - [`layout`] — SGLang's page and metadata-row layout, and its conversion to our KV.
//! - [`pool`] — the virtual page pool whose addresses SGLang writes to.
//! - [`pull`] — the PULL socket the prefill ranks push statuses and rows to, in
//!   [`handoff_core::zmtp`] (every length a peer declares bounded).
//! - [`topology`] — what a prefill's directory says of its KV, checked against ours.
//! - [`receiver`] — [`SglangReceiver`]: one request at a time or many, end to end.
//!
//! Pages travel over Mooncake's TCP wire into handoff's own receive regions
//! (`handoff_transfer::mooncake`); facts are in `../shared/interop/sglang-kv.md` and
//! `sglang-sender.md`.

mod error;
pub mod layout;
pub mod pool;
pub mod pull;
pub mod receiver;
mod sockets;
pub mod topology;
pub mod wire;

pub use error::SglangError;
pub use layout::{RequestLayout, SglangLayout};
pub use receiver::{SglangKv, SglangReceiver};
pub use topology::MAX_PREFILL_TP;
