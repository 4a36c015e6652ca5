use std::time::Instant;

use handoff_discovery::{Heartbeat, Instance, Role, Topology, Update};

use super::*;
use crate::SchedulerConfig;

fn prefill(id: &str) -> Instance {
    Instance {
        topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
        ..Instance::fixture(id.parse().unwrap(), Role::Prefill)
    }
}

/// A replica in a frontend is ready as its frontend is announced and not draining, and says
/// so; one of its own says it is not registered yet.
#[test]
fn each_host_has_its_own_readiness_reason() {
    let in_frontend = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let surface = ops_in_frontend(&in_frontend);
    assert_eq!(surface.readiness(), Err("its frontend is not announced, or drains".to_owned()));
    in_frontend.metrics().set_registered(true);
    assert_eq!(surface.readiness(), Ok(()));
    in_frontend.metrics().set_registered(false);
    assert!(surface.readiness().is_err(), "a draining frontend's replica is not ready");

    let alone = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    assert_eq!(ops(&alone).readiness(), Err("not registered in discovery yet".to_owned()));
}

/// An operator finds the failing prefill by name: each instance's bookings are counted by
/// the outcome reported, and those that expired unreported (a frontend died, or its reports
/// were lost) apart.
#[test]
fn each_instances_bookings_are_counted_by_how_they_ended() {
    use crate::state::{Ask, Outcome};

    let cfg = SchedulerConfig { booking_grace: Duration::from_secs(5), ..Default::default() };
    let s = Arc::new(SchedulerState::new(cfg));
    s.apply_update(Update::Reset(vec![prefill("a")]));
    let (t0, hashes) = (Instant::now(), handoff_core::block_hashes(&[1; 32], 16));
    for outcome in [Outcome::InstanceFault, Outcome::InstanceFault, Outcome::Success] {
        let sel = s.select_at(&Ask::new(&hashes, 32), t0).unwrap();
        assert!(s.report(sel.booking, outcome));
    }
    let lost = Ask { deadline: Some(Duration::from_secs(1)), ..Ask::new(&hashes, 32) };
    s.select_at(&lost, t0).unwrap();
    s.sweep_at(t0 + Duration::from_secs(10));
    let text = ops(&s).scrape();
    for (outcome, n) in [("instance_fault", 2), ("success", 1), ("expired", 1), ("deadline", 0)] {
        let line = format!(
            "handoff_scheduler_instance_bookings_ended_total{{prefill=\"a\",outcome=\"{outcome}\"}} {n}\n"
        );
        assert!(text.contains(&line), "{line} in {text}");
    }
}

/// Prefills registered and never heard (NATS down, or a `--nats` that is not theirs) show,
/// rather than routing with no load or cache information unseen; the first heartbeat ends it.
#[test]
fn prefills_registered_and_never_heard_show_as_a_silent_bus() {
    let s = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let t0 = Instant::now();
    s.apply_update(Update::Reset(vec![prefill("a")]));
    let later = t0 + SchedulerConfig::default().liveness_timeout + Duration::from_secs(1);
    assert!(!s.bus_silent_at(t0), "just registered");
    assert!(s.bus_silent_at(later), "a timeout and not a word");
    s.heartbeat_at(&Heartbeat::fixture("a".parse().unwrap()), later);
    assert!(!s.bus_silent_at(later + Duration::from_millis(100)), "heard");
    assert!(ops(&s).scrape().contains("handoff_scheduler_bus_silent 0\n"));
}
