use handoff_discovery::{Instance, MemoryBus, MemoryRegistry, Role};

use super::*;

fn prefill(id: &str) -> Instance {
    Instance::fixture(id.parse().unwrap(), Role::Prefill)
}

/// The wait ends when the replica knows the registered prefills, fails when it cannot learn
/// them (here: it follows another, empty registry), and ends when they leave the registry.
#[tokio::test]
async fn the_replica_is_waited_for_until_it_knows_the_registered_prefills() {
    let registry = Arc::new(MemoryRegistry::new());
    for id in ["p0", "p1"] {
        registry.register(prefill(id)).await.unwrap();
    }
    let tasks = Tasks::new();
    let bus: Arc<dyn EventBus> = Arc::new(MemoryBus::new());
    let cfg = SchedulerConfig::default();
    let knowing = Scheduler::start(cfg.clone(), registry.clone(), bus.clone(), &tasks).await;
    let knowing = knowing.unwrap();
    learn_registered(&knowing, &*registry, Duration::from_secs(10)).await.unwrap();
    assert_eq!(knowing.state().instances().len(), 2);

    let elsewhere = Arc::new(MemoryRegistry::new());
    let blind = Scheduler::start(cfg, elsewhere, bus, &tasks).await.unwrap();
    let e = learn_registered(&blind, &*registry, Duration::from_millis(50)).await;
    assert!(e.unwrap_err().to_string().contains("did not learn"));

    // What leaves the registry meanwhile is not waited for.
    let leave = async {
        for id in ["p0", "p1"] {
            registry.deregister(&id.parse().unwrap()).await.unwrap();
        }
    };
    let (waited, ()) =
        tokio::join!(learn_registered(&blind, &*registry, Duration::from_secs(10)), leave);
    waited.unwrap();
    tasks.shutdown().await;
}
