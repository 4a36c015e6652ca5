//! A frontend's pool of scheduler replicas: a replica that answers "no instance" is up (the
//! next one is asked, this one is not passed over); one that is gone is passed over; one in
//! the frontend's own process is asked like the others.

use std::sync::Arc;
use std::time::Duration;

use handoff_core::block_hashes;
use handoff_discovery::{Instance, Role, Update};
use handoff_frontend::Schedulers;
use handoff_frontend::schedulers::SelectFailure;
use handoff_proto::v1::SelectPrefillRequest;
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// A scheduler replica on a free port, knowing `instances`; dropping the sender stops it.
async fn replica(instances: &[&str]) -> (String, oneshot::Sender<()>) {
    let (addr, _, stop) = replica_with_state(instances).await;
    (addr, stop)
}

/// [`replica`], and its state.
async fn replica_with_state(
    instances: &[&str],
) -> (String, Arc<SchedulerState>, oneshot::Sender<()>) {
    let state = state_knowing(instances);
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (stop, stopped) = oneshot::channel::<()>();
    tokio::spawn(handoff_scheduler::service::serve(l, state.clone(), async {
        let _ = stopped.await;
    }));
    (addr, state, stop)
}

/// A scheduler replica's state knowing `instances`, served nowhere.
fn state_knowing(instances: &[&str]) -> Arc<SchedulerState> {
    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let all =
        instances.iter().map(|id| Instance::fixture(id.parse().unwrap(), Role::Prefill)).collect();
    state.apply_update(Update::Reset(all));
    state
}

fn ask() -> SelectPrefillRequest {
    let tokens: Vec<u32> = (0..64).collect();
    SelectPrefillRequest {
        block_hashes: block_hashes(&tokens, 16).into_iter().map(|h| h.0).collect(),
        prompt_tokens: 64,
        ..Default::default()
    }
}

#[tokio::test]
async fn a_replica_without_instances_is_asked_past_and_not_suspected() {
    let (empty, _e) = replica(&[]).await;
    let (full, _f) = replica(&["p0"]).await;
    let tasks = handoff_core::Tasks::new();
    let pool = Schedulers::new(Duration::from_secs(1), &tasks);
    pool.reset(&[empty.clone(), full.clone()]).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    for _ in 0..20 {
        let s = pool
            .select(ask(), deadline, &Default::default())
            .await
            .expect("the replica with an instance answers");
        assert_eq!((s.replica.as_str(), s.selection.instance_id.as_str()), (full.as_str(), "p0"));
    }
    assert!(pool.suspects().is_empty(), "nobody failed: {:?}", pool.suspects());

    // Nobody knows an instance: that is the answer, and still nobody is suspect.
    let (other_empty, _o) = replica(&[]).await;
    pool.reset(&[empty.clone(), other_empty]).unwrap();
    match pool.select(ask(), deadline, &Default::default()).await {
        Err(SelectFailure::Answer(s)) => {
            assert_eq!(s.code(), tonic::Code::Unavailable);
            assert!(s.message().contains("no prefill instance"), "{}", s.message());
        }
        other => panic!("expected the replicas' answer, got {other:?}"),
    }
    assert!(pool.suspects().is_empty(), "{:?}", pool.suspects());

    // A replica that is gone is passed over for a while.
    pool.reset(&[empty.clone(), full.clone()]).unwrap();
    drop(_f);
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(pool.select(ask(), deadline, &Default::default()).await.is_err());
    assert_eq!(pool.suspects(), vec![full]);
}

/// A replica that accepts connections and never answers. Asked under a request deadline
/// shorter than the pool's own wait, it is not at fault and is not passed over; asked until
/// the pool's own wait ends, it is.
#[tokio::test]
async fn a_replica_is_passed_over_for_its_own_silence_not_for_a_requests_short_deadline() {
    let mute = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = mute.local_addr().unwrap().to_string();
    let tasks = handoff_core::Tasks::new();
    let pool = Schedulers::new(Duration::from_secs(30), &tasks);
    pool.reset(std::slice::from_ref(&addr)).unwrap();
    let short = tokio::time::Instant::now() + Duration::from_millis(100);
    assert!(pool.select(ask(), short, &Default::default()).await.is_err());
    assert!(pool.suspects().is_empty(), "suspected for the request's deadline");

    let pool = Schedulers::new(Duration::from_millis(100), &tasks);
    pool.reset(std::slice::from_ref(&addr)).unwrap();
    let long = tokio::time::Instant::now() + Duration::from_secs(30);
    assert!(pool.select(ask(), long, &Default::default()).await.is_err());
    assert_eq!(pool.suspects(), vec![addr]);
    drop(mute);
    tasks.shutdown().await;
}

/// A booking's report goes along with the next selection asked of its replica, which ends
/// it before booking anew; one that no selection takes goes on its own once its linger is
/// over. Lingers are arguments: an hour (only a selection can have carried the report) and
/// a millisecond.
#[tokio::test]
async fn reports_go_along_with_the_next_selection_or_alone_after_their_linger() {
    use handoff_proto::v1::{Outcome, ReportOutcomeRequest};
    let (addr, state, _s) = replica_with_state(&["p0"]).await;
    let tasks = handoff_core::Tasks::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let done = |s: &handoff_frontend::schedulers::Selected| ReportOutcomeRequest {
        booking_id: s.selection.booking_id,
        outcome: Outcome::Success as i32,
        error: String::new(),
    };

    let pool = Schedulers::new(Duration::from_secs(1), &tasks)
        .with_report_linger(Duration::from_secs(3600));
    pool.reset(std::slice::from_ref(&addr)).unwrap();
    let first = pool.select(ask(), deadline, &Default::default()).await.unwrap();
    assert_eq!(state.open_bookings(), 1);
    pool.report(&addr, done(&first));
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(state.open_bookings(), 1, "the report waits for a selection");
    let second = pool.select(ask(), deadline, &Default::default()).await.unwrap();
    assert_eq!(state.open_bookings(), 1, "the first booking ended, the second began");
    assert_ne!(first.selection.booking_id, second.selection.booking_id);

    let pool = Schedulers::new(Duration::from_secs(1), &tasks)
        .with_report_linger(Duration::from_millis(1));
    pool.reset(std::slice::from_ref(&addr)).unwrap();
    pool.report(&addr, done(&second));
    let since = std::time::Instant::now();
    while state.open_bookings() > 0 {
        assert!(since.elapsed() < Duration::from_secs(10), "the report went alone");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tasks.shutdown().await;
}

/// A replica in the frontend's own process, called through its service with no socket:
/// it books, its refusals are answers (it is not passed over for them), and the outcome
/// reports reach it.
#[tokio::test]
async fn a_replica_in_this_process_books_refuses_and_takes_reports() {
    use handoff_frontend::schedulers::channel::in_process;
    use handoff_proto::v1::{Outcome, ReportOutcomeRequest};
    let state = state_knowing(&["p0"]);
    let tasks = handoff_core::Tasks::new();
    let pool = Schedulers::new(Duration::from_secs(1), &tasks)
        .with_report_linger(Duration::from_millis(1));
    let service = handoff_scheduler::service::SchedulerService::new(state.clone()).into_server();
    pool.add_in_process("in-process", in_process(service));
    assert_eq!(pool.addrs(), ["in-process"]);
    pool.reset(&[]).unwrap();
    assert_eq!(pool.addrs(), ["in-process"], "discovery's list does not name it, and keeps it");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);

    let s = pool.select(ask(), deadline, &Default::default()).await.expect("it answers");
    assert_eq!((s.replica.as_str(), s.selection.instance_id.as_str()), ("in-process", "p0"));
    assert_eq!(state.open_bookings(), 1);

    let bad = SelectPrefillRequest { policy: 99, ..ask() };
    match pool.select(bad, deadline, &Default::default()).await {
        Err(SelectFailure::Answer(s)) => assert_eq!(s.code(), tonic::Code::InvalidArgument),
        other => panic!("expected its refusal, got {other:?}"),
    }
    assert!(pool.suspects().is_empty(), "{:?}", pool.suspects());

    let done = ReportOutcomeRequest {
        booking_id: s.selection.booking_id,
        outcome: Outcome::Success as i32,
        error: String::new(),
    };
    pool.report("in-process", done);
    let since = std::time::Instant::now();
    while state.open_bookings() > 0 {
        assert!(since.elapsed() < Duration::from_secs(10), "the report reached it");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    tasks.shutdown().await;
}
