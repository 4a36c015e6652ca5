use handoff_transfer::TransferError;
use thiserror::Error;

/// Errors of the vLLM protocol.
#[derive(Debug, Error)]
pub enum VllmError {
    /// The side channel could not be reached, or did not answer in time.
    #[error("vLLM side channel {addr}: {reason}")]
    SideChannel {
        /// `host:port`.
        addr: String,
        /// What went wrong.
        reason: String,
    },
    /// A handshake or prefill answer that is not vLLM's protocol.
    #[error("malformed vLLM message: {0}")]
    Malformed(String),
    /// Valid, but a layout or feature this decode does not read.
    #[error("unsupported vLLM KV layout: {0}")]
    Unsupported(String),
    /// A request this decode refuses to send (block ids out of range, too many bytes).
    #[error("invalid vLLM read: {0}")]
    Invalid(String),
    /// More KV than the decode takes for one request: the request's, not the prefill's.
    #[error("vLLM read too large: {0}")]
    TooLarge(String),
    /// NIXL failed.
    #[error(transparent)]
    Transfer(#[from] TransferError),
}
