use thiserror::Error;

/// Errors of the scheduler.
#[derive(Debug, Error)]
pub enum SchedulerError {
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// No instance can take the request.
    #[error("no prefill instance available{0}")]
    NoInstance(String),
    /// Discovery failed.
    #[error(transparent)]
    Discovery(#[from] handoff_discovery::DiscoveryError),
}

impl From<SchedulerError> for tonic::Status {
    fn from(e: SchedulerError) -> Self {
        match e {
            SchedulerError::Invalid(_) => tonic::Status::invalid_argument(e.to_string()),
            SchedulerError::NoInstance(_) => tonic::Status::unavailable(e.to_string()),
            SchedulerError::Discovery(_) => tonic::Status::internal(e.to_string()),
        }
    }
}
