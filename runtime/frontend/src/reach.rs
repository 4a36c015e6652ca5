//! [`Reach`]: the prefill instances this frontend cannot reach, in its own view.
//!
//! The scheduler's circuit breakers count every frontend's failures together, so a prefill
//! that one frontend cannot reach while others can is never ejected: the others' successes
//! keep closing its breaker, and this frontend would go on losing an attempt (and its time)
//! on it. So each frontend also keeps its own count: [`UNREACHABLE_AFTER`] attempts that
//! could not get through to an instance (its directory or its transfer connection refused or
//! unreachable; handshakes ride in the Prefill call only on one host, see `attempt`), with no success between, make this frontend pass it over in its selections
//! for [`AVOID_FOR`]. A deadline passing while connecting does not count: under load that is
//! the load, not the network. After the while the instance may be tried again: a success
//! forgets it, a failure avoids it again at once (so only the attempts already under way
//! when the while ends can lose to it; a single probe would need the scheduler to pick it
//! for that one selection, or the instance would stay avoided). An instance registering
//! again (a restart) is forgotten as well. A selection that finds nothing else is asked again without the avoided instances:
//! this frontend's view never makes the service unavailable by itself.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::{Cause, FrontendError};

/// Connect failures in a row after which an instance is avoided.
pub const UNREACHABLE_AFTER: u32 = 3;
/// How long it is avoided before it is tried again.
pub const AVOID_FOR: Duration = Duration::from_secs(10);
/// Instances tracked at most (the table is bounded; past it, those least in the way go).
const MAX_TRACKED: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Strikes {
    in_a_row: u32,
    avoid_until: Option<Instant>,
}

/// This frontend's view of which instances it cannot reach (see the module docs).
#[derive(Debug, Default)]
pub struct Reach {
    strikes: Mutex<HashMap<String, Strikes>>,
}

/// Whether `e` says the instance could not be got through to: reading its directory or
/// connecting to its ranks failed for the instance's sake, before it was given any work, or
/// the instance's connect back to this decode's receiver was refused, found no route or went
/// unanswered. Deadlines, overload, a failed prefill or transfer, and the decode's own other
/// faults do not count.
pub fn unreachable(e: &FrontendError) -> bool {
    matches!(
        e,
        FrontendError::Attempt {
            stage: "resolve-topology" | "resolve-rank" | "connect",
            cause: Cause::Instance,
            ..
        } | FrontendError::Attempt { stage: "connect-back", cause: Cause::Decode, .. }
    )
}

impl Reach {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Strikes>> {
        self.strikes.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An attempt on `instance` could not connect, at `now`: whether it is avoided from now.
    pub fn failed_at(&self, instance: &str, now: Instant) -> bool {
        let mut all = self.lock();
        if all.len() >= MAX_TRACKED && !all.contains_key(instance) {
            // Forget the ones with the fewest strikes (never the avoided ones while any other
            // remains).
            let fewest = all.values().map(|s| s.in_a_row).min().unwrap_or(0);
            all.retain(|_, s| s.in_a_row > fewest || s.avoid_until.is_some_and(|t| t > now));
            if all.len() >= MAX_TRACKED {
                return false;
            }
        }
        let s =
            all.entry(instance.to_owned()).or_insert(Strikes { in_a_row: 0, avoid_until: None });
        s.in_a_row = s.in_a_row.saturating_add(1);
        if s.in_a_row >= UNREACHABLE_AFTER {
            s.avoid_until = Some(now + AVOID_FOR);
            return true;
        }
        false
    }

    /// An attempt on `instance` got through: forgotten.
    pub fn reached(&self, instance: &str) {
        self.lock().remove(instance);
    }

    /// The instances a selection at `now` passes over, the most recently failed first.
    pub fn avoided_at(&self, now: Instant) -> Vec<String> {
        let all = self.lock();
        let mut avoided: Vec<(Instant, &String)> = all
            .iter()
            .filter_map(|(id, s)| s.avoid_until.filter(|&t| t > now).map(|t| (t, id)))
            .collect();
        avoided.sort_unstable_by_key(|&(until, _)| std::cmp::Reverse(until));
        avoided.into_iter().map(|(_, id)| id.clone()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn three_connect_failures_in_a_row_avoid_an_instance_for_a_while() {
        let r = Reach::default();
        let t0 = Instant::now();
        assert!(!r.failed_at("a", t0));
        assert!(!r.failed_at("a", t0));
        assert!(r.avoided_at(t0).is_empty(), "two are not enough");
        assert!(r.failed_at("a", t0), "the third avoids it");
        assert_eq!(r.avoided_at(t0 + AVOID_FOR / 2), vec!["a".to_owned()]);
        // After the while it may be tried again; a failure avoids it again at once.
        let later = t0 + AVOID_FOR;
        assert!(r.avoided_at(later).is_empty());
        assert!(r.failed_at("a", later));
        assert_eq!(r.avoided_at(later), vec!["a".to_owned()]);
        // A success forgets it: three more failures are needed.
        r.reached("a");
        assert!(!r.failed_at("a", later) && !r.failed_at("a", later));
        assert!(r.avoided_at(later).is_empty());
    }

    #[test]
    fn the_most_recently_failed_are_avoided_first() {
        let r = Reach::default();
        let t0 = Instant::now();
        for (i, id) in ["b", "c", "a"].into_iter().enumerate() {
            let at = t0 + Duration::from_secs(i as u64);
            while !r.failed_at(id, at) {}
        }
        assert_eq!(r.avoided_at(t0 + Duration::from_secs(3)), ["a", "c", "b"]);
    }

    #[test]
    fn only_failures_to_get_through_count() {
        let connect = FrontendError::because("connect", Cause::Instance, "unreachable");
        let slow = FrontendError::because("connect", Cause::Deadline, "attempt deadline passed");
        let busy = FrontendError::because("connect", Cause::Overloaded, "full");
        let verify = FrontendError::because("verify", Cause::Instance, "checksum mismatch");
        let directory = FrontendError::because("resolve-topology", Cause::Instance, "refused");
        assert!(unreachable(&connect) && unreachable(&directory));
        assert!(!unreachable(&slow) && !unreachable(&busy) && !unreachable(&verify));
    }

    #[test]
    fn the_table_is_bounded() {
        let r = Reach::default();
        let t0 = Instant::now();
        for i in 0..MAX_TRACKED + 100 {
            r.failed_at(&format!("i{i}"), t0);
        }
        assert!(r.lock().len() <= MAX_TRACKED);
        for _ in 0..UNREACHABLE_AFTER {
            r.failed_at("x", t0);
        }
        assert!(r.avoided_at(t0).contains(&"x".to_owned()), "room for a new one");
    }
}
