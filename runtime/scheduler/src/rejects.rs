//! [`Rejects`]: bad input (malformed or hostile events, heartbeats, load reports, snapshots,
//! reports of bookings that are not open) changes nothing and is logged once per kind, then
//! as a count at most once a minute: a peer spraying garbage cannot flood the log.

use std::collections::HashMap;
use std::fmt::Display;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tracing::warn;

/// How often a kind of bad input is logged again, with how many came meanwhile.
const EVERY: Duration = Duration::from_secs(60);

/// A kind of bad input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Reject {
    MalformedEvent,
    MalformedHeartbeat,
    MalformedLoadReport,
    BadReplicaName,
    TooManyReplicas,
    MalformedSnapshot,
    ForeignSnapshot,
    UnknownBooking,
    SequenceGap,
}

impl Reject {
    /// The kind as a metric label.
    fn label(self) -> &'static str {
        match self {
            Reject::MalformedEvent => "malformed_event",
            Reject::MalformedHeartbeat => "malformed_heartbeat",
            Reject::MalformedLoadReport => "malformed_load_report",
            Reject::BadReplicaName => "bad_replica_name",
            Reject::TooManyReplicas => "too_many_replicas",
            Reject::MalformedSnapshot => "malformed_snapshot",
            Reject::ForeignSnapshot => "foreign_snapshot",
            Reject::UnknownBooking => "unknown_booking",
            Reject::SequenceGap => "sequence_gap",
        }
    }

    fn what(self) -> &'static str {
        match self {
            Reject::MalformedEvent => "malformed KV event dropped",
            Reject::MalformedHeartbeat => "malformed heartbeat dropped",
            Reject::MalformedLoadReport => "malformed load report dropped",
            Reject::BadReplicaName => "load report with a bad replica name dropped",
            Reject::TooManyReplicas => "load report from one replica too many dropped",
            Reject::MalformedSnapshot => "malformed KV snapshot page dropped",
            Reject::ForeignSnapshot => "KV snapshot page of another instance dropped",
            Reject::UnknownBooking => "outcome reported for a booking that is not open",
            Reject::SequenceGap => "KV event sequence gap (events lost, or bogus numbers)",
        }
    }
}

#[derive(Debug)]
struct Seen {
    logged: Instant,
    since: u64,
    /// Every one seen.
    total: u64,
}

/// Bad input seen, by kind (see the module docs).
#[derive(Debug, Default)]
pub(crate) struct Rejects {
    seen: Mutex<HashMap<Reject, Seen>>,
}

impl Rejects {
    /// Notes one `kind` of bad input, logging it if due.
    pub(crate) fn note(&self, kind: Reject, detail: &dyn Display) {
        self.note_at(kind, detail, Instant::now());
    }

    /// [`Rejects::note`] as of `now`; whether it was logged.
    pub(crate) fn note_at(&self, kind: Reject, detail: &dyn Display, now: Instant) -> bool {
        let mut seen = self.seen.lock();
        let Some(s) = seen.get_mut(&kind) else {
            seen.insert(kind, Seen { logged: now, since: 0, total: 1 });
            warn!(%detail, "{} (from now on logged at most once a minute)", kind.what());
            return true;
        };
        s.since += 1;
        s.total += 1;
        if now.saturating_duration_since(s.logged) < EVERY {
            return false;
        }
        warn!(%detail, more = s.since, "{}: more of them in the last minute", kind.what());
        (s.logged, s.since) = (now, 0);
        true
    }
}

impl Rejects {
    /// How many of each kind were seen, by label.
    pub(crate) fn totals(&self) -> Vec<(&'static str, u64)> {
        self.seen.lock().iter().map(|(k, s)| (k.label(), s.total)).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_is_logged_once_then_at_most_once_a_minute() {
        let r = Rejects::default();
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(r.note_at(Reject::MalformedEvent, &"x", at(0)), "first one logged");
        for s in 1..60 {
            assert!(!r.note_at(Reject::MalformedEvent, &"x", at(s)), "quiet at {s} s");
        }
        assert!(r.note_at(Reject::MalformedHeartbeat, &"y", at(5)), "another kind: its own first");
        assert!(r.note_at(Reject::MalformedEvent, &"x", at(60)), "a minute on: counted once");
        assert!(!r.note_at(Reject::MalformedEvent, &"x", at(61)));
        assert!(r.note_at(Reject::MalformedEvent, &"x", at(121)));
        let mut totals = r.totals();
        totals.sort();
        assert_eq!(totals, [("malformed_event", 63), ("malformed_heartbeat", 1)]);
    }
}
