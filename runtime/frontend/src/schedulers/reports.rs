//! Outcome reports to one scheduler replica, sent along with the selections that follow
//! them: a busy frontend's reports cost no call of their own. A report that no selection
//! takes within the linger ([`LINGER`] by default: an idle frontend's) goes in a call of its
//! own, with the others of its age. One sender at a time per replica, started by the report
//! that finds none running, ending when it finds nothing left to wait for.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::Duration;

use handoff_proto::auth;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{ReportOutcomeRequest, ReportOutcomesRequest};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

/// Most reports in one call of their own (the scheduler takes up to 4096).
pub(crate) const BATCH: usize = 1024;

/// Most reports one selection takes along: its request stays small.
pub(crate) const ALONG: usize = 256;

/// How long a report waits for a selection to take it along before it is sent alone, by
/// default: a booking's load stays on its instance at most this much longer in the
/// replica's view.
pub const LINGER: Duration = Duration::from_millis(2);

/// How long a replica that answered without taking reports along gets none along, before a
/// selection tries again (it may have been upgraded in place since).
pub(crate) const RETRY_ALONG: Duration = Duration::from_secs(60);

/// Most reports waiting for one replica: past this a report is dropped, and its booking
/// expires on the replica (as a lost report's does).
pub(crate) const MAX_WAITING: usize = 65_536;

/// How long a report that could not be delivered (the replica did not answer) is tried
/// again: past it, its booking has expired on the replica anyway (a booking lives at most
/// the scheduler's `booking_ttl_max`, 10 minutes by default).
pub(crate) const RETRY_FOR: Duration = Duration::from_secs(600);

/// The first wait before trying an undelivered batch again; it doubles up to
/// [`RETRY_AT_MOST`] while the replica does not answer.
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_AT_MOST: Duration = Duration::from_secs(2);

/// What queueing did with reports.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Queued {
    /// No sender was running: the caller starts one.
    StartSender,
    /// The running sender takes them.
    Taken,
    /// Too many waiting: dropped.
    Dropped,
}

/// What the sender does next.
#[derive(Debug, PartialEq)]
pub(crate) enum Due {
    /// Send these (their linger is over).
    Send(Vec<Stamped>),
    /// Wait this long: the oldest report's linger is not over yet.
    Wait(Duration),
    /// Nothing waits: the sender stops, and the next report starts another.
    Done,
}

/// A report and when it was queued.
pub(crate) type Stamped = (Instant, ReportOutcomeRequest);

#[derive(Debug, Default)]
struct Waiting {
    /// Oldest first.
    reports: VecDeque<Stamped>,
    sending: bool,
    /// Until when selections take no reports along: the replica answered one without
    /// taking them (one older than reports along).
    none_along_until: Option<Instant>,
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

    /// Queues `r`, reported at `now`.
    pub(crate) fn push(&self, r: ReportOutcomeRequest, now: Instant) -> Queued {
        let mut w = self.lock();
        if w.reports.len() >= MAX_WAITING {
            return Queued::Dropped;
        }
        w.reports.push_back((now, r));
        Self::sender_needed(&mut w)
    }

    fn sender_needed(w: &mut Waiting) -> Queued {
        if std::mem::replace(&mut w.sending, true) { Queued::Taken } else { Queued::StartSender }
    }

    /// Up to [`ALONG`] waiting reports for a selection at `now` to take along (oldest
    /// first); none while the replica is known not to take them.
    pub(crate) fn take(&self, now: Instant) -> Vec<Stamped> {
        let mut w = self.lock();
        match w.none_along_until {
            Some(until) if now < until => return Vec::new(),
            Some(_) => w.none_along_until = None,
            None => {}
        }
        let n = w.reports.len().min(ALONG);
        w.reports.drain(..n).collect()
    }

    /// Puts back reports a selection took and the replica did not say it took (it did not
    /// answer, or it is older than reports along): reports are idempotent, so one that did
    /// arrive after all changes nothing when sent again. With `along` false (the replica
    /// answered without taking them), selections take none along to it for
    /// [`RETRY_ALONG`] from `now`.
    pub(crate) fn put_back(&self, reports: Vec<Stamped>, along: bool, now: Instant) -> Queued {
        let mut w = self.lock();
        if !along {
            w.none_along_until = Some(now + RETRY_ALONG);
        }
        if reports.is_empty() {
            return Queued::Taken;
        }
        let room = MAX_WAITING.saturating_sub(w.reports.len());
        if room == 0 {
            return Queued::Dropped;
        }
        // They were the oldest when taken: back at the front, in their order.
        for r in reports.into_iter().take(room).rev() {
            w.reports.push_front(r);
        }
        Self::sender_needed(&mut w)
    }

    /// What the sender does at `now` with reports lingering `linger`.
    pub(crate) fn due(&self, now: Instant, linger: Duration) -> Due {
        let mut w = self.lock();
        let Some((oldest, _)) = w.reports.front() else {
            w.sending = false;
            return Due::Done;
        };
        let ripe = |at: &Instant| now.saturating_duration_since(*at) >= linger;
        if !ripe(oldest) {
            return Due::Wait(linger - now.saturating_duration_since(*oldest));
        }
        let n = w.reports.iter().take(BATCH).take_while(|(at, _)| ripe(at)).count();
        Due::Send(w.reports.drain(..n).collect())
    }
}

/// Where one replica's reports go: its queue, and how a sender reaches it. A lease holds it
/// from its selection on, so a booking's report reaches the replica that made it even when
/// discovery drops the replica meanwhile (its lease in etcd lapsed while it still answers).
#[derive(Clone)]
pub(crate) struct ReportTo {
    pub(crate) replica: String,
    pub(crate) client: SchedulerClient<super::ReplicaChannel>,
    pub(crate) queue: std::sync::Arc<ReportQueue>,
    pub(crate) token: Option<String>,
    /// Longest wait for one call of a sender's.
    pub(crate) timeout: Duration,
    /// How long reports wait for a selection to take them along.
    pub(crate) linger: Duration,
    /// Where a sender runs.
    pub(crate) tasks: handoff_core::Tasks,
}

impl std::fmt::Debug for ReportTo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReportTo").field("replica", &self.replica).finish_non_exhaustive()
    }
}

impl ReportTo {
    /// Queues `req` for the replica (see the module docs).
    pub(crate) fn report(&self, req: ReportOutcomeRequest) {
        let queued = self.queue.push(req, Instant::now());
        self.after_queueing(queued);
    }

    /// Puts back reports a selection took along and the replica did not say it took (see
    /// [`ReportQueue::put_back`]).
    pub(crate) fn put_back(&self, reports: Vec<Stamped>, along: bool) {
        let queued = self.queue.put_back(reports, along, Instant::now());
        self.after_queueing(queued);
    }

    /// Starts a sender if the queueing said so.
    fn after_queueing(&self, queued: Queued) {
        match queued {
            Queued::Taken => {}
            Queued::Dropped => {
                debug!(scheduler = %self.replica, "outcome not reported: too many waiting")
            }
            Queued::StartSender => {
                let sender = Sender {
                    replica: self.replica.clone(),
                    client: self.client.clone(),
                    token: self.token.clone(),
                    timeout: self.timeout,
                    linger: self.linger,
                };
                let queue = self.queue.clone();
                self.tasks.spawn(sender.run(queue, self.tasks.shutdown_token()));
            }
        }
    }
}

/// How a sender reaches its replica.
struct Sender {
    replica: String,
    client: SchedulerClient<super::ReplicaChannel>,
    token: Option<String>,
    /// Longest wait for one call.
    timeout: Duration,
    /// How long reports wait for a selection to take them along.
    linger: Duration,
}

impl Sender {
    /// Sends `queue`'s reports as their linger ends, until it finds none waiting. A batch
    /// the replica did not answer is put back and tried again after a wait (doubling while
    /// it does not answer), each report for [`RETRY_FOR`] after it was made: a short outage
    /// of the replica does not leave its bookings' load counted until they expire. At
    /// shutdown, what waits goes at once, once.
    async fn run(mut self, queue: std::sync::Arc<ReportQueue>, shutdown: CancellationToken) {
        // The first look is at once: reports put back may be due already.
        let mut wait = Duration::ZERO;
        let mut retry = RETRY_FIRST;
        loop {
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = shutdown.cancelled() => {}
            }
            let linger = if shutdown.is_cancelled() { Duration::ZERO } else { self.linger };
            match queue.due(Instant::now(), linger) {
                Due::Send(batch) => {
                    if self.send(&batch).await || shutdown.is_cancelled() {
                        (wait, retry) = (Duration::ZERO, RETRY_FIRST);
                        continue;
                    }
                    let now = Instant::now();
                    let live = |(at, _): &Stamped| now.saturating_duration_since(*at) < RETRY_FOR;
                    queue.put_back(batch.into_iter().filter(live).collect(), true, now);
                    (wait, retry) = (retry, (retry * 2).min(RETRY_AT_MOST));
                }
                Due::Wait(d) => wait = d,
                Due::Done => break,
            }
        }
    }

    /// Sends `stamped`'s reports; `false` when the replica did not answer (worth trying
    /// again).
    async fn send(&mut self, stamped: &[Stamped]) -> bool {
        let n = stamped.len();
        let reports = stamped.iter().map(|(_, r)| r.clone()).collect();
        let batch = ReportOutcomesRequest { reports };
        let req = auth::request(batch, self.token.as_deref());
        match tokio::time::timeout(self.timeout, self.client.report_outcomes(req)).await {
            Ok(Ok(_)) => true,
            // A replica older than batches: one call per report, as it takes them.
            Ok(Err(e)) if e.code() == tonic::Code::Unimplemented => {
                for (_, r) in stamped {
                    let req = auth::request(r.clone(), self.token.as_deref());
                    let call = tokio::time::timeout(self.timeout, self.client.report_outcome(req));
                    if !matches!(call.await, Ok(Ok(_))) {
                        debug!(scheduler = %self.replica, "outcome not reported");
                    }
                }
                true
            }
            Ok(Err(e)) => {
                debug!(scheduler = %self.replica, error = %e, n, "outcomes not reported");
                // Refused for what they are (their form, the token) they would be again.
                !matches!(
                    e.code(),
                    tonic::Code::Unavailable
                        | tonic::Code::Unknown
                        | tonic::Code::DeadlineExceeded
                        | tonic::Code::Cancelled
                )
            }
            Err(_) => {
                debug!(scheduler = %self.replica, n, "outcome reports timed out");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests;
