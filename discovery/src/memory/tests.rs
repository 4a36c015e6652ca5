use super::*;

fn inst(id: &str, role: Role) -> Instance {
    Instance::fixture(id.parse().unwrap(), role)
}

#[tokio::test]
async fn watch_starts_with_a_snapshot_then_follows_changes() {
    let reg = MemoryRegistry::new();
    reg.register(inst("p1", Role::Prefill)).await.unwrap();
    reg.register(inst("f1", Role::Frontend)).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(w.next().await, Some(Update::Reset(vec![inst("p1", Role::Prefill)])));
    reg.register(inst("f2", Role::Frontend)).await.unwrap();
    reg.register(inst("p2", Role::Prefill)).await.unwrap();
    assert_eq!(w.next().await, Some(Update::Add(inst("p2", Role::Prefill))));
    reg.deregister(&"p1".parse().unwrap()).await.unwrap();
    assert_eq!(w.next().await, Some(Update::Remove("p1".parse().unwrap())));
}

#[tokio::test]
async fn bus_delivers_by_prefix() {
    let bus = MemoryBus::new();
    let mut s = bus.subscribe("handoff.v1.kv.").await.unwrap();
    bus.publish("handoff.v1.liveness.a".into(), Bytes::from_static(b"x")).await.unwrap();
    bus.publish("handoff.v1.kv.a".into(), Bytes::from_static(b"y")).await.unwrap();
    assert_eq!(s.next().await.unwrap().payload, Bytes::from_static(b"y"));
}
