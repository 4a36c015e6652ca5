//! The `handoff.v1.Scheduler` gRPC service.

use std::future::Future;
use std::sync::Arc;

use handoff_core::{BlockHash, InstanceId};
use handoff_proto::auth::Bearer;
use handoff_proto::grpc::GrpcError;
use handoff_proto::metadata::REPORTS_TAKEN;
use handoff_proto::trace::TraceContext;
use handoff_proto::v1::scheduler_server::{Scheduler as SchedulerRpc, SchedulerServer};
use handoff_proto::v1::{
    InstanceStatus, ListInstancesRequest, ListInstancesResponse, Outcome as WireOutcome, Policy,
    ReportOutcomeRequest, ReportOutcomeResponse, ReportOutcomesRequest, ReportOutcomesResponse,
    SelectPrefillRequest, SelectPrefillResponse,
};
use tokio::net::TcpListener;
use tonic::service::interceptor::InterceptedService;
use tonic::{Request, Response, Status};
use tracing::debug;

use crate::state::{Ask, BookingId, Outcome};
use crate::{PolicyKind, Protocol, Protocols, SchedulerState};

/// The gRPC face of a [`SchedulerState`].
#[derive(Debug, Clone)]
pub struct SchedulerService {
    state: Arc<SchedulerState>,
}

impl SchedulerService {
    /// A service over `state`.
    pub fn new(state: Arc<SchedulerState>) -> Self {
        SchedulerService { state }
    }

    /// As a tonic service (with the configured token, every call must carry it).
    pub fn into_server(self) -> InterceptedService<SchedulerServer<Self>, Bearer> {
        let bearer = Bearer::new(self.state.config().token.as_deref());
        SchedulerServer::with_interceptor(self, bearer)
    }
}

/// Maps the wire's policy to ours; `None` means the scheduler's default.
pub fn policy_from_wire(p: i32) -> Result<Option<PolicyKind>, Status> {
    match Policy::try_from(p) {
        Ok(Policy::Unspecified) => Ok(None),
        Ok(Policy::KvAware) => Ok(Some(PolicyKind::KvAware)),
        Ok(Policy::RoundRobin) => Ok(Some(PolicyKind::RoundRobin)),
        Ok(Policy::Random) => Ok(Some(PolicyKind::Random)),
        Ok(Policy::PowerOfTwo) => Ok(Some(PolicyKind::PowerOfTwo)),
        Ok(Policy::PrefixHash) => Ok(Some(PolicyKind::PrefixHash)),
        Err(_) => Err(Status::invalid_argument(format!("unknown policy {p}"))),
    }
}

/// Maps the wire's outcome to ours. One this build does not know (a newer frontend's, in a
/// rolling upgrade) ends its booking as cancelled, blaming no one: refused, it failed the
/// whole batch of reports it came in, and every booking in it held its load until it
/// expired.
pub fn outcome_from_wire(o: i32) -> Result<Outcome, Status> {
    match WireOutcome::try_from(o) {
        Ok(WireOutcome::Success) => Ok(Outcome::Success),
        Ok(WireOutcome::InstanceFault) => Ok(Outcome::InstanceFault),
        Ok(WireOutcome::Overloaded) => Ok(Outcome::Overloaded),
        Ok(WireOutcome::Deadline) => Ok(Outcome::Deadline),
        Ok(WireOutcome::Cancelled) => Ok(Outcome::Cancelled),
        Ok(WireOutcome::Invalid) => Ok(Outcome::Invalid),
        Ok(WireOutcome::DecodeFault) => Ok(Outcome::DecodeFault),
        Ok(WireOutcome::Unspecified) => Err(Status::invalid_argument("outcome is required")),
        Err(_) => Ok(Outcome::Cancelled),
    }
}

fn instance_id(s: &str) -> Result<InstanceId, Status> {
    s.parse().map_err(|e: handoff_core::InvalidId| Status::invalid_argument(e.to_string()))
}

/// Most reports one `ReportOutcomes` call may carry.
pub const MAX_REPORTS: usize = 4096;

/// Every report's outcome, each checked before any is applied: a call refused for one of
/// them ends no booking.
fn reports_from_wire(reports: &[ReportOutcomeRequest]) -> Result<Vec<Outcome>, Status> {
    if reports.len() > MAX_REPORTS {
        return Err(Status::invalid_argument(format!(
            "{} reports in one call, at most {MAX_REPORTS}",
            reports.len()
        )));
    }
    let outcome = |(i, r): (usize, &ReportOutcomeRequest)| {
        report_from_wire(r)
            .map_err(|s| Status::invalid_argument(format!("report {i}: {}", s.message())))
    };
    reports.iter().enumerate().map(outcome).collect()
}

/// A report's outcome, once its booking is named.
fn report_from_wire(r: &ReportOutcomeRequest) -> Result<Outcome, Status> {
    if r.booking_id == 0 {
        return Err(Status::invalid_argument("booking_id is required"));
    }
    outcome_from_wire(r.outcome)
}

impl SchedulerService {
    /// Selects for `r` (its reports taken already).
    fn select(&self, r: SelectPrefillRequest) -> Result<SelectPrefillResponse, Status> {
        let policy = policy_from_wire(r.policy)?;
        let exclude =
            r.exclude_instances.iter().map(|s| instance_id(s)).collect::<Result<Vec<_>, _>>()?;
        let hashes: Vec<BlockHash> = r.block_hashes.into_iter().map(BlockHash).collect();
        let owner =
            match r.frontend_id.as_str() {
                "" => None,
                id => Some(instance_id(id).map_err(|s| {
                    Status::invalid_argument(format!("frontend_id: {}", s.message()))
                })?),
            };
        let ask = Ask {
            hashes: &hashes,
            prompt_tokens: r.prompt_tokens,
            policy,
            exclude: &exclude,
            deadline: (r.deadline_ms > 0)
                .then(|| std::time::Duration::from_millis(u64::from(r.deadline_ms))),
            protocols: Protocols::from_names(&r.protocols)?,
            owner: owner.as_ref(),
        };
        let sel = self.state.select(&ask)?;
        debug!(instance = %sel.instance.id, dp_rank = sel.dp_rank, cached = sel.cached_blocks, "prefill selected");
        Ok(SelectPrefillResponse {
            instance_id: sel.instance.id.to_string(),
            dp_rank: sel.dp_rank,
            cached_blocks: sel.cached_blocks,
            booking_id: sel.booking.0,
            expected_wait_ms: sel.expected_wait.as_millis().min(u128::from(u32::MAX)) as u32,
            expected_prefill_ms: sel
                .expected_prefill
                .as_micros()
                .div_ceil(1000)
                .min(u128::from(u32::MAX)) as u32,
            protocol: Protocol::of(&sel.instance).name().to_owned(),
            bootstrap_addr: sel.instance.bootstrap_addr,
            prefill_addr: sel.instance.grpc_addr,
            reports_taken: 0,
            dp_size: sel.instance.topology.dp,
        })
    }

    /// Ends the bookings of `reports` sent along with a selection: the well-formed ones (a
    /// malformed one is skipped, and logged), none past [`MAX_REPORTS`]. How many it took.
    fn take_reports(&self, reports: Vec<ReportOutcomeRequest>) -> u32 {
        if reports.len() > MAX_REPORTS {
            debug!(n = reports.len(), "too many reports along with a selection; none taken");
            return 0;
        }
        for r in &reports {
            match report_from_wire(r) {
                Ok(outcome) => {
                    self.report(r, outcome);
                }
                Err(e) => debug!(booking = r.booking_id, error = %e.message(), "report skipped"),
            }
        }
        reports.len() as u32
    }

    /// Ends `r`'s booking with `outcome`: whether it was open.
    fn report(&self, r: &ReportOutcomeRequest, outcome: Outcome) -> bool {
        if outcome != Outcome::Success {
            debug!(booking = r.booking_id, ?outcome, error = %r.error, "attempt failed");
        }
        self.state.report(BookingId(r.booking_id), outcome)
    }
}

#[tonic::async_trait]
impl SchedulerRpc for SchedulerService {
    async fn select_prefill(
        &self,
        req: Request<SelectPrefillRequest>,
    ) -> Result<Response<SelectPrefillResponse>, Status> {
        let span = tracing::info_span!("select", trace_id = tracing::field::Empty);
        TraceContext::from_metadata(req.metadata()).bind(&span);
        let _entered = span.entered();
        let mut r = req.into_inner();
        // The reports first, whatever becomes of the selection: the caller counts on them.
        let taken = self.take_reports(std::mem::take(&mut r.reports));
        match self.select(r) {
            Ok(mut answer) => {
                answer.reports_taken = taken;
                Ok(Response::new(answer))
            }
            Err(mut refusal) => {
                refusal.metadata_mut().insert(REPORTS_TAKEN, taken.into());
                Err(refusal)
            }
        }
    }

    async fn report_outcome(
        &self,
        req: Request<ReportOutcomeRequest>,
    ) -> Result<Response<ReportOutcomeResponse>, Status> {
        let r = req.into_inner();
        let outcome = report_from_wire(&r)?;
        Ok(Response::new(ReportOutcomeResponse { closed: self.report(&r, outcome) }))
    }

    async fn report_outcomes(
        &self,
        req: Request<ReportOutcomesRequest>,
    ) -> Result<Response<ReportOutcomesResponse>, Status> {
        let reports = req.into_inner().reports;
        let outcomes = reports_from_wire(&reports)?;
        let closed = reports.iter().zip(outcomes).map(|(r, o)| self.report(r, o)).collect();
        Ok(Response::new(ReportOutcomesResponse { closed }))
    }

    async fn list_instances(
        &self,
        _req: Request<ListInstancesRequest>,
    ) -> Result<Response<ListInstancesResponse>, Status> {
        let instances = self
            .state
            .instances()
            .into_iter()
            .map(|s| InstanceStatus {
                instance_id: s.instance.id.to_string(),
                bootstrap_addr: s.instance.bootstrap_addr,
                prefill_addr: s.instance.grpc_addr,
                dp_size: s.instance.topology.dp,
                in_flight: s.in_flight,
                cached_blocks: s.cached_blocks,
                routable: s.routable,
                prefill_ns_per_token: (f64::from(s.token_cost_us) * 1e3) as u64,
                send_ns_per_token: (f64::from(s.send_cost_us) * 1e3) as u64,
                breaker_closed: s.breaker_closed,
                silent_ms: s.silent_for.as_millis().min(u128::from(u64::MAX)) as u64,
                model: s.instance.model,
                tp_size: s.instance.topology.tp,
                pp_size: s.instance.topology.pp,
            })
            .collect();
        Ok(Response::new(ListInstancesResponse { instances }))
    }
}

/// Serves the scheduler on `listener` until `shutdown` completes (over the cluster's mutual
/// TLS when its config has it).
pub async fn serve(
    listener: TcpListener,
    state: Arc<SchedulerState>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), GrpcError> {
    let tls = state.config().tls.clone();
    let router = handoff_proto::grpc::cluster_server()
        .add_service(SchedulerService::new(state).into_server());
    let served = handoff_proto::grpc::serve_cluster(router, listener, tls.as_ref(), shutdown);
    served.await.map_err(GrpcError::Serve)
}

#[cfg(test)]
mod tests;
