//! handoff's gRPC API, package `handoff.v1`: the public `Generate` service, the `Scheduler`
//! and the `Prefill` service. Generated at build time from `handoff/v1/*.proto`.

#![expect(missing_docs, reason = "generated code")]
#![expect(clippy::all, reason = "generated code")]

/// `handoff.v1`.
pub mod v1 {
    tonic::include_proto!("handoff.v1");
}

/// gRPC metadata keys of the API (documented with the RPCs that send them).
pub mod metadata {
    /// On `RESOURCE_EXHAUSTED`: milliseconds to wait before retrying.
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
    /// On a scheduler's `UNAVAILABLE`: the replica is up and answered that it has no
    /// routable instance (not a failure of the replica itself).
    pub const NO_INSTANCE: &str = "handoff-no-instance";
}
