use thiserror::Error;

/// Errors of a prefill instance.
#[derive(Debug, Error)]
pub enum PrefillError {
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// The caller's view of this instance does not match it: handshakes in the call for ranks
    /// it does not have, or over a transfer that takes none in the call; a decode of another
    /// model (its region's size, a token outside this vocabulary) or tp. Not the client's
    /// fault: the caller should try elsewhere, or the old way.
    #[error("mismatch: {0}")]
    Mismatch(String),
    /// The instance is draining: it takes no new request (the caller tries another).
    #[error("draining: this instance takes no new requests")]
    Draining,
    /// Too many requests queued.
    #[error("overloaded: {0}")]
    Overloaded(String),
    /// The request's deadline passed while it waited in the engine's queue: alive, but too
    /// busy to start it in time, an overload to the caller (`RESOURCE_EXHAUSTED`), counted
    /// apart from a full queue's refusal (a queue that moves slowly or not at all).
    #[error("overloaded: the deadline passed in the engine's queue after {0:?}")]
    QueuedPastDeadline(std::time::Duration),
    /// The request's deadline (and a grace) passed while its KV was still being sent: the
    /// decode has given up on it by then, and its cancellation did not come
    /// (`DEADLINE_EXCEEDED`). Before, a decode gone silent (partitioned, its host dead) held
    /// each of its requests' KV here for a minute or more.
    #[error("the deadline passed while the KV was being sent")]
    SentPastDeadline,
    /// The engine failed.
    #[error(transparent)]
    Engine(#[from] handoff_engine::EngineError),
    /// Sending the KV failed.
    #[error("KV transfer: {0}")]
    Transfer(#[from] handoff_transfer::TransferError),
    /// The decode's receiver could not be reached: a connection to it refused, with no
    /// route, or its connect unanswered, or its certificate refused as the receiver's own
    /// fault (not valid for its name, expired: the path back to the decode failed, or the
    /// decode did, not this instance; another TLS failure or a failed hello, or this host's
    /// own error, is a transfer failure).
    #[error("KV transfer: cannot reach the decode's receiver: {0}")]
    ReceiverUnreachable(handoff_transfer::TransferError),
    /// Discovery failed (e.g. deregistering while draining).
    #[error("discovery: {0}")]
    Discovery(#[from] handoff_discovery::DiscoveryError),
    /// Startup failed.
    #[error("startup: {0}")]
    Startup(String),
}

impl PrefillError {
    /// A failed request in the log, in its request's span (room, trace id): a fault (the
    /// engine, a transfer, named with its peer, this instance) at warn, as the frontend's
    /// attempt faults are; refusals and bad input at debug (all counted in
    /// `handoff_prefill_requests_total`).
    pub(crate) fn log(&self) {
        match self {
            PrefillError::Engine(_)
            | PrefillError::Transfer(_)
            | PrefillError::ReceiverUnreachable(_)
            | PrefillError::Discovery(_)
            | PrefillError::Startup(_)
            | PrefillError::SentPastDeadline => tracing::warn!(error = %self, "prefill failed"),
            _ => tracing::debug!(error = %self, "prefill refused"),
        }
    }
}

impl From<PrefillError> for tonic::Status {
    fn from(e: PrefillError) -> Self {
        use handoff_engine::EngineError;
        let msg = e.to_string();
        match e {
            PrefillError::Invalid(_) | PrefillError::Engine(EngineError::InvalidInput(_)) => {
                tonic::Status::invalid_argument(msg)
            }
            PrefillError::Mismatch(_) => tonic::Status::failed_precondition(msg),
            PrefillError::SentPastDeadline => tonic::Status::deadline_exceeded(msg),
            PrefillError::Overloaded(_) | PrefillError::QueuedPastDeadline(_) => {
                tonic::Status::resource_exhausted(msg)
            }
            PrefillError::Draining => {
                let mut s = tonic::Status::unavailable(msg);
                let draining = tonic::metadata::MetadataValue::from_static("1");
                s.metadata_mut().insert(handoff_proto::metadata::DRAINING, draining);
                s
            }
            PrefillError::ReceiverUnreachable(_) => {
                let mut s = tonic::Status::unavailable(msg);
                let unreachable = tonic::metadata::MetadataValue::from_static("1");
                s.metadata_mut().insert(handoff_proto::metadata::RECEIVER_UNREACHABLE, unreachable);
                s
            }
            PrefillError::Transfer(_) | PrefillError::Discovery(_) => {
                tonic::Status::unavailable(msg)
            }
            PrefillError::Engine(_) | PrefillError::Startup(_) => tonic::Status::internal(msg),
        }
    }
}
