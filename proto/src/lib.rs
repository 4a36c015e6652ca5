//! handoff's gRPC API, package `handoff.v1`: the public `Generate` service, the `Scheduler`
//! and the `Prefill` service. Generated at build time from `handoff/v1/*.proto`.

#![expect(missing_docs, reason = "generated code")]
#![expect(clippy::all, reason = "generated code")]

/// `handoff.v1`.
pub mod v1 {
    tonic::include_proto!("handoff.v1");
}
