use thiserror::Error;

/// Errors of discovery backends.
#[derive(Debug, Error)]
pub enum DiscoveryError {
    /// The backend could not be reached.
    #[error("discovery backend unavailable: {0}")]
    Unavailable(String),
    /// Settings that cannot be used (an unreadable certificate, a credential the backend
    /// does not take).
    #[error("discovery settings: {0}")]
    Config(String),
    /// No answer in time.
    #[error("no answer to {0} in time")]
    Timeout(String),
    /// A registration larger than the backend takes.
    #[error("a registration of {bytes} bytes, more than the {limit} allowed")]
    TooLarge {
        /// Its size.
        bytes: usize,
        /// The bound.
        limit: usize,
    },
    /// The instance id is registered by another live process.
    #[error(
        "instance id {id} is registered by another live process (at {holder}): give each instance its own --id"
    )]
    Taken {
        /// The id.
        id: String,
        /// Where its holder is.
        holder: String,
    },
    /// TLS files that cannot be used.
    #[error("discovery TLS: {0}")]
    Tls(#[from] handoff_core::tls::TlsError),
    /// A payload that does not decode.
    #[error("malformed discovery payload: {0}")]
    Malformed(#[from] serde_json::Error),
}
