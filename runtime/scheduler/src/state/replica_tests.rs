//! Scheduler replicas sharing their load over the bus.

use std::time::{Duration, Instant};

use handoff_core::block_hashes;
use handoff_discovery::{Heartbeat, KvSnapshot, LoadReport, WorkerLoad};

use super::tests::inst;
use super::*;

/// Instants from the first test's start: beats and sweeps name their time.
fn at(ms: u64) -> Instant {
    static T0: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *T0.get_or_init(Instant::now) + Duration::from_millis(ms)
}

/// A heartbeat from each of `ids` at `now`.
fn beat(s: &SchedulerState, ids: &[&str], now: Instant) {
    for id in ids {
        let hb =
            Heartbeat { prefill_ns_per_token: 1_000, ..Heartbeat::fixture(id.parse().unwrap()) };
        if s.heartbeat_at(&hb, now) {
            s.apply_snapshot(KvSnapshot {
                instance: id.parse().unwrap(),
                seq: 0,
                incarnation: 0,
                dp_blocks: vec![vec![]],
                dp_parents: vec![],
                snapshot: 0,
                page: 0,
                pages: 1,
            });
        }
    }
}

/// Sweeps as the scheduler does, from `from_ms` to `to_ms` (see `tests::sweeps_from`).
fn sweeps(s: &SchedulerState, from_ms: u64, to_ms: u64) {
    super::tests::sweeps_from(s, at(0), from_ms, to_ms);
}

/// A replica knowing `ids` (one dp rank each), each heard at 0 ms.
fn beating(ids: &[&str]) -> SchedulerState {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(ids.iter().map(|id| inst(id, 1)).collect()));
    beat(&s, ids, at(0));
    s
}

#[test]
fn replicas_price_each_others_load_and_forget_silent_ones() {
    let (a, b) = (
        SchedulerState::new(SchedulerConfig::default()),
        SchedulerState::new(SchedulerConfig::default()),
    );
    for s in [&a, &b] {
        s.apply_update(Update::Reset(vec![inst("x", 1), inst("y", 1)]));
    }
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    let other = block_hashes(&(1000..1256).collect::<Vec<_>>(), 16);
    let first = a.select(&Ask::new(&h, 256)).unwrap().instance.id;
    // Alone, b would make the same first choice for another prompt; with a's load it goes
    // elsewhere.
    let report = a.load_report("ra", false).unwrap();
    assert_eq!((report.loads.len(), report.routed.len()), (1, 1));
    assert!(a.load_report("ra", false).is_none(), "unchanged: nothing to say");
    assert!(b.select(&Ask::new(&other, 256)).is_ok_and(|s| {
        b.report(s.booking, Outcome::Cancelled);
        s.instance.id == first
    }));
    b.apply_load_report(report.clone(), "rb");
    assert_ne!(b.select(&Ask::new(&other, 256)).unwrap().instance.id, first);
    // The same new prompt goes where a sent it, priced as cached there: not computed twice.
    let same = b.select(&Ask::new(&h, 256)).unwrap();
    assert_eq!((same.instance.id.clone(), same.cached_blocks), (first.clone(), 16));
    // Its own report, a bad name, or unknown workers change nothing.
    b.apply_load_report(report.clone(), "ra");
    let mut bad = report.clone();
    bad.replica = "r".repeat(65);
    b.apply_load_report(bad, "rb");
    let mut unknown = report.clone();
    unknown.loads[0].instance = "zz".parse().unwrap();
    unknown.replica = "rc".into();
    b.apply_load_report(unknown, "rb");
    // Overflowing loads from two replicas: saturated, nothing panics, selection goes on.
    for name in ["huge1", "huge2"] {
        let mut huge = report.clone();
        huge.replica = name.into();
        for l in &mut huge.loads {
            (l.in_flight, l.queued_tokens) = (u32::MAX, u64::MAX);
        }
        b.apply_load_report(huge, "rb");
    }
    let after = b.select(&Ask::new(&other, 256)).expect("selection goes on");
    assert_ne!(after.instance.id, first, "the saturated instance looks busiest");
    // A replica not heard from within the liveness timeout, while the others are, is
    // forgotten.
    let c = beating(&["x", "y"]);
    c.apply_load_report(report, "rc");
    for sec in 1..=4 {
        beat(&c, &["x", "y"], at(sec * 1000));
    }
    c.sweep_at(at(4100));
    assert_eq!(c.select(&Ask::new(&h, 256)).unwrap().instance.id, first, "a's load forgotten");
}

/// 1,000 s of prefill queued on `id` (at 1 us a token) by 1,000 requests.
fn busy(id: &str) -> WorkerLoad {
    WorkerLoad {
        instance: id.parse().unwrap(),
        dp_rank: 0,
        in_flight: 1000,
        queued_tokens: 1 << 30,
    }
}

/// Whether `s` admits a selection (the booking then ended at once).
fn admits(s: &SchedulerState) -> bool {
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    s.select(&Ask::new(&h, 256)).map(|sel| s.report(sel.booking, Outcome::Cancelled)).is_ok()
}

/// The other replicas' load reports ride the bus: while nobody is heard (the bus is down)
/// their load is kept, as their requests are still queued at the prefills; once beats are
/// heard again, each replica has a full timeout from then to be heard too. (Seen through
/// admission: another replica's 1,000 s of queued work on every instance refuses a
/// selection; forgotten, the selection is made.)
#[test]
fn a_quiet_bus_keeps_the_other_replicas_load() {
    let c = beating(&["x", "y"]);
    let report =
        LoadReport { replica: "ra".into(), loads: vec![busy("x"), busy("y")], routed: vec![] };
    c.apply_load_report(report, "rc");
    let admitted = || admits(&c);
    assert!(!admitted(), "the other replica's queue is full");
    // The bus stops: nothing from anyone.
    let mut t = 0;
    for ms in [4000, 10_000, 30_000] {
        sweeps(&c, t, ms);
        t = ms;
        assert!(!admitted(), "its load kept at {ms} ms");
    }
    // Beats resume; its reports would too, but it died meanwhile.
    sweeps(&c, 30_000, 31_000);
    beat(&c, &["x", "y"], at(31_000));
    sweeps(&c, 31_000, 32_000);
    assert!(!admitted(), "it has a full timeout from the bus's return");
    for sec in 33..=34 {
        beat(&c, &["x", "y"], at((sec - 1) * 1000));
        sweeps(&c, (sec - 1) * 1000, sec * 1000);
    }
    beat(&c, &["x", "y"], at(34_000));
    sweeps(&c, 34_000, 34_100);
    assert!(admitted(), "its load forgotten");
}

/// With heartbeats stopped, this replica's own reports coming back say only that its own
/// server is up (a partial partition can cut it from the others): a silent replica's load is
/// kept. Another replica's reports say the bus is up: then the silent one is forgotten.
#[test]
fn a_silent_replica_is_forgotten_when_other_replicas_are_heard() {
    let c = beating(&["x", "y"]);
    let report =
        |replica: &str, loads| LoadReport { replica: replica.into(), loads, routed: vec![] };
    c.apply_load_report_at(report("ra", vec![busy("x"), busy("y")]), "rc", at(0));
    let admitted = || admits(&c);
    assert!(!admitted(), "the other replica's queue is full");
    for ms in [1000, 2000, 3000, 4000] {
        sweeps(&c, ms - 1000, ms);
        c.apply_load_report_at(report("rc", vec![]), "rc", at(ms));
    }
    sweeps(&c, 4000, 4100);
    assert!(!admitted(), "its own reports alone do not say the bus is up");
    for ms in [5000, 6000, 7000, 8000] {
        sweeps(&c, ms - 1000, ms);
        c.apply_load_report_at(report("rb", vec![]), "rc", at(ms));
    }
    sweeps(&c, 8000, 8100);
    assert!(admitted(), "the silent replica's load forgotten");
}

/// A report too large for the bus (a thousand instances of dp 8, every rank loaded) is sent
/// within its bound, its heaviest loads kept: before, the server refused it, and the other
/// replicas forgot this one. One that fits is sent whole.
#[test]
fn a_report_too_large_for_the_bus_keeps_its_heaviest_loads() {
    use super::replicas::{MAX_REPORT_BYTES, encode_report};
    let loads: Vec<WorkerLoad> = (0..20_000u64)
        .map(|i| WorkerLoad {
            instance: format!("prefill-{:08}", i / 8).parse().unwrap(),
            dp_rank: (i % 8) as u32,
            in_flight: 1,
            queued_tokens: i,
        })
        .collect();
    let routed = vec![handoff_discovery::RoutedPrefix {
        instance: "prefill-0".parse().unwrap(),
        dp_rank: 0,
        blocks: vec![handoff_core::BlockHash(7); 10],
    }];
    let small = LoadReport { replica: "r".into(), loads: loads[..10].to_vec(), routed };
    let (bytes, cut) = encode_report(small.clone()).unwrap();
    assert!(!cut);
    assert_eq!(serde_json::from_slice::<LoadReport>(&bytes).unwrap(), small);
    let big = LoadReport { replica: "r".into(), loads, routed: small.routed.clone() };
    let (bytes, cut) = encode_report(big).unwrap();
    assert!(cut && bytes.len() <= MAX_REPORT_BYTES, "{} bytes", bytes.len());
    let sent: LoadReport = serde_json::from_slice(&bytes).unwrap();
    assert!(sent.routed.is_empty());
    assert!(sent.loads.len() > 5_000, "{} loads kept", sent.loads.len());
    let lightest_kept = sent.loads.iter().map(|l| l.queued_tokens).min().unwrap();
    assert_eq!(lightest_kept, 20_000 - sent.loads.len() as u64, "the heaviest kept");
}
