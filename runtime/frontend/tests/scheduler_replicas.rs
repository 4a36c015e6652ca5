//! The scheduler replicas a frontend follows in discovery (an in-memory registry, named as
//! such: the etcd one is exercised by the cluster tests).

use std::sync::Arc;
use std::time::Duration;

use handoff_core::{InstanceId, Tasks};
use handoff_discovery::{Instance, MemoryRegistry, Registry, Role};
use handoff_engine::{MockConfig, MockEngine};
use handoff_frontend::{Frontend, FrontendConfig};

/// Waits until the frontend's replicas are `want`, failing after 30 s.
async fn until_replicas(fe: &Frontend, want: &[&str]) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let have = fe.schedulers().addrs();
        if have == want {
            return;
        }
        assert!(tokio::time::Instant::now() < deadline, "replicas {have:?}, not {want:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn scheduler(id: &str, addr: &str) -> Instance {
    let i = Instance::fixture(id.parse::<InstanceId>().unwrap(), Role::Scheduler);
    Instance { grpc_addr: addr.into(), ..i }
}

#[tokio::test]
async fn a_replica_restarted_at_its_address_stays_when_its_old_registration_lapses() {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = Frontend::new(FrontendConfig::default(), engine, &[], &tasks).await.unwrap();
    let registry = Arc::new(MemoryRegistry::new());
    fe.follow_schedulers(registry.clone()).await.unwrap();
    let addr = "127.0.0.1:7001";
    registry.register(scheduler("scheduler-old", addr)).await.unwrap();
    until_replicas(&fe, &[addr]).await;
    // Restarted at the same address under a new id, before the old one's lease lapsed.
    registry.register(scheduler("scheduler-new", addr)).await.unwrap();
    registry.register(scheduler("scheduler-other", "127.0.0.1:7002")).await.unwrap();
    until_replicas(&fe, &[addr, "127.0.0.1:7002"]).await;
    registry.deregister(&"scheduler-old".parse().unwrap()).await.unwrap();
    registry.deregister(&"scheduler-other".parse().unwrap()).await.unwrap();
    until_replicas(&fe, &[addr]).await;
    // Its last registration gone, it is still asked: discovery listing no replica at all
    // is more likely the replicas' own leases lapsing (they lost etcd, not their clients).
    registry.deregister(&"scheduler-new".parse().unwrap()).await.unwrap();
    let other = "127.0.0.1:7003";
    registry.register(scheduler("scheduler-third", other)).await.unwrap();
    until_replicas(&fe, &[other]).await;
    registry.deregister(&"scheduler-third".parse().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fe.schedulers().addrs(), [other], "the last one listed is kept");
    // One listed again, the unlisted one is gone.
    registry.register(scheduler("scheduler-new", addr)).await.unwrap();
    until_replicas(&fe, &[addr]).await;
    // Unlisted again, and really gone (nothing listens there): dropped at its third failure
    // in a row.
    registry.deregister(&"scheduler-new".parse().unwrap()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(fe.schedulers().addrs(), [addr], "kept");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let ask = handoff_proto::v1::SelectPrefillRequest::default;
    for _ in 0..2 {
        assert!(fe.schedulers().select(ask(), deadline, &Default::default()).await.is_err());
        assert_eq!(fe.schedulers().addrs(), [addr], "a failure or two is a blip");
    }
    assert!(fe.schedulers().select(ask(), deadline, &Default::default()).await.is_err());
    assert!(fe.schedulers().addrs().is_empty(), "{:?}", fe.schedulers().addrs());
    tasks.shutdown().await;
}
