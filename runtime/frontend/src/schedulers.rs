//! [`Schedulers`]: the scheduler replicas a frontend may ask, kept current from discovery
//! (or fixed by flag). A selection goes to a replica at random; a replica that cannot be
//! reached, or does not answer within the selection timeout, is passed over for the next one
//! and is avoided for a while. Each booking is reported to the replica that made it, along
//! with the next selection asked of it or soon on its own ([`reports`]).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use handoff_core::tls::ClusterTls;
use handoff_proto::auth;
use handoff_proto::grpc::cluster_channel;
use handoff_proto::metadata::{NO_INSTANCE, REPORTS_TAKEN};
use handoff_proto::trace::{TraceContext, traced};
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{
    Outcome, ReportOutcomeRequest, SelectPrefillRequest, SelectPrefillResponse,
};
use tracing::{debug, info, warn};

use crate::FrontendError;

pub mod channel;
pub mod reports;

pub use channel::ReplicaChannel;

use reports::{ReportQueue, ReportTo};

/// How long a replica that failed a call is tried only after the others.
const SUSPECT_FOR: Duration = Duration::from_secs(5);

/// Failed calls in a row after which a replica kept unlisted is dropped (one is a blip: a
/// slow answer, a connection being made again).
const UNLISTED_FAILURES: u32 = 3;

#[derive(Debug, Clone)]
struct Replica {
    client: SchedulerClient<ReplicaChannel>,
    /// Runs in this process ([`Schedulers::add_in_process`]): discovery does not list it.
    in_process: bool,
    /// Kept though discovery's list no longer names it (see [`Schedulers::reset`]): dropped
    /// after [`UNLISTED_FAILURES`] failed calls in a row.
    unlisted: bool,
    /// Calls failed in a row.
    failures: u32,
    /// Failed a call recently: tried after the others until then.
    suspect_until: Option<Instant>,
    /// Outcome reports waiting to go to it.
    reports: Arc<ReportQueue>,
}

impl Replica {
    /// A replica at an address, reached through `channel` ([`channel::remote`]).
    fn remote(channel: ReplicaChannel) -> Self {
        Self::reached(channel, false)
    }

    /// A replica in this process, reached through `channel` ([`channel::in_process`]).
    fn in_process(channel: ReplicaChannel) -> Self {
        Self::reached(channel, true)
    }

    /// Not suspect, with no reports waiting.
    fn reached(channel: ReplicaChannel, in_process: bool) -> Self {
        let client = SchedulerClient::new(channel);
        Replica {
            client,
            in_process,
            unlisted: false,
            failures: 0,
            suspect_until: None,
            reports: Arc::default(),
        }
    }
}

/// The scheduler replicas (see the module docs).
pub struct Schedulers {
    replicas: Mutex<BTreeMap<String, Replica>>,
    /// Longest wait for one replica's answer before trying the next.
    select_timeout: Duration,
    /// The cluster's token, sent as a bearer token.
    token: Option<String>,
    tls: Option<ClusterTls>,
    /// Where report senders run.
    tasks: handoff_core::Tasks,
    /// How long a report waits for a selection to take it along.
    report_linger: Duration,
    /// This frontend's id in discovery, named in each selection: its bookings expire soon
    /// after its registration ends.
    owner: std::sync::OnceLock<String>,
}

impl std::fmt::Debug for Schedulers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Schedulers")
            .field("replicas", &self.addrs())
            .field("select_timeout", &self.select_timeout)
            .finish_non_exhaustive()
    }
}

/// A selection, and the replica that holds its booking.
#[derive(Debug, Clone)]
pub struct Selected {
    /// The replica's address (or the name of one in this process).
    pub replica: String,
    /// Its answer.
    pub selection: SelectPrefillResponse,
    /// Where the booking's report goes.
    pub(crate) report_to: ReportTo,
}

/// How long an answer that came too late is waited for, to end the booking it made.
const LATE_ANSWER_FOR: Duration = Duration::from_secs(60);

/// Whether a failed call says the replica is unreachable or broken (try another one), as
/// opposed to an answer from a working replica. One refusing this frontend's credentials is
/// of no use to it either: passed over, and with every replica so this frontend is not ready
/// (a rollout with a wrong token stops at its first pod), where before it answered every
/// request 503 while ready.
fn replica_failed(s: &tonic::Status) -> bool {
    use tonic::Code::*;
    matches!(
        s.code(),
        Unavailable
            | Unknown
            | Cancelled
            | Internal
            | DeadlineExceeded
            | Unauthenticated
            | PermissionDenied
    )
}

impl Schedulers {
    /// No replicas yet; each call to one waits at most `select_timeout`; reports that no
    /// selection takes along are sent on `tasks`.
    pub fn new(select_timeout: Duration, tasks: &handoff_core::Tasks) -> Self {
        Schedulers {
            replicas: Mutex::default(),
            select_timeout,
            token: None,
            tls: None,
            tasks: tasks.clone(),
            report_linger: reports::LINGER,
            owner: std::sync::OnceLock::new(),
        }
    }

    /// Names this frontend's registration `id` in every selection from now on (the first
    /// name given stays): the replicas have its open bookings expire soon after the
    /// registration ends.
    pub fn set_owner(&self, id: &str) {
        let _ = self.owner.set(id.to_owned());
    }

    /// Reports wait up to `linger` for a selection to take them along (instead of
    /// [`reports::LINGER`]).
    pub fn with_report_linger(mut self, linger: Duration) -> Self {
        self.report_linger = linger;
        self
    }

    /// Calls replicas over the cluster's mutual TLS.
    pub fn with_tls(mut self, tls: Option<ClusterTls>) -> Self {
        self.tls = tls;
        self
    }

    /// Sends `token` (the cluster's) as a bearer token on every call.
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Replica>> {
        self.replicas.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds the replica at `addr` (host:port); known ones are kept as they are.
    pub fn add(&self, addr: &str) -> Result<(), FrontendError> {
        let mut map = self.lock();
        if !map.contains_key(addr) {
            let channel = cluster_channel(addr, self.tls.as_ref(), Duration::from_secs(1))
                .map_err(|e| FrontendError::Invalid(e.to_string()))?;
            map.insert(addr.to_owned(), Replica::remote(channel::remote(channel)));
            info!(scheduler = addr, replicas = map.len(), "scheduler replica added");
        }
        Ok(())
    }

    /// Adds a replica that runs in this process, named `name` (in place of an address),
    /// reached through `channel` ([`channel::in_process`]). A name already known is kept as
    /// it is; [`Schedulers::reset`] (discovery's list) leaves it in place.
    pub fn add_in_process(&self, name: &str, channel: ReplicaChannel) {
        let mut map = self.lock();
        if !map.contains_key(name) {
            map.insert(name.to_owned(), Replica::in_process(channel));
            info!(
                scheduler = name,
                replicas = map.len(),
                "scheduler replica added (in this process)"
            );
        }
    }

    /// Keeps exactly `addrs`, and the replicas in this process; an address it cannot dial is
    /// left out (the first such is the error), the others kept. A list naming none keeps the
    /// replicas known until each fails [`UNLISTED_FAILURES`] calls in a row: discovery losing
    /// every replica at once is more likely the replicas losing etcd (their leases lapse
    /// while they still answer) than all of them gone, and one really gone fails every call.
    pub fn reset(&self, addrs: &[String]) -> Result<(), FrontendError> {
        let mut map = self.lock();
        if addrs.is_empty() {
            let mut newly = 0;
            for r in map.values_mut().filter(|r| !r.in_process && !r.unlisted) {
                r.unlisted = true;
                newly += 1;
            }
            if newly > 0 {
                warn!(
                    replicas = ?map.keys().collect::<Vec<_>>(),
                    "discovery lists no scheduler replica; asking the last ones listed until they fail"
                );
            }
            return Ok(());
        }
        map.retain(|a, r| {
            let kept = r.in_process || addrs.contains(a);
            if !kept {
                info!(scheduler = a, "scheduler replica removed");
            }
            r.unlisted = false;
            kept
        });
        drop(map);
        addrs.iter().map(|a| self.add(a)).fold(Ok(()), Result::and)
    }

    /// The replicas' addresses.
    pub fn addrs(&self) -> Vec<String> {
        self.lock().keys().cloned().collect()
    }

    /// The replicas passed over for now (they failed or did not answer in time).
    pub fn suspects(&self) -> Vec<String> {
        let now = Instant::now();
        let map = self.lock();
        map.iter()
            .filter(|(_, r)| r.suspect_until.is_some_and(|t| t > now))
            .map(|(a, _)| a.clone())
            .collect()
    }

    /// Replicas in the order to try them: healthy ones first from a random start, then the
    /// suspect ones.
    fn order(&self, now: Instant) -> Vec<(String, Replica)> {
        let map = self.lock();
        let n = map.len();
        if n == 0 {
            return Vec::new();
        }
        let start = rand::random_range(0..n);
        let mut all: Vec<_> = map.iter().cycle().skip(start).take(n).collect();
        all.sort_by_key(|(_, r)| r.suspect_until.is_some_and(|t| t > now));
        all.into_iter().map(|(a, r)| (a.clone(), r.clone())).collect()
    }

    /// `addr` failed a call at `now`: tried after the others for a while; kept unlisted
    /// ([`Schedulers::reset`]) and failing [`UNLISTED_FAILURES`] in a row, dropped.
    fn suspect(&self, addr: &str, now: Instant) {
        let mut map = self.lock();
        let Some(r) = map.get_mut(addr) else { return };
        r.suspect_until = Some(now + SUSPECT_FOR);
        r.failures = r.failures.saturating_add(1);
        if r.unlisted && r.failures >= UNLISTED_FAILURES {
            map.remove(addr);
            info!(scheduler = addr, "unlisted scheduler replica kept failing; removed");
        }
    }

    /// `addr` answered: its failures in a row are over.
    fn answered(&self, addr: &str) {
        if let Some(r) = self.lock().get_mut(addr) {
            r.failures = 0;
        }
    }

    /// Asks the replicas in turn until one answers `req` (before `deadline`). A replica's
    /// own answer (a selection, or a refusal) ends the search; one that is unreachable or
    /// does not answer in time is passed over.
    pub async fn select(
        &self,
        req: SelectPrefillRequest,
        deadline: tokio::time::Instant,
        trace: &TraceContext,
    ) -> Result<Selected, SelectFailure> {
        let mut req = req;
        if let Some(owner) = self.owner.get() {
            req.frontend_id = owner.clone();
        }
        let (mut last, mut no_instance, mut refused) = (None, None, None);
        let mut checked = false;
        for (addr, replica) in self.order(Instant::now()) {
            if tokio::time::Instant::now() >= deadline {
                break;
            }
            // A refusal is checked with one more replica, and only one not suspect: one that
            // failed lately (or each of several hanging) would hold the 429 up to its timeout.
            if refused.is_some() {
                if checked || replica.suspect_until.is_some_and(|t| t > Instant::now()) {
                    break;
                }
                checked = true;
            }
            let own_timeout = tokio::time::Instant::now() + self.select_timeout;
            // When the request's deadline comes first, a replica not answering by then is
            // not at fault: it is not passed over for it.
            let wait = own_timeout.min(deadline);
            // The replica's waiting reports go along; those it does not say it took wait
            // again (it did not answer, or it is older than reports along).
            let along = replica.reports.take(tokio::time::Instant::now());
            let mut ask = req.clone();
            ask.reports = along.iter().map(|(_, r)| r.clone()).collect();
            let mut client = replica.client.clone();
            let ask = traced(auth::request(ask, self.token.as_deref()), trace);
            let mut call = Box::pin(async move { client.select_prefill(ask).await });
            let answer = tokio::time::timeout_at(wait, &mut call).await;
            let report_to = self.report_to(&addr, &replica);
            if !along.is_empty() {
                let taken = match &answer {
                    Ok(Ok(r)) => Some(r.get_ref().reports_taken),
                    Ok(Err(s)) => {
                        s.metadata().get(REPORTS_TAKEN).and_then(|v| v.to_str().ok()?.parse().ok())
                    }
                    Err(_) => None,
                };
                if taken != Some(along.len() as u32) {
                    // An answer that did not take them all is from a replica that takes
                    // none along (one older than the field).
                    let takes_along = !matches!(answer, Ok(Ok(_)));
                    report_to.put_back(along, takes_along);
                }
            }
            match answer {
                Ok(Ok(r)) => {
                    if replica.failures > 0 {
                        self.answered(&addr);
                    }
                    let selection = r.into_inner();
                    return Ok(Selected { replica: addr, selection, report_to });
                }
                // Up, but it knows no routable instance: another replica may (its view of
                // the fleet can lag), and this one is not suspect.
                Ok(Err(s)) if s.metadata().contains_key(NO_INSTANCE) => {
                    no_instance = Some(s);
                    continue;
                }
                // Every instance too busy, says this replica: one more is asked when there is
                // one, as its view may be stale (cut off from the bus, it kept the load it
                // last heard: a burst's, long drained); two agreeing is the answer.
                Ok(Err(s)) if s.code() == tonic::Code::ResourceExhausted && refused.is_none() => {
                    refused = Some(s);
                    continue;
                }
                Ok(Err(s)) if !replica_failed(&s) => return Err(SelectFailure::Answer(s)),
                Ok(Err(s)) => {
                    warn!(scheduler = %addr, error = %s.message(), "scheduler replica failed; trying another");
                    last = Some(s);
                }
                Err(_) if deadline < own_timeout => {
                    self.end_when_answered(call, report_to);
                    last = Some(tonic::Status::deadline_exceeded(format!(
                        "the request's deadline passed while scheduler {addr} was asked"
                    )));
                    break;
                }
                Err(_) => {
                    self.end_when_answered(call, report_to);
                    warn!(scheduler = %addr, "scheduler replica did not answer in time; trying another");
                    last = Some(tonic::Status::deadline_exceeded(format!(
                        "scheduler {addr} did not answer in time"
                    )));
                }
            }
            self.suspect(&addr, Instant::now());
        }
        // A replica that refused as too busy, or answered "no instance", is the answer,
        // whatever the others did.
        match refused.or(no_instance) {
            Some(s) => Err(SelectFailure::Answer(s)),
            None => Err(SelectFailure::NoReplica(last)),
        }
    }

    /// Reports a booking's outcome to the replica named `replica`, if it is known: along
    /// with the next selection asked of it, or soon in a call with the others waiting (see
    /// `reports`). Best effort: a booking whose report is lost expires there. (A lease
    /// reports through the [`ReportTo`] of its selection, known or not.)
    pub fn report(&self, replica: &str, req: ReportOutcomeRequest) {
        let found = self.lock().get(replica).map(|r| self.report_to(replica, r));
        match found {
            Some(to) => to.report(req),
            None => debug!(scheduler = replica, "outcome not reported: replica gone"),
        }
    }

    /// Where `replica`'s (at `addr`) reports go.
    fn report_to(&self, addr: &str, replica: &Replica) -> ReportTo {
        ReportTo {
            replica: addr.to_owned(),
            client: replica.client.clone(),
            queue: replica.reports.clone(),
            token: self.token.clone(),
            timeout: self.select_timeout * 2,
            linger: self.report_linger,
            tasks: self.tasks.clone(),
        }
    }

    /// Waits (on a task of its own, up to [`LATE_ANSWER_FOR`], or a second once shutdown is
    /// requested) for the answer of a selection given up on, and reports a booking it made
    /// cancelled: the replica booked it, and its load and pending prefix would otherwise
    /// stay counted until it expired (a slow replica's late answers, one per selection
    /// asked again, could fill every queue it prices).
    fn end_when_answered<F>(&self, call: F, report_to: ReportTo)
    where
        F: std::future::Future<
                Output = Result<tonic::Response<SelectPrefillResponse>, tonic::Status>,
            > + Send
            + 'static,
    {
        let tasks = self.tasks.clone();
        self.tasks.spawn(async move {
            let mut call = std::pin::pin!(call);
            // At shutdown a second more (the report then goes at once, as the others do).
            let answer = tokio::select! {
                a = tokio::time::timeout(LATE_ANSWER_FOR, &mut call) => a.ok(),
                _ = tasks.shutdown_requested() => {
                    tokio::time::timeout(Duration::from_secs(1), &mut call).await.ok()
                }
            };
            if let Some(Ok(r)) = answer {
                let booking_id = r.get_ref().booking_id;
                debug!(scheduler = %report_to.replica, booking_id, "a late selection's booking ended");
                report_to.report(ReportOutcomeRequest {
                    booking_id,
                    outcome: Outcome::Cancelled as i32,
                    error: "answered after the frontend stopped waiting".into(),
                });
            }
        });
    }
}

/// Why no selection was made.
#[derive(Debug)]
pub enum SelectFailure {
    /// A replica answered with this refusal or error.
    Answer(tonic::Status),
    /// No replica answered (the last failure, if any replica was tried).
    NoReplica(Option<tonic::Status>),
}

#[cfg(test)]
mod tests;
