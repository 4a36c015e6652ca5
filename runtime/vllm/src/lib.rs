//! vLLM's NIXL KV protocol (vLLM 0.33's `NixlConnector`, pull mode: vLLM's default), decode
//! side, over handoff's nixl backend.
//!
//! A vLLM prefill worker keeps a request's KV blocks after computing it and answers, on its
//! ZMQ side channel, with its NIXL agent's metadata and the layout of its KV cache. The decode
//! READs the request's blocks with NIXL and has NIXL send the prefill the notification
//! `"<request id>:<consumers>"` once they are here; the prefill frees the blocks when every
//! consumer has sent it.
//!
//! - [`handshake`]: the side channel (a ZMQ REQ: `[b"get_meta_msg", pp_rank, tp_rank]` in
//!   msgpack; the answer: the msgpack `NixlHandshakePayload`, then the prefill's clock).
//! - [`metadata`]: `NixlAgentMetadata` decoded and checked: what this decode supports (every
//!   region of the same block count, no DCP/PCP, one physical block per logical one).
//! - [`read`]: a request's blocks, read in vLLM's layout: region by region, block by block.
//! - [`layout`]: those blocks, from every TP rank of the prefill, as our engine's KV.
//! - [`params`]: the request a decode POSTs to the prefill server and the `kv_transfer_params`
//!   it answers with (which blocks, under which id, on which side-channel port).
//!
//! Facts from the wheels: `../shared/interop/nixl.md` (sections 4 to 6). The tests run
//! vLLM's own prefill-side code against this (`tests/vllm_nixl.rs`).

mod error;
pub mod handshake;
pub mod layout;
pub mod metadata;
pub mod params;
pub mod read;

pub use error::VllmError;
pub use handshake::{Peer, connect};
pub use metadata::{AgentMetadata, Handshake};
pub use params::{KvSource, prefill_request};
pub use read::{Blocks, read_blocks};
