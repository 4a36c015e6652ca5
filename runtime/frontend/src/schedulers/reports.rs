//! Outcome reports to one scheduler replica, sent along with the selections that follow
//! them: a busy frontend's reports cost no call of their own. Reports that no selection
//! takes within the linger ([`LINGER`] by default; an idle frontend's) go in one call,
//! together. One sender at a
//! time per replica, started by the report that finds none running, ending when it wakes to
//! find nothing left.

use std::sync::Mutex;
use std::time::Duration;

use handoff_proto::auth;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{ReportOutcomeRequest, ReportOutcomesRequest};
use tokio_util::sync::CancellationToken;
use tonic::transport::Channel;
use tracing::debug;

/// Most reports in one call (the scheduler takes up to 4096).
pub(crate) const BATCH: usize = 1024;

/// How long a report waits for a selection to take it along before it is sent alone, by
/// default: a booking's load stays on its instance at most this much longer in the
/// replica's view.
pub const LINGER: std::time::Duration = std::time::Duration::from_millis(2);

/// Most reports waiting for one replica: past this a report is dropped, and its booking
/// expires on the replica (as a lost report's does).
pub(crate) const MAX_WAITING: usize = 65_536;

/// What [`ReportQueue::push`] did with a report.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Queued {
    /// No sender was running: the caller starts one.
    StartSender,
    /// The running sender takes it.
    Taken,
    /// Too many waiting: dropped.
    Dropped,
}

#[derive(Debug, Default)]
struct Waiting {
    reports: Vec<ReportOutcomeRequest>,
    sending: bool,
}

/// The reports waiting for one replica (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct ReportQueue {
    waiting: Mutex<Waiting>,
}

impl ReportQueue {
    fn lock(&self) -> std::sync::MutexGuard<'_, Waiting> {
        self.waiting.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Queues `r`.
    pub(crate) fn push(&self, r: ReportOutcomeRequest) -> Queued {
        let mut w = self.lock();
        if w.reports.len() >= MAX_WAITING {
            return Queued::Dropped;
        }
        w.reports.push(r);
        if w.sending {
            Queued::Taken
        } else {
            w.sending = true;
            Queued::StartSender
        }
    }

    /// The sender's next batch (oldest first, at most [`BATCH`]); `None` when nothing is
    /// left, and the sender stops: the next report starts another.
    pub(crate) fn next_batch(&self) -> Option<Vec<ReportOutcomeRequest>> {
        let mut w = self.lock();
        if w.reports.is_empty() {
            w.sending = false;
            return None;
        }
        let n = w.reports.len().min(BATCH);
        Some(w.reports.drain(..n).collect())
    }

    /// Up to a batch of reports for a selection to take along (oldest first); the sender,
    /// if running, finds what is left.
    pub(crate) fn take(&self) -> Vec<ReportOutcomeRequest> {
        let mut w = self.lock();
        let n = w.reports.len().min(BATCH);
        w.reports.drain(..n).collect()
    }

    /// Puts back reports a selection took and could not deliver (its replica did not
    /// answer): reports are idempotent, so one that did arrive after all changes nothing
    /// when sent again. Returns whether the caller must start a sender.
    pub(crate) fn put_back(&self, reports: Vec<ReportOutcomeRequest>) -> Queued {
        if reports.is_empty() {
            return Queued::Taken;
        }
        let mut w = self.lock();
        let room = MAX_WAITING.saturating_sub(w.reports.len());
        if room == 0 {
            return Queued::Dropped;
        }
        w.reports.extend(reports.into_iter().take(room));
        if std::mem::replace(&mut w.sending, true) { Queued::Taken } else { Queued::StartSender }
    }
}

/// How a sender reaches its replica.
pub(crate) struct Sender {
    pub(crate) replica: String,
    pub(crate) client: SchedulerClient<Channel>,
    pub(crate) token: Option<String>,
    /// Longest wait for one call.
    pub(crate) timeout: Duration,
    /// How long reports wait for a selection to take them along.
    pub(crate) linger: Duration,
}

impl Sender {
    /// Sends `queue`'s reports, each batch after the linger, until it finds none left (best
    /// effort: a batch that fails is not sent again, and its bookings expire on the replica).
    /// At shutdown, what waits goes at once.
    pub(crate) async fn run(
        mut self,
        queue: std::sync::Arc<ReportQueue>,
        shutdown: CancellationToken,
    ) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.linger) => {}
                _ = shutdown.cancelled() => {}
            }
            let Some(batch) = queue.next_batch() else { break };
            self.send(batch).await;
        }
    }

    async fn send(&mut self, reports: Vec<ReportOutcomeRequest>) {
        let n = reports.len();
        let batch = ReportOutcomesRequest { reports: reports.clone() };
        let req = auth::request(batch, self.token.as_deref());
        match tokio::time::timeout(self.timeout, self.client.report_outcomes(req)).await {
            Ok(Ok(_)) => {}
            // A replica older than batches: one call per report, as it takes them.
            Ok(Err(e)) if e.code() == tonic::Code::Unimplemented => {
                for r in reports {
                    let req = auth::request(r, self.token.as_deref());
                    let call = tokio::time::timeout(self.timeout, self.client.report_outcome(req));
                    if !matches!(call.await, Ok(Ok(_))) {
                        debug!(scheduler = %self.replica, "outcome not reported");
                    }
                }
            }
            Ok(Err(e)) => debug!(scheduler = %self.replica, error = %e, n, "outcomes not reported"),
            Err(_) => debug!(scheduler = %self.replica, n, "outcome reports timed out"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(booking_id: u64) -> ReportOutcomeRequest {
        ReportOutcomeRequest { booking_id, ..Default::default() }
    }

    /// The first report starts the sender; those that come while it sends go in its next
    /// batch, oldest first, at most a batch at a time; once it finds nothing it stops, and
    /// the next report starts another. Past the bound, reports are dropped.
    #[test]
    fn reports_gather_while_one_sender_sends() {
        let q = ReportQueue::default();
        assert_eq!(q.push(report(1)), Queued::StartSender);
        let first = q.next_batch().unwrap();
        assert_eq!(first.iter().map(|r| r.booking_id).collect::<Vec<_>>(), [1]);
        for b in 2..2 + BATCH as u64 + 5 {
            assert_eq!(q.push(report(b)), Queued::Taken, "a sender is running");
        }
        let next = q.next_batch().unwrap();
        assert_eq!(next.len(), BATCH);
        assert_eq!((next[0].booking_id, next[BATCH - 1].booking_id), (2, BATCH as u64 + 1));
        assert_eq!(q.next_batch().unwrap().len(), 5);
        assert!(q.next_batch().is_none(), "nothing left: the sender stops");
        assert_eq!(q.push(report(9)), Queued::StartSender, "the next report starts another");
        // A selection takes what waits along; what it could not deliver comes back for the
        // running sender (or starts one when none runs).
        let along = q.take();
        assert_eq!(along.iter().map(|r| r.booking_id).collect::<Vec<_>>(), [9]);
        assert!(q.take().is_empty());
        assert_eq!(q.put_back(along.clone()), Queued::Taken, "the sender still runs");
        assert_eq!(q.next_batch().unwrap().len(), 1);
        assert!(q.next_batch().is_none());
        assert_eq!(q.put_back(along), Queued::StartSender, "no sender ran");
        assert_eq!(q.put_back(Vec::new()), Queued::Taken, "nothing to send");
        for b in 1..MAX_WAITING as u64 {
            q.push(report(b));
        }
        assert_eq!(q.push(report(0)), Queued::Dropped);
        assert_eq!(q.put_back(vec![report(0)]), Queued::Dropped);
        assert_eq!(q.lock().reports.len(), MAX_WAITING);
    }
}
