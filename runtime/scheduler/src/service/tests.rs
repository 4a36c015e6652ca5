use handoff_discovery::{Instance, Role, Update};

use super::*;
use crate::SchedulerConfig;

fn booked(n: usize) -> (SchedulerService, Vec<u64>) {
    booked_with(n, SchedulerConfig::default())
}

fn booked_with(n: usize, cfg: SchedulerConfig) -> (SchedulerService, Vec<u64>) {
    let state = Arc::new(SchedulerState::new(cfg));
    state.apply_update(Update::Reset(vec![Instance {
        bootstrap_addr: "p0:1".into(),
        grpc_addr: "p0:2".into(),
        ..Instance::fixture("p0".parse().unwrap(), Role::Prefill)
    }]));
    let bookings = (0..n).map(|_| state.select(&Ask::new(&[BlockHash(1)], 16)).unwrap().booking.0);
    let bookings = bookings.collect();
    (SchedulerService::new(state), bookings)
}

fn report(booking_id: u64, outcome: WireOutcome) -> ReportOutcomeRequest {
    ReportOutcomeRequest { booking_id, outcome: outcome as i32, error: String::new() }
}

async fn batch(svc: &SchedulerService, reports: Vec<ReportOutcomeRequest>) -> Vec<bool> {
    let r = svc.report_outcomes(Request::new(ReportOutcomesRequest { reports })).await;
    r.map(|r| r.into_inner().closed).unwrap_or_else(|s| panic!("{s:?}"))
}

/// A batch closes each open booking it names and says which it closed, in order; one
/// malformed report refuses the whole batch, which then changed nothing.
#[tokio::test]
async fn a_batch_of_reports_closes_its_bookings_or_none() {
    let (svc, b) = booked(2);
    let bad = vec![report(b[0], WireOutcome::Success), report(0, WireOutcome::Success)];
    let refused = svc.report_outcomes(Request::new(ReportOutcomesRequest { reports: bad }));
    let s = refused.await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(s.message().contains("report 1"), "{}", s.message());
    let unknown = vec![report(b[0], WireOutcome::Unspecified)];
    let s = svc.report_outcomes(Request::new(ReportOutcomesRequest { reports: unknown }));
    assert_eq!(s.await.unwrap_err().code(), tonic::Code::InvalidArgument);
    let (ok, fault) = (WireOutcome::Success, WireOutcome::InstanceFault);
    let got = batch(&svc, vec![report(b[1], fault), report(b[0], ok), report(b[1], ok)]).await;
    assert_eq!(got, [true, true, false], "each open booking closed once");
    assert_eq!(batch(&svc, vec![]).await, Vec::<bool>::new());
    let many = vec![report(b[0], WireOutcome::Success); MAX_REPORTS + 1];
    let s = svc.report_outcomes(Request::new(ReportOutcomesRequest { reports: many }));
    assert_eq!(s.await.unwrap_err().code(), tonic::Code::InvalidArgument);
}

fn ask(reports: Vec<ReportOutcomeRequest>) -> SelectPrefillRequest {
    SelectPrefillRequest { block_hashes: vec![1], prompt_tokens: 16, reports, ..Default::default() }
}

/// Reports sent along with a selection end their bookings before it books: with room for
/// one booking, the selection finds room only if the report came first. A malformed report
/// is skipped without failing the selection; the answer counts every report taken.
#[tokio::test]
async fn reports_along_with_a_selection_end_before_it_books() {
    let (svc, b) = booked_with(1, SchedulerConfig { max_bookings: 1, ..Default::default() });
    let full = svc.select_prefill(Request::new(ask(vec![]))).await.unwrap_err();
    assert_eq!(full.code(), tonic::Code::ResourceExhausted, "room for one booking only");
    let along = vec![report(0, WireOutcome::Success), report(b[0], WireOutcome::Success)];
    let sel = svc.select_prefill(Request::new(ask(along))).await.unwrap().into_inner();
    assert_ne!(sel.booking_id, b[0]);
    assert_eq!(sel.reports_taken, 2, "the malformed one taken (skipped) too");
    assert_eq!(svc.state.open_bookings(), 1, "the first ended, the second began");
    let again = batch(&svc, vec![report(b[0], WireOutcome::Success)]).await;
    assert_eq!(again, [false], "already ended");
}

/// A selection refused (here for an unknown policy) still took its reports, and says so
/// in the refusal's metadata; past the bound none is taken.
#[tokio::test]
async fn a_refused_selection_says_how_many_reports_it_took() {
    let (svc, b) = booked(1);
    let mut bad = ask(vec![report(b[0], WireOutcome::Success)]);
    bad.policy = 99;
    let s = svc.select_prefill(Request::new(bad)).await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    let taken = s.metadata().get(REPORTS_TAKEN).and_then(|v| v.to_str().ok());
    assert_eq!(taken, Some("1"));
    assert_eq!(svc.state.open_bookings(), 0, "the report ended its booking");
    let many = ask(vec![report(b[0], WireOutcome::Success); MAX_REPORTS + 1]);
    let sel = svc.select_prefill(Request::new(many)).await.unwrap().into_inner();
    assert_eq!(sel.reports_taken, 0);
}

/// A selection naming its frontend books for it; a name that is no id is refused, saying
/// which field, and books nothing.
#[tokio::test]
async fn a_frontend_id_that_is_no_id_is_refused() {
    use handoff_proto::v1::SelectPrefillRequest;
    let (svc, _) = booked(0);
    let ask = |frontend_id: &str| SelectPrefillRequest {
        block_hashes: vec![1],
        prompt_tokens: 16,
        frontend_id: frontend_id.into(),
        ..Default::default()
    };
    let s = svc.select_prefill(Request::new(ask("bad id\n"))).await.unwrap_err();
    assert_eq!(s.code(), tonic::Code::InvalidArgument);
    assert!(s.message().contains("frontend_id"), "{}", s.message());
    assert_eq!(svc.state.open_bookings(), 0);
    svc.select_prefill(Request::new(ask("frontend-1"))).await.unwrap();
    let now = std::time::Instant::now();
    assert_eq!(svc.state.frontend_left_at(&"frontend-1".parse().unwrap(), now), 1);
}

/// A selection says how many dp ranks the chosen instance has, for the frontend to mint an
/// SGLang room on the chosen one.
#[tokio::test]
async fn a_selection_says_the_instances_dp_ranks() {
    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let mut p = Instance::fixture("p0".parse().unwrap(), Role::Prefill);
    p.topology.dp = 4;
    state.apply_update(Update::Reset(vec![p]));
    let svc = SchedulerService::new(state);
    let sel = svc.select_prefill(Request::new(ask(vec![]))).await.unwrap().into_inner();
    assert_eq!((sel.dp_size, sel.dp_rank < 4), (4, true));
}

/// An outcome this build does not know (a newer frontend's, during a rolling upgrade) ends
/// its booking as cancelled, and the rest of its batch is applied: refused, the whole batch
/// held its bookings' load until they expired.
#[tokio::test]
async fn an_outcome_from_a_newer_build_ends_its_booking_blaming_no_one() {
    let (svc, b) = booked(2);
    let newer = ReportOutcomeRequest { booking_id: b[0], outcome: 99, error: String::new() };
    let got = batch(&svc, vec![newer, report(b[1], WireOutcome::Success)]).await;
    assert_eq!(got, [true, true]);
    assert_eq!(svc.state.open_bookings(), 0);
    assert_eq!(outcome_from_wire(99).unwrap(), Outcome::Cancelled);
}
