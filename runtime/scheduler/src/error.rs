use std::time::Duration;

use thiserror::Error;

/// Errors of the scheduler.
#[derive(Debug, Error)]
pub enum SchedulerError {
    /// The request is malformed.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// No instance is registered and live (or every one was excluded).
    #[error("no prefill instance available{0}")]
    NoInstance(String),
    /// Every instance that could take the request is too busy to start it in time.
    #[error("overloaded: {reason}; retry after {} ms", retry_after.as_millis())]
    Overloaded {
        /// When trying again could succeed.
        retry_after: Duration,
        /// Why.
        reason: String,
    },
    /// Discovery failed.
    #[error(transparent)]
    Discovery(#[from] handoff_discovery::DiscoveryError),
}

use handoff_proto::metadata::NO_INSTANCE;
pub use handoff_proto::metadata::RETRY_AFTER_MS;

impl From<SchedulerError> for tonic::Status {
    fn from(e: SchedulerError) -> Self {
        match e {
            SchedulerError::Invalid(_) => tonic::Status::invalid_argument(e.to_string()),
            SchedulerError::NoInstance(_) => {
                let mut s = tonic::Status::unavailable(e.to_string());
                s.metadata_mut()
                    .insert(NO_INSTANCE, tonic::metadata::MetadataValue::from_static("1"));
                s
            }
            SchedulerError::Overloaded { retry_after, .. } => {
                let mut s = tonic::Status::resource_exhausted(e.to_string());
                let ms = retry_after.as_millis().max(1).to_string();
                if let Ok(v) = ms.parse() {
                    s.metadata_mut().insert(RETRY_AFTER_MS, v);
                }
                s
            }
            SchedulerError::Discovery(_) => tonic::Status::internal(e.to_string()),
        }
    }
}
