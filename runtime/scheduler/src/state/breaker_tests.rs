//! The per-instance circuit breaker as selection and reports drive it.

use super::tests::{book, inst};
use super::*;

#[test]
fn breaker_opens_on_prefill_faults_only_and_recovers_through_probes() {
    let cfg = SchedulerConfig {
        breaker: BreakerConfig {
            failures: 3,
            successes: 2,
            cooldown: std::time::Duration::from_millis(50),
        },
        ..SchedulerConfig::default()
    };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1), inst("c", 1)]));
    let others: Vec<InstanceId> = vec!["b".parse().unwrap(), "c".parse().unwrap()];
    // Overload, deadlines, cancellation, bad input and the decode's own faults never count.
    for outcome in [
        Outcome::Overloaded,
        Outcome::Deadline,
        Outcome::Cancelled,
        Outcome::Invalid,
        Outcome::DecodeFault,
    ] {
        for _ in 0..5 {
            assert!(s.report(book(&s, "a", &others).booking, outcome));
        }
    }
    let picks = |n| {
        (0..n)
            .map(|_| {
                let sel = s
                    .select(&Ask { policy: Some(PolicyKind::RoundRobin), ..Ask::new(&[], 10) })
                    .unwrap();
                s.report(sel.booking, Outcome::Cancelled);
                sel.instance.id.to_string()
            })
            .collect::<Vec<_>>()
    };
    assert!(picks(6).contains(&"a".to_owned()));
    for _ in 0..3 {
        s.report(book(&s, "a", &others).booking, Outcome::InstanceFault);
    }
    assert!(!picks(6).contains(&"a".to_owned()), "open: a gets nothing");
    std::thread::sleep(std::time::Duration::from_millis(60));
    // Half-open: one probe at a time.
    let probe = s.select(&Ask { policy: Some(PolicyKind::RoundRobin), ..Ask::new(&[], 10) });
    let mut probe = probe.unwrap();
    while probe.instance.id.as_str() != "a" {
        s.report(probe.booking, Outcome::Cancelled);
        probe =
            s.select(&Ask { policy: Some(PolicyKind::RoundRobin), ..Ask::new(&[], 10) }).unwrap();
    }
    assert!(!picks(6).contains(&"a".to_owned()), "one probe out: a gets nothing else");
    s.report(probe.booking, Outcome::Success);
    s.report(book(&s, "a", &others).booking, Outcome::Success);
    assert!(picks(6).iter().filter(|i| *i == "a").count() >= 2, "closed again");
}

/// A half-open instance's probe whose request is never reported (its client crashed) is given
/// back when its booking expires, and when the instance restarts (its bookings forgotten):
/// before, the instance stayed shut out of routing until it left discovery.
#[test]
fn a_probe_never_reported_is_given_back() {
    use std::time::{Duration, Instant};
    let s = half_open_fleet();
    let others = not_a();
    let only_a = only_a(&others);
    let _probe = open_and_probe(&s);
    s.lock().expire_bookings(Instant::now() + Duration::from_secs(24 * 3600));
    let probe = book(&s, "a", &others);
    assert!(s.select(&only_a).is_err(), "the expired probe's place went to a new probe");
    assert!(s.report(probe.booking, Outcome::Success));
    let _probe = open_and_probe(&s);
    let mut restarted = inst("a", 1);
    restarted.version = 2;
    s.apply_update(Update::Add(restarted));
    book(&s, "a", &others);
}

/// The probe's booking is forgotten when its instance goes silent: heard again, the instance
/// probes anew (before, its breaker stayed shut until it restarted or left).
#[test]
fn a_probe_forgotten_with_a_silent_instance_is_given_back() {
    let s = half_open_fleet();
    let others = not_a();
    let _probe = open_and_probe(&s);
    s.lock().silence(&"a".parse().unwrap());
    let hb = handoff_discovery::Heartbeat::fixture("a".parse().unwrap());
    s.heartbeat(&hb);
    book(&s, "a", &others);
}

/// While half-open only the probe's outcome counts: a booking made before the breaker
/// opened, reported a success (or cancelled) meanwhile, neither closes the breaker nor lets
/// a second probe through.
#[test]
fn half_open_only_the_probes_outcome_counts() {
    let s = half_open_fleet();
    let others = not_a();
    let only_a = only_a(&others);
    let (early, later) = (book(&s, "a", &others), book(&s, "a", &others));
    let probe = open_and_probe(&s);
    assert!(s.report(early.booking, Outcome::Success));
    assert!(s.select(&only_a).is_err(), "an old success does not close it");
    assert!(s.report(later.booking, Outcome::Cancelled));
    assert!(s.select(&only_a).is_err(), "an old cancel does not free the probe's place");
    assert!(s.report(probe.booking, Outcome::Success));
    book(&s, "a", &others);
}

/// Instances a, b and c; a's breaker opens on one fault and turns half-open at once, and one
/// success closes it.
fn half_open_fleet() -> SchedulerState {
    let cfg = SchedulerConfig {
        breaker: BreakerConfig { failures: 1, successes: 1, cooldown: std::time::Duration::ZERO },
        ..SchedulerConfig::default()
    };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1), inst("c", 1)]));
    s
}

/// The instances other than a.
fn not_a() -> Vec<InstanceId> {
    vec!["b".parse().unwrap(), "c".parse().unwrap()]
}

/// A selection among a alone, `others` excluded.
fn only_a(others: &[InstanceId]) -> Ask<'_> {
    Ask { policy: Some(PolicyKind::RoundRobin), exclude: others, ..Ask::new(&[], 10) }
}

/// Opens a's breaker with a fault and takes its probe (half-open at once): a takes nothing
/// else while it is out.
fn open_and_probe(s: &SchedulerState) -> Selection {
    let others = not_a();
    s.report(book(s, "a", &others).booking, Outcome::InstanceFault);
    let probe = book(s, "a", &others);
    assert!(s.select(&only_a(&others)).is_err(), "one probe out: a takes nothing else");
    probe
}

/// An instance restarted (a new version) while its breaker was open is probed at once, not
/// after the old process's cooldown; the probe failing opens it again.
#[test]
fn a_restarted_instance_is_probed_at_once() {
    let cfg = SchedulerConfig {
        breaker: BreakerConfig {
            failures: 1,
            successes: 1,
            cooldown: std::time::Duration::from_secs(3600),
        },
        ..SchedulerConfig::default()
    };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1), inst("c", 1)]));
    let others = not_a();
    let only_a = only_a(&others);
    s.report(book(&s, "a", &others).booking, Outcome::InstanceFault);
    assert!(s.select(&only_a).is_err(), "open for the cooldown");
    let mut restarted = inst("a", 1);
    restarted.version = 2;
    s.apply_update(Update::Add(restarted));
    let probe = book(&s, "a", &others);
    assert!(s.select(&only_a).is_err(), "one probe at a time");
    assert!(s.report(probe.booking, Outcome::InstanceFault));
    assert!(s.select(&only_a).is_err(), "the probe failed: open again");
}
