//! Two running scheduler replicas on one bus share their in-flight load: requests split
//! across them still spread over the fleet instead of piling onto the instance each alone
//! would think idle.

use std::sync::Arc;
use std::time::Duration;

use handoff_core::{Tasks, block_hashes};
use handoff_discovery::{EventBus, Instance, MemoryBus, MemoryRegistry, Registry, Role};
use handoff_scheduler::{Scheduler, SchedulerConfig};

fn inst(id: &str) -> Instance {
    Instance {
        bootstrap_addr: format!("{id}:1"),
        grpc_addr: format!("{id}:2"),
        ..Instance::fixture(id.parse().unwrap(), Role::Prefill)
    }
}

#[tokio::test]
async fn replicas_on_one_bus_spread_requests_between_them() {
    let registry = Arc::new(MemoryRegistry::new());
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    for id in ["p0", "p1", "p2", "p3"] {
        registry.register(inst(id)).await.unwrap();
    }
    let tasks = Tasks::new();
    let cfg =
        SchedulerConfig { load_share_interval: Duration::from_millis(5), ..Default::default() };
    let start = |r: Arc<MemoryRegistry>| {
        let (bus, cfg, tasks) = (bus.clone(), cfg.clone(), tasks.clone());
        async move { Scheduler::start(cfg, r, bus, &tasks).await.unwrap() }
    };
    let (a, b) = (start(registry.clone()).await, start(registry.clone()).await);
    assert_ne!(a.replica(), b.replica());
    tokio::time::sleep(Duration::from_millis(50)).await;
    // Unrelated prompts, so only load decides.
    let h = |i: u32| block_hashes(&(256 * i..256 * (i + 1)).collect::<Vec<_>>(), 16);
    // Alternate replicas; each waits for the other's report before choosing.
    let mut chosen = Vec::new();
    for i in 0..4 {
        let s = if i % 2 == 0 { &a } else { &b };
        chosen.push(
            s.state()
                .select(&handoff_scheduler::Ask::new(&h(i), 256))
                .unwrap()
                .instance
                .id
                .to_string(),
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    chosen.sort();
    chosen.dedup();
    assert_eq!(chosen.len(), 4, "every instance got one request: {chosen:?}");
    tasks.shutdown().await;
}

/// A bus whose publishes never return (a test double: a NATS client reconnecting holds
/// them while its command queue is full) and whose subscriptions never deliver.
struct StalledBus(tokio::sync::Notify);

#[async_trait::async_trait]
impl EventBus for StalledBus {
    async fn publish(
        &self,
        _: String,
        _: bytes::Bytes,
    ) -> Result<(), handoff_discovery::DiscoveryError> {
        self.0.notify_one();
        std::future::pending().await
    }

    async fn subscribe(
        &self,
        _: &str,
    ) -> Result<
        futures::stream::BoxStream<'static, handoff_discovery::Message>,
        handoff_discovery::DiscoveryError,
    > {
        Ok(Box::pin(futures::stream::pending()))
    }

    async fn request(
        &self,
        _: String,
        _: bytes::Bytes,
        _: Duration,
    ) -> Result<bytes::Bytes, handoff_discovery::DiscoveryError> {
        std::future::pending().await
    }
}

/// A load report the bus never takes does not hold the replica's shutdown (it waited for
/// the bus to come back).
#[tokio::test]
async fn a_stalled_bus_does_not_hold_a_replicas_shutdown() {
    let registry = Arc::new(MemoryRegistry::new());
    let bus = Arc::new(StalledBus(tokio::sync::Notify::new()));
    let tasks = Tasks::new();
    let cfg =
        SchedulerConfig { load_share_interval: Duration::from_millis(5), ..Default::default() };
    let _s = Scheduler::start(cfg, registry, bus.clone(), &tasks).await.unwrap();
    bus.0.notified().await;
    let stopped = tokio::time::timeout(Duration::from_secs(5), tasks.shutdown()).await;
    assert!(stopped.is_ok(), "shut down while a load report waits on the bus");
}
