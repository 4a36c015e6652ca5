use super::*;

fn report(booking_id: u64) -> ReportOutcomeRequest {
    ReportOutcomeRequest { booking_id, ..Default::default() }
}

fn ids(rs: &[Stamped]) -> Vec<u64> {
    rs.iter().map(|(_, r)| r.booking_id).collect()
}

const MS: Duration = Duration::from_millis(1);

/// The first report starts the sender; the sender sends only reports whose linger is over
/// (oldest first, at most a batch at a time) and otherwise waits for the oldest one's; once
/// it finds nothing it stops, and the next report starts another. Times are arguments.
#[test]
fn the_sender_sends_each_report_once_its_linger_is_over() {
    let q = ReportQueue::default();
    let t0 = Instant::now();
    assert_eq!(q.push(report(1), t0), Queued::StartSender);
    assert_eq!(q.push(report(2), t0 + MS), Queued::Taken, "a sender is running");
    assert_eq!(q.due(t0 + MS, 2 * MS), Due::Wait(MS), "the oldest lingers 1 ms more");
    let Due::Send(first) = q.due(t0 + 2 * MS, 2 * MS) else { panic!("the oldest is due") };
    assert_eq!(ids(&first), [1], "only the report whose linger is over");
    assert_eq!(q.due(t0 + 2 * MS, 2 * MS), Due::Wait(MS));
    for b in 3..3 + BATCH as u64 + 5 {
        q.push(report(b), t0 + 2 * MS);
    }
    let Due::Send(next) = q.due(t0 + 10 * MS, 2 * MS) else { panic!("due") };
    assert_eq!((next.len(), next[0].1.booking_id), (BATCH, 2), "a batch at a time, oldest first");
    let Due::Send(rest) = q.due(t0 + 10 * MS, 2 * MS) else { panic!("due") };
    assert_eq!(rest.len(), 6);
    assert_eq!(q.due(t0 + 10 * MS, 2 * MS), Due::Done, "nothing left: the sender stops");
    assert_eq!(q.push(report(9), t0), Queued::StartSender, "the next report starts another");
}

/// A selection takes what waits along (up to its bound); what the replica did not say it
/// took comes back in age order for the sender (or starts one when none runs); a replica
/// that answered without taking them gets none along for a while, then is tried again.
/// Past the bound, reports drop. Times are arguments.
#[test]
fn selections_take_reports_along_and_put_back_what_was_not_taken() {
    let q = ReportQueue::default();
    let t0 = Instant::now();
    for b in 0..ALONG as u64 + 3 {
        q.push(report(b), t0 + MS * b as u32);
    }
    let along = q.take(t0);
    assert_eq!((along.len(), along[0].1.booking_id), (ALONG, 0));
    q.push(report(1000), t0 + Duration::from_secs(1));
    assert_eq!(q.put_back(along, true, t0), Queued::Taken, "the sender still runs");
    let Due::Send(all) = q.due(t0 + Duration::from_secs(9), MS) else { panic!("due") };
    assert_eq!(all.len(), ALONG + 4);
    assert!(all.windows(2).all(|w| w[0].1.booking_id < w[1].1.booking_id), "oldest first");
    assert_eq!(q.due(t0, MS), Due::Done);
    assert_eq!(q.put_back(vec![(t0, report(1))], true, t0), Queued::StartSender, "none ran");
    assert_eq!(q.put_back(Vec::new(), false, t0), Queued::Taken, "nothing to send");
    assert!(q.take(t0).is_empty(), "a replica that does not take reports along gets none");
    assert!(q.take(t0 + RETRY_ALONG - MS).is_empty(), "for a while");
    assert_eq!(q.take(t0 + RETRY_ALONG).len(), 1, "then it is tried again");
    for b in 0..MAX_WAITING as u64 {
        q.push(report(b), t0);
    }
    assert_eq!(q.push(report(0), t0), Queued::Dropped);
    assert_eq!(q.put_back(vec![(t0, report(0))], true, t0), Queued::Dropped);
    assert_eq!(q.lock().reports.len(), MAX_WAITING);
}

/// A batch the replica does not answer is tried again (here it is down for its first two
/// calls) and reaches it: the booking's load comes off. Before, the batch was dropped and the
/// booking stayed open until it expired.
#[tokio::test]
async fn a_batch_the_replica_did_not_answer_is_sent_again() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use handoff_discovery::{Instance, Role, Update};
    use handoff_scheduler::state::Ask;
    use handoff_scheduler::{SchedulerConfig, SchedulerState};
    use tower::{Service, ServiceExt};

    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    state
        .apply_update(Update::Reset(vec![Instance::fixture("p0".parse().unwrap(), Role::Prefill)]));
    let booking = state.select(&Ask::new(&[], 10)).unwrap().booking;
    assert_eq!(state.open_bookings(), 1);
    // The replica's own service, in this process, behind a fake outage of two calls.
    let server = handoff_scheduler::service::SchedulerService::new(state.clone()).into_server();
    let down = Arc::new(AtomicUsize::new(2));
    let flaky = tower::service_fn(move |req| {
        let (mut server, down) = (server.clone(), down.clone());
        async move {
            if down.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |d| d.checked_sub(1)).is_ok() {
                return Ok(tonic::Status::unavailable("down for now").into_http());
            }
            type Req = tonic::codegen::http::Request<tonic::body::Body>;
            let answer = ServiceExt::<Req>::ready(&mut server).await?.call(req).await?;
            Ok::<_, std::convert::Infallible>(answer.map(tonic::body::Body::new))
        }
    });
    let sender = Sender {
        replica: "flaky".into(),
        client: SchedulerClient::new(super::super::channel::in_process(flaky)),
        token: None,
        timeout: Duration::from_secs(5),
        linger: Duration::ZERO,
    };
    let queue = Arc::new(ReportQueue::default());
    let outcome = handoff_proto::v1::Outcome::Success as i32;
    let r = ReportOutcomeRequest { booking_id: booking.0, outcome, ..Default::default() };
    assert_eq!(queue.push(r, Instant::now()), Queued::StartSender);
    let sent = sender.run(queue, CancellationToken::new());
    tokio::time::timeout(Duration::from_secs(30), sent).await.expect("the sender ends");
    assert_eq!(state.open_bookings(), 0, "the report reached the replica");
}
