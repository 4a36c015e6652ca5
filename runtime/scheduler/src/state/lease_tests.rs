//! Bookings, admission and the panic threshold.

use std::time::{Duration, Instant};

use handoff_core::{BlockHash, block_hashes};
use handoff_discovery::Heartbeat;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::tests::inst;
use super::*;
use crate::SchedulerError;

fn beat(id: &str, ns_per_token: u64) -> Heartbeat {
    Heartbeat { prefill_ns_per_token: ns_per_token, ..Heartbeat::fixture(id.parse().unwrap()) }
}

fn prompt(i: u32) -> Vec<BlockHash> {
    block_hashes(&(1000 * i..1000 * i + 256).collect::<Vec<_>>(), 16)
}

/// Every replica-visible load is zero: nothing in flight, nothing queued, nothing booked.
fn idle(s: &SchedulerState) -> bool {
    s.instances().iter().all(|i| i.in_flight == 0)
        && s.load_report("me", true).is_some_and(|r| r.loads.is_empty())
        && s.open_bookings() == 0
        && s.lock().pending.blocks() == 0
}

#[test]
fn a_booking_ends_once_whatever_reports_it() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let sel = s.select(&Ask::new(&prompt(1), 256)).unwrap();
    assert_eq!(s.open_bookings(), 1);
    assert!(s.report(sel.booking, Outcome::Success));
    assert!(idle(&s));
    // A second report, a report of a booking never made: nothing changes.
    let other = s.select(&Ask::new(&prompt(2), 256)).unwrap();
    assert!(!s.report(sel.booking, Outcome::InstanceFault), "reported twice");
    assert!(!s.report(BookingId(42), Outcome::Success), "never booked");
    assert_eq!(s.instances().iter().map(|i| i.in_flight).sum::<u32>(), 1, "other's load kept");
    assert!(s.report(other.booking, Outcome::Cancelled));
    assert!(idle(&s));
}

#[test]
fn an_unreported_booking_expires_after_its_deadline() {
    let cfg = SchedulerConfig { booking_grace: Duration::from_secs(5), ..Default::default() };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    let t0 = Instant::now();
    let p1 = prompt(1);
    let ask = Ask { deadline: Some(Duration::from_secs(10)), ..Ask::new(&p1, 256) };
    let sel = s.select_at(&ask, t0).unwrap();
    let lasting = s.select_at(&Ask::new(&prompt(2), 256), t0).unwrap(); // default TTL 120 s
    s.sweep_at(t0 + Duration::from_secs(14));
    assert_eq!(s.open_bookings(), 2, "not before deadline + grace");
    s.sweep_at(t0 + Duration::from_secs(16));
    assert_eq!(s.open_bookings(), 1, "expired");
    assert!(!s.report(sel.booking, Outcome::Success), "a late report finds nothing");
    assert!(s.report(lasting.booking, Outcome::Success));
    assert!(idle(&s));
}

#[test]
fn a_departed_instance_takes_its_bookings_along() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    let old = s.select(&Ask::new(&prompt(1), 256)).unwrap();
    s.apply_update(Update::Remove("a".parse().unwrap()));
    assert_eq!(s.open_bookings(), 0);
    // Its slot is reused by a newcomer; the old report must not take the newcomer's load.
    s.apply_update(Update::Add(inst("b", 1)));
    let new = s.select(&Ask::new(&prompt(2), 256)).unwrap();
    assert!(!s.report(old.booking, Outcome::Success));
    assert_eq!(s.instances()[0].in_flight, 1);
    assert!(s.report(new.booking, Outcome::Success));
    assert!(idle(&s));
}

#[test]
fn load_returns_to_zero_after_any_mix_of_outcomes() {
    for seed in 0..10u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let s = SchedulerState::new(SchedulerConfig::default());
        s.apply_update(Update::Reset(vec![inst("a", 2), inst("b", 1), inst("c", 1)]));
        let t0 = Instant::now();
        let mut open: Vec<Selection> = Vec::new();
        let mut ended = Vec::new();
        for i in 0..1000u32 {
            match rng.random_range(0..10) {
                0..=4 => {
                    let p = prompt(rng.random_range(0..20) * 7 + i % 3);
                    let deadline = rng.random_bool(0.5).then(|| Duration::from_secs(5));
                    let ask = Ask { deadline, ..Ask::new(&p, 256) };
                    open.extend(s.select_at(&ask, t0).ok());
                }
                5..=8 if !open.is_empty() => {
                    let sel = open.swap_remove(rng.random_range(0..open.len()));
                    let outcome = [
                        Outcome::Success,
                        Outcome::InstanceFault,
                        Outcome::Overloaded,
                        Outcome::Deadline,
                        Outcome::Cancelled,
                        Outcome::DecodeFault,
                    ][rng.random_range(0..6)];
                    assert!(s.report(sel.booking, outcome));
                    ended.push(sel.booking);
                }
                // Duplicate reports of ended bookings change nothing.
                _ if !ended.is_empty() => {
                    let b = ended[rng.random_range(0..ended.len())];
                    assert!(!s.report(b, Outcome::Success));
                }
                _ => {}
            }
        }
        // Half of what is still open is reported; the rest is lost and expires.
        for sel in open.drain(..).filter(|_| rng.random_bool(0.5)) {
            s.report(sel.booking, Outcome::Cancelled);
        }
        s.sweep_at(t0 + Duration::from_secs(600) + Duration::from_secs(20));
        assert!(idle(&s), "seed {seed}: load back to zero");
    }
}

#[test]
fn failures_alone_never_eject_more_than_half_of_the_fleet() {
    let cfg = SchedulerConfig {
        breaker: BreakerConfig { failures: 1, successes: 1, cooldown: Duration::from_secs(600) },
        ..Default::default()
    };
    let s = SchedulerState::new(cfg);
    let ids = ["a", "b", "c", "d"];
    s.apply_update(Update::Reset(ids.iter().map(|i| inst(i, 1)).collect()));
    let served = |s: &SchedulerState| {
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..8 {
            let sel = s
                .select(&Ask { policy: Some(PolicyKind::RoundRobin), ..Ask::new(&[], 16) })
                .unwrap();
            seen.insert(sel.instance.id.to_string());
            s.report(sel.booking, Outcome::Cancelled);
        }
        seen
    };
    // Fail one instance at a time (each booked with the others excluded).
    let fail = |s: &SchedulerState, on: &str| {
        let others: Vec<InstanceId> =
            ids.iter().filter(|i| **i != on).map(|i| i.parse().unwrap()).collect();
        let ask = Ask { exclude: &others, ..Ask::new(&[], 16) };
        s.report(s.select(&ask).unwrap().booking, Outcome::InstanceFault);
    };
    fail(&s, "a");
    fail(&s, "b");
    assert_eq!(served(&s).len(), 2, "half ejected: the other half serves");
    fail(&s, "c");
    assert_eq!(served(&s).len(), 4, "past half: ejection ignored, traffic over all of them");
}

#[test]
fn overload_is_refused_at_once_with_when_to_retry() {
    let cfg = SchedulerConfig { max_queue_wait: Duration::from_secs(1), ..Default::default() };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    // 1 ms per token: each 256-token prompt queues 256 ms of work.
    for id in ["a", "b"] {
        s.heartbeat(&beat(id, 1_000_000));
    }
    let mut admitted = Vec::new();
    let refusal = loop {
        match s.select(&Ask::new(&prompt(admitted.len() as u32), 256)) {
            Ok(sel) => admitted.push(sel),
            Err(e) => break e,
        }
        assert!(admitted.len() < 100, "never refused");
    };
    // Each instance takes work until the wait ahead would pass 1 s: waits of 0, 256, 512
    // and 768 ms; the next would wait 1024 ms.
    assert_eq!(admitted.len(), 8, "4 per instance");
    let SchedulerError::Overloaded { retry_after, reason } = refusal else {
        panic!("refused as overload: {refusal}")
    };
    assert_eq!(retry_after, Duration::from_millis(24), "when 24 ms of work has drained");
    assert!(reason.contains("queued"), "{reason}");
    assert!(
        admitted.iter().all(|a| a.expected_wait <= Duration::from_secs(1)),
        "nobody admitted beyond the bound"
    );
    // A short deadline is refused even though the queue bound has room.
    s.report(admitted.pop().unwrap().booking, Outcome::Success);
    let p500 = prompt(500);
    let short = Ask { deadline: Some(Duration::from_millis(300)), ..Ask::new(&p500, 256) };
    assert!(matches!(s.select(&short), Err(SchedulerError::Overloaded { .. })));
    // Reports drain the queues; then requests are admitted again.
    for a in admitted {
        s.report(a.booking, Outcome::Success);
    }
    assert!(s.select(&short).is_ok());
}

/// Work an instance says is ahead in its queue that no booking holds (a replica that died or
/// restarted, its requests still queued there) is priced with the bookings: added to them,
/// as of its last heartbeat, what the bookings then held not counted twice. Before, a
/// restarted replica priced every queue as empty and admitted another whole bound behind it.
#[test]
fn work_an_instance_says_is_queued_counts_without_a_booking() {
    let cfg = SchedulerConfig { max_queue_wait: Duration::from_secs(1), ..Default::default() };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    // 1 ms per token, 1,100 tokens ahead: 1.1 s of work no booking here holds, past the
    // bound: refused at once.
    let said = |ahead: u64| Heartbeat { dp_queued_tokens: vec![ahead], ..beat("a", 1_000_000) };
    s.heartbeat(&said(1100));
    let p = prompt(1);
    assert!(matches!(s.select(&Ask::new(&p, 16)), Err(SchedulerError::Overloaded { .. })));
    // 900 ms: admitted, and told the wait; what it books adds to it.
    s.heartbeat(&said(900));
    let first = s.select(&Ask::new(&p, 16)).expect("within the bound");
    assert_eq!(first.expected_wait, Duration::from_millis(900));
    let q = prompt(2);
    let second = s.select(&Ask::new(&q, 16)).expect("within the bound");
    assert_eq!(second.expected_wait, Duration::from_millis(916));
    // The next heartbeat counts the 32 booked tokens among the 932 it says: not twice.
    s.heartbeat(&said(932));
    assert_eq!(
        s.select(&Ask::new(&prompt(3), 16)).unwrap().expected_wait,
        Duration::from_millis(932)
    );
}

/// What an instance said is ahead is no floor once half the liveness timeout old (the bus
/// down: its bookings still drain through the reports, its heartbeats do not come).
#[test]
fn what_an_instance_said_is_ahead_lapses_with_its_heartbeats() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    let t0 = std::time::Instant::now();
    let said = Heartbeat { dp_queued_tokens: vec![500], ..beat("a", 1_000_000) };
    s.heartbeat_at(&said, t0);
    let p = prompt(1);
    let sel = s.select(&Ask::new(&p, 16)).unwrap();
    assert_eq!(sel.expected_wait, Duration::from_millis(500));
    s.report(sel.booking, Outcome::Success);
    let half = SchedulerConfig::default().liveness_timeout / 2;
    s.sweep_at(t0 + half + Duration::from_millis(1));
    assert_eq!(s.select(&Ask::new(&p, 16)).unwrap().expected_wait, Duration::ZERO);
}
