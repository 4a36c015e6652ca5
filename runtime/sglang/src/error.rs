//! Errors of the SGLang decode side.

use thiserror::Error;

/// Why an SGLang transfer failed.
#[derive(Debug, Error)]
pub enum SglangError {
    /// The prefill's directory could not be read or says something unusable.
    #[error("bootstrap: {0}")]
    Bootstrap(#[from] handoff_bootstrap::ClientError),
    /// A topology or layout this receiver does not serve (yet).
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// The decode's receive memory (page pool, rows, inbox) is spoken for: overload.
    #[error("full: {0}")]
    Full(String),
    /// A ZMQ message that does not parse.
    #[error("malformed SGLang message: {0}")]
    Malformed(String),
    /// The ZMQ sockets failed.
    #[error("zmq: {0}")]
    Zmq(String),
    /// The transfer seam refused or failed.
    #[error("transfer: {0}")]
    Transfer(#[from] handoff_transfer::TransferError),
    /// The prefill reported `KVPoll.Failed` for the room.
    #[error("prefill rank {rank} reported the transfer of room {room} failed")]
    PrefillFailed {
        /// The room.
        room: u64,
        /// The prefill's unique rank.
        rank: u32,
    },
    /// The metadata row names another room: somebody else's KV (SGLang's corruption check).
    #[error("bootstrap_room mismatch: expected {expected}, the metadata row says {got}")]
    RoomMismatch {
        /// The room minted for this request.
        expected: u64,
        /// The room the row carries (0: never written).
        got: u64,
    },
    /// No status in time.
    #[error("no status for room {0} in time")]
    Timeout(u64),
    /// The bytes do not fit the engine's KV.
    #[error("engine KV: {0}")]
    Engine(#[from] handoff_engine::EngineError),
}
