//! A running scheduler follows the frontends in discovery: one that leaves (stopped, or
//! killed and its lease lapsed) has its open bookings expire after the booking grace, not
//! at their requests' deadlines; the other frontends' bookings stay.

use std::sync::Arc;
use std::time::Duration;

use handoff_core::{InstanceId, Tasks, block_hashes};
use handoff_discovery::{EventBus, Instance, MemoryBus, MemoryRegistry, Registry, Role};
use handoff_scheduler::{Ask, Scheduler, SchedulerConfig, SchedulerState};

fn inst(id: &str, role: Role) -> Instance {
    Instance {
        bootstrap_addr: format!("{id}:1"),
        grpc_addr: format!("{id}:2"),
        ..Instance::fixture(id.parse().unwrap(), role)
    }
}

/// Waits until `state` holds `n` open bookings, failing after 10 s.
async fn until_open(state: &SchedulerState, n: usize) {
    let since = std::time::Instant::now();
    while state.open_bookings() != n {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "{} open, not {n}",
            state.open_bookings()
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn a_frontend_leaving_discovery_ends_its_bookings() {
    let registry = Arc::new(MemoryRegistry::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    registry.register(inst("p0", Role::Prefill)).await.unwrap();
    for f in ["frontend-a", "frontend-b"] {
        registry.register(inst(f, Role::Frontend)).await.unwrap();
    }
    let tasks = Tasks::new();
    // Departed frontends' bookings expire after the grace; sweeps every 25 ms.
    let cfg = SchedulerConfig {
        booking_grace: Duration::from_millis(200),
        liveness_timeout: Duration::from_millis(300),
        ..SchedulerConfig::default()
    };
    let s = Scheduler::start(cfg, registry.clone(), bus, &tasks).await;
    let s = s.unwrap();
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    let (a, b): (InstanceId, InstanceId) =
        ("frontend-a".parse().unwrap(), "frontend-b".parse().unwrap());
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while s.state().instances().is_empty() {
        assert!(std::time::Instant::now() < until, "p0 known");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    for owner in [&a, &a, &b] {
        s.state().select(&Ask { owner: Some(owner), ..Ask::new(&h, 256) }).unwrap();
    }
    s.state().select(&Ask::new(&h, 256)).unwrap();
    assert_eq!(s.state().open_bookings(), 4);
    // a is killed: its lease lapses.
    registry.deregister(&a).await.unwrap();
    until_open(s.state(), 2).await;
    // b's and the anonymous one stay; b's end when b leaves.
    registry.deregister(&b).await.unwrap();
    until_open(s.state(), 1).await;
    tasks.shutdown().await;
}
