use thiserror::Error;

/// Errors of the frontend, mapped to gRPC status at the edge.
#[derive(Debug, Error)]
pub enum FrontendError {
    /// Bad input: the text says what and why.
    #[error("{0}")]
    Invalid(String),
    /// The request names a model this frontend does not serve.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// Too many requests at once.
    #[error("too many concurrent requests ({0})")]
    Overloaded(usize),
    /// Every attempt failed before the first token.
    #[error("no prefill attempt succeeded: {0}")]
    Unavailable(String),
    /// The deadline passed.
    #[error("deadline exceeded: {0}")]
    Deadline(String),
    /// One attempt failed (retried by the caller).
    #[error("{stage}: {reason}")]
    Attempt {
        /// The stage that failed.
        stage: &'static str,
        /// Why.
        reason: String,
    },
    /// The engine failed after the first token.
    #[error("decode failed: {0}")]
    Decode(String),
}

impl FrontendError {
    pub(crate) fn at(stage: &'static str, e: impl std::fmt::Display) -> Self {
        FrontendError::Attempt { stage, reason: e.to_string() }
    }
}

impl From<FrontendError> for tonic::Status {
    fn from(e: FrontendError) -> Self {
        let msg = e.to_string();
        match e {
            FrontendError::Invalid(_) => tonic::Status::invalid_argument(msg),
            FrontendError::UnknownModel(_) => tonic::Status::not_found(msg),
            FrontendError::Overloaded(_) => tonic::Status::resource_exhausted(msg),
            FrontendError::Unavailable(_) | FrontendError::Attempt { .. } => {
                tonic::Status::unavailable(msg)
            }
            FrontendError::Deadline(_) => tonic::Status::deadline_exceeded(msg),
            FrontendError::Decode(_) => tonic::Status::internal(msg),
        }
    }
}
