use super::*;
use crate::SchedulerConfig;

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
