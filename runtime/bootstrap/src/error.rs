use thiserror::Error;

/// Errors of the directory itself, mapped to HTTP statuses by the server.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BootstrapError {
    /// A query parameter is absent or empty.
    #[error("Missing inputs for bootstrap server.")]
    MissingInputs,
    /// The request is malformed: the text says why.
    #[error("{0}")]
    BadRequest(String),
    /// A rank registered with settings that contradict the instance's.
    #[error("{0}")]
    Inconsistent(String),
    /// Not every rank has registered.
    #[error("Prefill server not fully registered yet ({0} workers registered).")]
    NotReady(usize),
    /// No rank at these coordinates.
    #[error("Bootstrap info not found for dp_rank={dp} cp_rank={cp} tp_rank={tp} pp_rank={pp}")]
    NotFound {
        /// dp rank asked for.
        dp: i64,
        /// cp rank asked for.
        cp: i64,
        /// tp rank asked for.
        tp: i64,
        /// pp rank asked for.
        pp: i64,
    },
    /// A write without the configured bearer token.
    #[error("Unauthorized")]
    Unauthorized,
    /// A topology that the rank mapping cannot serve.
    #[error("unsupported topology: {0}")]
    Topology(String),
}

/// Errors of the directory client.
#[derive(Debug, Error)]
pub enum ClientError {
    /// The directory address or request could not be formed.
    #[error("bad directory address {addr:?}: {reason}")]
    Address {
        /// The address given.
        addr: String,
        /// Why it is unusable.
        reason: String,
    },
    /// The directory could not be reached.
    #[error("directory {addr} unreachable: {source}")]
    Unreachable {
        /// The directory.
        addr: String,
        /// The transport error.
        #[source]
        source: hyper_util::client::legacy::Error,
    },
    /// The directory did not answer in time, on a kept connection nor on a fresh one (the
    /// network may be dropping its packets).
    #[error("directory {addr} gave no answer within {after:?} on a fresh connection")]
    TimedOut {
        /// The directory.
        addr: String,
        /// The fresh connection's time.
        after: std::time::Duration,
    },
    /// Reading the response body failed.
    #[error("directory {addr} body: {source}")]
    Body {
        /// The directory.
        addr: String,
        /// The body error.
        #[source]
        source: hyper::Error,
    },
    /// The answer is longer than any directory answer ([`crate::client::MAX_ANSWER_BYTES`]).
    #[error("directory {addr} answered more than {limit} bytes")]
    Oversized {
        /// The directory.
        addr: String,
        /// The most an answer may have.
        limit: usize,
    },
    /// The directory is not fully registered yet (503).
    #[error("directory {addr} not ready: {body}")]
    NotReady {
        /// The directory.
        addr: String,
        /// Its answer.
        body: String,
    },
    /// Any other non-success answer.
    #[error("directory {addr} answered {status}: {body}")]
    Status {
        /// The directory.
        addr: String,
        /// HTTP status.
        status: u16,
        /// Its answer.
        body: String,
    },
    /// A success answer that does not parse.
    #[error("directory {addr} sent a malformed answer: {source}")]
    Malformed {
        /// The directory.
        addr: String,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The answer is well-formed but unusable (e.g. sizes of 0).
    #[error("directory {addr} sent an unusable answer: {reason}")]
    Unusable {
        /// The directory.
        addr: String,
        /// Why.
        reason: String,
    },
}
