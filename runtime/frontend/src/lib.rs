//! The decode frontend: the public `handoff.v1.Generate` service.
//!
//! - [`config`] — [`FrontendConfig`].
//! - [`input`] — a `GenerateRequest` checked and turned into a [`input::Plan`] (tokens,
//!   sampling, limits, deadline); every bad input is `INVALID_ARGUMENT` with a reason.
//! - [`attempt`] — one attempt at the request path on one prefill instance: resolve the
//!   topology and rank addresses (cached), register receive regions, connect, prefill,
//!   verify, reassemble the KV. Each stage is timed.
//! - [`sglang`] — one attempt on an SGLang prefill server (protocol `sglang`): its
//!   `/generate` with the bootstrap fields, the KV received as SGLang's decode.
//! - [`vllm`] — one attempt on a vLLM prefill server (protocol `vllm`): its
//!   `/v1/completions` with `kv_transfer_params`, the KV READ over NIXL as vLLM's decode.
//! - `engine_http` — the JSON POST both engine protocols make.
//! - [`schedulers`] — [`Schedulers`]: the scheduler replicas, followed through discovery;
//!   a selection fails over from a replica that does not answer to another.
//! - `lease` — a booking held until its attempt ends, reported cancelled when dropped.
//! - `metrics` — what `/metrics` serves, readiness, and the measured decode step.
//! - [`traces`] — the evidence of recent requests, found by room (`handoff ctl trace`).
//! - [`path`] — [`Frontend`]: scheduler selection (a booking), fresh room per attempt, the
//!   attempt the chosen instance's protocol calls for, retries before the first token, and
//!   outcomes reported back (cancelled when dropped).
//! - [`service`] — the gRPC service: streams the first token and the decoded ones.
//! - [`text`] — incremental detokenization and stop strings.
//! - [`http`] — the OpenAI-compatible HTTP API, `/health`, the operations endpoints and
//!   `/v1/debug/requests/{room}`.

pub mod attempt;
pub mod config;
pub mod decoding;
mod engine_http;
mod error;
pub mod http;
pub mod input;
mod lease;
mod metrics;
mod outbox;
pub mod path;
pub mod reach;
pub mod schedulers;
pub mod service;
pub mod sglang;
pub mod text;
pub mod traces;
pub mod vllm;

pub use config::FrontendConfig;
pub use error::{Cause, FrontendError, Limit, RETRY_AFTER_MS};
pub use path::Frontend;
pub use schedulers::Schedulers;
pub use service::GenerateService;
