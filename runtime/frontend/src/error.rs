use std::time::Duration;

use thiserror::Error;

/// Whose fault a failed attempt was: only [`Cause::Instance`] counts against the prefill
/// instance's circuit breaker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// The instance failed: refused or reset connections, a transfer that failed
    /// verification, an internal error.
    Instance,
    /// The instance refused for overload.
    Overloaded,
    /// The attempt's or the request's deadline passed.
    Deadline,
    /// The request was invalid.
    Invalid,
    /// The decode's own step failed (registering receive memory, loading the KV).
    Decode,
    /// The decode and the instance do not fit each other (another model, tp, transfer,
    /// version or token: the prefill answered `FAILED_PRECONDITION` or `UNAUTHENTICATED`,
    /// or a transfer was refused as unauthorized): tried elsewhere, and no
    /// breaker counts it. Before, it counted as the instance's fault: one misconfigured
    /// frontend opened every healthy prefill's breaker, for every frontend.
    Mismatch,
}

/// Which limit refused a request (429 / `RESOURCE_EXHAUSTED`), as a metric label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// The frontend's requests in progress (`max_concurrent`).
    Requests,
    /// Its tokenizer: long inputs ahead took the request's time.
    Tokenizer,
    /// The decode's slots (`--max-decoding`): no slot within the request's time.
    DecodeSlots,
    /// The decode's memory: its KV budget, or its receive memory.
    DecodeMemory,
    /// The scheduler: every instance's queue too long for the request.
    Scheduler,
    /// Every prefill tried refused it.
    Prefills,
}

impl Limit {
    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokenizer => "tokenizer",
            Limit::DecodeSlots => "decode_slots",
            Limit::DecodeMemory => "decode_memory",
            Limit::Scheduler => "scheduler",
            Limit::Prefills => "prefills",
        }
    }
}

/// Errors of the frontend, mapped to gRPC status and HTTP codes at the edge.
#[derive(Debug, Clone, Error)]
pub enum FrontendError {
    /// Bad input: the text says what and why.
    #[error("{0}")]
    Invalid(String),
    /// The request names a model this frontend does not serve.
    #[error("model {0:?} is not served here")]
    UnknownModel(String),
    /// Over capacity: the request was refused at once, and may be retried after a while.
    #[error("overloaded: {reason}")]
    Overloaded {
        /// When trying again could succeed.
        retry_after: Duration,
        /// Which limit refused it.
        limit: Limit,
        /// Why.
        reason: String,
    },
    /// No prefill instance is registered and healthy (or every one failed the request).
    #[error("no prefill attempt succeeded: {0}")]
    Unavailable(String),
    /// The request's deadline passed.
    #[error("deadline exceeded: {0}")]
    Deadline(String),
    /// One attempt failed (retried by the caller).
    #[error("{stage}: {reason}")]
    Attempt {
        /// The stage that failed.
        stage: &'static str,
        /// Why.
        reason: String,
        /// Whose fault it was.
        cause: Cause,
    },
    /// The engine failed after the first token.
    #[error("decode failed: {0}")]
    Decode(String),
}

impl FrontendError {
    /// An attempt's failure at `stage`: the decode's own at its own stages, else the
    /// instance's.
    pub(crate) fn at(stage: &'static str, e: impl std::fmt::Display) -> Self {
        let cause = match stage {
            "register" | "consume" => Cause::Decode,
            _ => Cause::Instance,
        };
        Self::because(stage, cause, e)
    }

    /// A failed call to the instance at `stage` (its directory): as [`FrontendError::at`],
    /// but for this frontend's own certificate refused ([`FrontendError::refused_own`]).
    pub(crate) fn reaching(stage: &'static str, e: &(dyn std::error::Error + 'static)) -> Self {
        Self::refused_own(stage, e).unwrap_or_else(|| Self::at(stage, e))
    }

    /// The instance refused this frontend's certificate for what is its own (expired,
    /// revoked, bad): this frontend's fault, a mismatch; counted against the instance it
    /// would open healthy prefills' breakers for every frontend, as another token would. An
    /// unknown CA is not this (the instance's bundle may be the stale one).
    fn refused_own(stage: &'static str, e: &(dyn std::error::Error + 'static)) -> Option<Self> {
        handoff_core::tls::own_certificate_refused(e).then(|| {
            let why = format!("this frontend's certificate was refused: {e}");
            Self::because(stage, Cause::Mismatch, why)
        })
    }

    /// An attempt's failure at `stage` with its cause.
    pub(crate) fn because(stage: &'static str, cause: Cause, e: impl std::fmt::Display) -> Self {
        FrontendError::Attempt { stage, reason: e.to_string(), cause }
    }

    /// A transfer failure at `stage`: a timeout is the deadline's, one of the decode's own
    /// tables full (NIXL staging memory, Mooncake's exposed ranges) an overload, anything
    /// else the instance's. Time that ran out with the KV still arriving is the deadline's
    /// at stage `transfer`, which the instance is never blamed for ([`FrontendError::overran`]):
    /// it was sending; the link or this decode was slow.
    pub(crate) fn transfer(stage: &'static str, e: handoff_transfer::TransferError) -> Self {
        let cause = match e {
            handoff_transfer::TransferError::Late(_) => {
                return Self::because("transfer", Cause::Deadline, e);
            }
            handoff_transfer::TransferError::Timeout(_) => Cause::Deadline,
            handoff_transfer::TransferError::Full(_) => Cause::Overloaded,
            // This frontend's token or its own certificate refused: the instance is
            // healthy, and counting it would open its breaker for every frontend.
            handoff_transfer::TransferError::Unauthorized
            | handoff_transfer::TransferError::CertificateRefused { .. } => Cause::Mismatch,
            _ => Cause::Instance,
        };
        Self::because(stage, cause, e)
    }

    /// A failed call to the prefill instance, classified by its status code. An instance
    /// draining refuses new work as one that is full does: not its fault; nor is one that
    /// could not reach this decode's receiver.
    pub(crate) fn prefill_status(s: &tonic::Status) -> Self {
        let draining = s.metadata().contains_key(handoff_proto::metadata::DRAINING);
        if s.metadata().contains_key(handoff_proto::metadata::RECEIVER_UNREACHABLE) {
            // The instance could not reach this decode's receiver: the path back (or this
            // decode) failed, not the instance (see `crate::reach`).
            return Self::because("connect-back", Cause::Decode, s.message());
        }
        if let Some(e) = Self::refused_own("prefill", s) {
            return e;
        }
        let cause = match s.code() {
            tonic::Code::ResourceExhausted => Cause::Overloaded,
            tonic::Code::Unavailable if draining => Cause::Overloaded,
            tonic::Code::DeadlineExceeded | tonic::Code::Cancelled => Cause::Deadline,
            tonic::Code::InvalidArgument => Cause::Invalid,
            tonic::Code::FailedPrecondition => Cause::Mismatch,
            // This frontend's token is not the instance's (a token being changed, a frontend
            // misconfigured): the instance is healthy, and a breaker opened by one
            // frontend's token would keep it from every frontend.
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => Cause::Mismatch,
            _ => Cause::Instance,
        };
        Self::because("prefill", cause, format!("{}: {}", s.code(), s.message()))
    }

    /// An attempt that ran out of its own time (the wait its instance was expected to have
    /// plus the attempt timeout), with the request's still left: the instance went silent
    /// (an engine hung behind live heartbeats), its fault. Other errors are kept as they are,
    /// and so is a deadline at a stage that reaches the instance (slow is not unreachable),
    /// or while its KV was still arriving (`transfer`: slow is not silent).
    pub(crate) fn overran(self) -> Self {
        let reaching = ["resolve-topology", "resolve-rank", "connect", "transfer"];
        match self {
            FrontendError::Attempt { stage, reason, cause: Cause::Deadline }
                if !reaching.contains(&stage) =>
            {
                let reason = format!("{reason}: no answer within the wait expected of it");
                FrontendError::Attempt { stage, reason, cause: Cause::Instance }
            }
            e => e,
        }
    }

    /// Whose fault an attempt's failure was (`None` for errors that are not an attempt's).
    pub fn cause(&self) -> Option<Cause> {
        match self {
            FrontendError::Attempt { cause, .. } => Some(*cause),
            _ => None,
        }
    }

    /// Whether this is the decode's own memory found full, before the prefill was asked
    /// (receive regions, a read's KV budget): no other instance would find it otherwise.
    pub(crate) fn decode_memory_full(&self) -> bool {
        matches!(self, FrontendError::Attempt { stage: "register", cause: Cause::Overloaded, .. })
    }
}

pub use handoff_proto::metadata::RETRY_AFTER_MS;

impl From<FrontendError> for tonic::Status {
    fn from(e: FrontendError) -> Self {
        let msg = e.to_string();
        match e {
            FrontendError::Invalid(_) => tonic::Status::invalid_argument(msg),
            FrontendError::UnknownModel(_) => tonic::Status::not_found(msg),
            FrontendError::Overloaded { retry_after, .. } => {
                let mut s = tonic::Status::resource_exhausted(msg);
                if let Ok(v) = retry_after.as_millis().max(1).to_string().parse() {
                    s.metadata_mut().insert(RETRY_AFTER_MS, v);
                }
                s
            }
            FrontendError::Unavailable(_) => tonic::Status::unavailable(msg),
            FrontendError::Attempt { cause, .. } => match cause {
                Cause::Overloaded => tonic::Status::resource_exhausted(msg),
                Cause::Deadline => tonic::Status::deadline_exceeded(msg),
                Cause::Invalid => tonic::Status::invalid_argument(msg),
                Cause::Instance | Cause::Decode | Cause::Mismatch => {
                    tonic::Status::unavailable(msg)
                }
            },
            FrontendError::Deadline(_) => tonic::Status::deadline_exceeded(msg),
            FrontendError::Decode(_) => tonic::Status::internal(msg),
        }
    }
}

#[cfg(test)]
mod tests {
    use handoff_transfer::TransferError;

    use super::*;

    /// The decode's own staging memory or tables full is an overload (retried later, no
    /// instance blamed); a timeout the deadline's; a broken transfer the instance's.
    #[test]
    fn a_full_table_of_the_decode_is_an_overload_not_the_instances_fault() {
        let peer = handoff_transfer::AgentAddr { ip: "10.0.0.1".into(), port: 1 };
        for (e, cause) in [
            (TransferError::Full("nixl staging memory"), Cause::Overloaded),
            (TransferError::Timeout("x".into()), Cause::Deadline),
            (TransferError::Io { peer: peer.clone(), reason: "reset".into() }, Cause::Instance),
            (TransferError::Unreachable { peer, reason: "refused".into() }, Cause::Instance),
            (TransferError::Failed("checksum".into()), Cause::Instance),
        ] {
            assert_eq!(FrontendError::transfer("connect", e.clone()).cause(), Some(cause), "{e}");
        }
    }

    /// An attempt's own time passing is the instance's fault, but at a stage that reaches it
    /// (slow is not unreachable), and only for a deadline: other causes keep theirs.
    #[test]
    fn an_overrun_blames_the_instance_past_the_stages_that_reach_it() {
        let late = |stage| FrontendError::because(stage, Cause::Deadline, "late");
        for (stage, cause) in [
            ("prefill", Cause::Instance),
            ("verify", Cause::Instance),
            ("connect", Cause::Deadline),
            ("resolve-topology", Cause::Deadline),
            ("resolve-rank", Cause::Deadline),
        ] {
            assert_eq!(late(stage).overran().cause(), Some(cause), "{stage}");
        }
        let busy = FrontendError::because("prefill", Cause::Overloaded, "queue full");
        assert_eq!(busy.overran().cause(), Some(Cause::Overloaded));
    }

    /// A prefill that does not fit this decode (`FAILED_PRECONDITION`: another model, tp or
    /// transfer) is a mismatch, told to the scheduler as no fault of the instance: one
    /// misconfigured frontend must not open every healthy prefill's breaker.
    #[test]
    fn a_prefill_that_does_not_fit_this_decode_is_no_fault_of_the_instance() {
        let s = tonic::Status::failed_precondition("mismatch: decode region of 4 bytes");
        let e = FrontendError::prefill_status(&s);
        assert_eq!(e.cause(), Some(Cause::Mismatch));
        let outcome = crate::lease::outcome_of(&e);
        assert_eq!(outcome, handoff_proto::v1::Outcome::DecodeFault, "no breaker counts it");
        for s in [
            tonic::Status::unauthenticated("wrong bearer token"),
            tonic::Status::permission_denied("no"),
        ] {
            let e = FrontendError::prefill_status(&s);
            assert_eq!(e.cause(), Some(Cause::Mismatch), "another token is no fault either");
        }
        let e = FrontendError::transfer("handshake", TransferError::Unauthorized);
        assert_eq!(e.cause(), Some(Cause::Mismatch));
        // This frontend's own certificate refused by the instance's transfer agent.
        let (peer, reason) =
            (handoff_transfer::AgentAddr { ip: "10.0.0.1".into(), port: 1 }, "expired".into());
        let e =
            FrontendError::transfer("connect", TransferError::CertificateRefused { peer, reason });
        assert_eq!(e.cause(), Some(Cause::Mismatch));
        let refused = FrontendError::prefill_status(&tonic::Status::internal("engine"));
        assert_eq!(crate::lease::outcome_of(&refused), handoff_proto::v1::Outcome::InstanceFault);
    }

    /// Time run out with the KV still arriving (a slow link, a busy decode) is the deadline's
    /// and stays so past the attempt's own time: the instance was sending. Run out with
    /// nothing arriving, it is the instance's (silent).
    #[test]
    fn a_transfer_still_arriving_at_the_deadline_never_blames_the_instance() {
        let late = FrontendError::transfer("verify", TransferError::Late("1s".into()));
        assert!(matches!(late, FrontendError::Attempt { stage: "transfer", .. }), "{late:?}");
        assert_eq!(late.overran().cause(), Some(Cause::Deadline));
        let silent = FrontendError::transfer("verify", TransferError::Timeout("x".into()));
        assert_eq!(silent.overran().cause(), Some(Cause::Instance));
    }

    /// Found in review: an instance refusing this frontend's certificate for what is the
    /// frontend's alone (here expired; a real TLS server of the cluster's CA) is this
    /// frontend's fault, a mismatch: counted against the instance, it opened healthy
    /// prefills' breakers for every frontend. A refusal of another CA's (the instance's
    /// bundle may be the stale one) and this frontend refusing the instance's certificate
    /// stay the instance's.
    #[tokio::test]
    async fn a_refused_certificate_of_this_frontend_is_a_mismatch() {
        use handoff_core::tls::test_certs::TestCa;
        use handoff_proto::v1::scheduler_client::SchedulerClient;
        use handoff_scheduler::{SchedulerConfig, SchedulerState};
        let cluster = TestCa::new();
        let foreign = TestCa::new().issue();
        let cases = [
            (cluster.issue(), cluster.issue_expired(), Some(Cause::Mismatch)),
            (cluster.issue(), foreign.clone(), Some(Cause::Instance)),
            (foreign, cluster.issue(), Some(Cause::Instance)),
            (cluster.issue(), cluster.issue(), None),
        ];
        for (server, client, cause) in cases {
            let tls = Some(server.trusting(cluster.pem()));
            let state = std::sync::Arc::new(SchedulerState::new(SchedulerConfig {
                tls,
                ..Default::default()
            }));
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap().to_string();
            let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
            let serving = tokio::spawn(handoff_scheduler::service::serve(listener, state, async {
                let _ = stopped.await;
            }));
            let timeout = std::time::Duration::from_secs(5);
            let tls = client.trusting(cluster.pem());
            let ch = handoff_proto::grpc::cluster_channel(&addr, Some(&tls), timeout).unwrap();
            let ask = handoff_proto::v1::ListInstancesRequest::default();
            let got = SchedulerClient::new(ch).list_instances(ask).await;
            let classed = got.as_ref().err().map(|s| FrontendError::prefill_status(s).cause());
            assert_eq!(classed, cause.map(Some), "{got:?}");
            stop.send(()).unwrap();
            serving.await.unwrap().unwrap();
        }
    }

    /// Found in review: the same rule where an attempt first reaches the instance, its
    /// bootstrap directory (mutual TLS): a frontend with an expired certificate was counted
    /// against every prefill it tried before any Prefill call was made.
    #[tokio::test]
    async fn a_directory_refusing_this_frontends_certificate_is_a_mismatch() {
        use handoff_bootstrap::{Directory, DirectoryClient, DirectoryConfig};
        use handoff_core::tls::test_certs::TestCa;
        let cluster = TestCa::new();
        let tls = Some(cluster.issue().trusting(cluster.pem()));
        let dir =
            std::sync::Arc::new(Directory::new(DirectoryConfig { tls, ..Default::default() }));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let serving = tokio::spawn(handoff_bootstrap::server::run(listener, dir, async {
            let _ = stopped.await;
        }));
        let cases =
            [(cluster.issue_expired(), Cause::Mismatch), (TestCa::new().issue(), Cause::Instance)];
        for (client, cause) in cases {
            let tls = client.trusting(cluster.pem());
            let e =
                DirectoryClient::with_tls(None, Some(&tls)).server_info(&addr).await.unwrap_err();
            let classed = FrontendError::reaching("resolve-topology", &e);
            assert_eq!(classed.cause(), Some(cause), "{classed:?}");
        }
        stop.send(()).unwrap();
        serving.await.unwrap().unwrap();
    }
}
