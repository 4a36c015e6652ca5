//! handoff's gRPC API, package `handoff.v1`: the public `Generate` service, the `Scheduler`
//! and the `Prefill` service. Generated at build time from `handoff/v1/*.proto`.

#![expect(missing_docs, reason = "generated code")]
#![expect(clippy::all, reason = "generated code")]

/// `handoff.v1`.
pub mod v1 {
    tonic::include_proto!("handoff.v1");
}

pub mod grpc;
pub mod trace;

/// gRPC metadata keys of the API (documented with the RPCs that send them).
pub mod metadata {
    /// On `RESOURCE_EXHAUSTED`: milliseconds to wait before retrying.
    pub const RETRY_AFTER_MS: &str = "retry-after-ms";
    /// On a scheduler's `UNAVAILABLE`: the replica is up and answered that it has no
    /// routable instance (not a failure of the replica itself).
    pub const NO_INSTANCE: &str = "handoff-no-instance";
    /// On a prefill's `UNAVAILABLE`: the instance is draining, refusing new work (not a
    /// failure of the instance: another one is asked).
    pub const DRAINING: &str = "handoff-draining";
    /// On a prefill's `UNAVAILABLE`: it could not reach the decode's transfer receiver (a
    /// connection to it refused, with no route, or its connect unanswered). The path back
    /// to that decode, or the decode itself, failed, not the instance: its breaker does not
    /// count it.
    pub const RECEIVER_UNREACHABLE: &str = "handoff-receiver-unreachable";
    /// On a scheduler's refusal of `SelectPrefill`: how many of the reports sent along it
    /// took (as `SelectPrefillResponse.reports_taken` says on an answer).
    pub const REPORTS_TAKEN: &str = "handoff-reports-taken";
    /// On a frontend's answer, success or error (gRPC metadata, HTTP header): the request's
    /// trace id (the caller's `traceparent`'s, shared by the calls of its trace, or one minted
    /// for the request), which every process's log lines of the request carry: what a client
    /// quotes to an operator.
    pub const TRACE_ID: &str = "x-trace-id";
}

/// Bounds on `PrefillRequest.handshakes`: the prefill refuses more, and a frontend that would
/// need more sends its handshakes the old way.
pub mod handshakes {
    /// Handshakes one call may carry.
    pub const MAX_IN_CALL: usize = 4096;
    /// Decode ranks one prefill rank may be told to send to in one call.
    pub const MAX_PER_SENDER: usize = 256;
}

/// Bounds on `SelectPrefillRequest`.
pub mod select {
    /// `exclude_instances` a scheduler takes by default (its `max_exclude`); a frontend sends
    /// no more of the instances it merely avoids than leave its request within this.
    pub const MAX_EXCLUDE: usize = 64;
}

/// Bearer tokens on the internal gRPC services (`Scheduler`, `Prefill`): the cluster's token
/// in `authorization: Bearer <token>` metadata, checked by [`auth::Bearer`] on the server.
pub mod auth {
    use std::sync::Arc;

    use tonic::{Request, Status};

    /// The metadata key.
    pub const AUTHORIZATION: &str = "authorization";

    /// `msg` as a request carrying `token` (if any).
    pub fn request<T>(msg: T, token: Option<&str>) -> Request<T> {
        let mut req = Request::new(msg);
        if let Some(v) = token.and_then(|t| format!("Bearer {t}").parse().ok()) {
            req.metadata_mut().insert(AUTHORIZATION, v);
        }
        req
    }

    /// A server interceptor: with a token, every call must carry it; without, all pass.
    #[derive(Debug, Clone, Default)]
    pub struct Bearer {
        token: Option<Arc<str>>,
    }

    impl Bearer {
        /// Requires `token` when set.
        pub fn new(token: Option<&str>) -> Self {
            Bearer { token: token.map(Arc::from) }
        }
    }

    /// Whether `got` is `want`, in time independent of where they differ.
    fn same(got: &[u8], want: &[u8]) -> bool {
        got.len() == want.len() && got.iter().zip(want).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }

    /// Whether an `authorization` header value carries `token` as a bearer token (compared in
    /// constant time).
    pub fn bearer_matches(header: &[u8], token: &str) -> bool {
        same(header, format!("Bearer {token}").as_bytes())
    }

    impl tonic::service::Interceptor for Bearer {
        fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
            let Some(token) = &self.token else { return Ok(req) };
            let got = req.metadata().get(AUTHORIZATION).map(|v| v.as_bytes());
            let want = format!("Bearer {token}");
            match got {
                Some(g) if same(g, want.as_bytes()) => Ok(req),
                Some(_) => Err(Status::unauthenticated("wrong bearer token")),
                None => {
                    Err(Status::unauthenticated("this service needs the cluster's bearer token"))
                }
            }
        }
    }
}
