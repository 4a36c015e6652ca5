//! The etcd registry and the NATS bus against real servers.

use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::StreamExt;
use handoff_core::Tasks;
use handoff_discovery::{EtcdRegistry, EventBus, Instance, NatsBus, Registry, Role, Update};

use super::servers::Server;

pub(crate) fn inst(id: &str) -> Instance {
    Instance::fixture(id.parse().unwrap(), Role::Prefill)
}

async fn next(w: &mut futures::stream::BoxStream<'static, Update>, within: Duration) -> Update {
    tokio::time::timeout(within, w.next()).await.expect("an update in time").expect("watch open")
}

#[tokio::test]
async fn register_watch_deregister_and_lease_expiry_on_etcd() {
    let etcd = Server::etcd();
    let nats = Server::nats();
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(2), &tasks).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![]));
    reg.register(inst("p1")).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Add(inst("p1")));
    // Kept alive past several TTLs.
    tokio::time::sleep(Duration::from_secs(5)).await;
    reg.deregister(&"p1".parse().unwrap()).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Remove("p1".parse().unwrap()));

    // A process that dies without a word: its lease (TTL 2 s) expires.
    let mut p = super::servers::prefill(&etcd, &nats, "doomed", &["--lease-ttl-secs", "2"]);
    assert!(
        matches!(next(&mut w, Duration::from_secs(10)).await, Update::Add(i) if i.id.as_str() == "doomed")
    );
    let killed = Instant::now();
    p.kill9();
    assert_eq!(
        next(&mut w, Duration::from_secs(10)).await,
        Update::Remove("doomed".parse().unwrap())
    );
    let took = killed.elapsed();
    assert!(took <= Duration::from_secs(3), "removed {took:?} after kill -9, lease TTL 2 s");
    tasks.shutdown().await;
}

#[tokio::test]
async fn etcd_restart_gives_watchers_a_reset_and_instances_register_again() {
    let mut etcd = Server::etcd();
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(2), &tasks).await.unwrap();
    reg.register(inst("p1")).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![inst("p1")]));
    etcd.stop();
    // Longer than the TTL: the lease lapses while etcd is away.
    tokio::time::sleep(Duration::from_secs(3)).await;
    etcd.start();
    // The watcher reconnects with a fresh snapshot; the instance is registered again.
    seen_again(&mut w, "p1", Instant::now() + Duration::from_secs(20)).await;
    tasks.shutdown().await;
}

/// With auth on, etcd's tokens expire (JWTs here, after 2 s): a registry that keeps using
/// its first token cannot register once it has expired. It must authenticate again.
#[tokio::test]
async fn an_authenticated_registry_outlives_its_token() {
    let pem =
        super::servers::PemFiles::write(&handoff_core::tls::test_certs::TestCa::new().issue());
    let etcd = Server::etcd_jwt(&pem, 2);
    let mut admin = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let access = handoff_discovery::ServerAccess {
        user: Some(("root".into(), "s3cret".into())),
        ..Default::default()
    };
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect_with(&etcd.url, &access, Duration::from_secs(2), &tasks)
        .await
        .unwrap();
    reg.register(inst("p1")).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![inst("p1")]));
    // Past the token's life.
    tokio::time::sleep(Duration::from_secs(3)).await;
    reg.register(inst("p2")).await.expect("registers with a fresh token");
    seen_again(&mut w, "p2", Instant::now() + Duration::from_secs(20)).await;
    tasks.shutdown().await;
}

/// A process started before its etcd waits for it: connecting with credentials and
/// registering both go through once etcd is up (before, each failed at once, and the process
/// exited: a cluster rebooted with etcd a little late stayed down under systemd's restart
/// limits, and Kubernetes backed its restarts off for minutes). Credentials etcd refuses are
/// an error at once.
#[tokio::test]
async fn a_process_started_before_its_etcd_waits_for_it() {
    let pem =
        super::servers::PemFiles::write(&handoff_core::tls::test_certs::TestCa::new().issue());
    let mut etcd = Server::etcd_jwt(&pem, 60);
    let mut admin = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    admin.user_add("root", "s3cret", None).await.unwrap();
    admin.user_grant_role("root", "root").await.unwrap();
    admin.auth_enable().await.unwrap();
    let access = |pass: &str| handoff_discovery::ServerAccess {
        user: Some(("root".into(), pass.into())),
        ..Default::default()
    };
    let wrong = EtcdRegistry::connect_with(
        &etcd.url,
        &access("wrong"),
        Duration::from_secs(2),
        &Tasks::new(),
    )
    .await;
    assert!(wrong.is_err(), "refused credentials are an error at once");
    etcd.stop();
    let tasks = Tasks::new();
    let (url, t) = (etcd.url.clone(), tasks.clone());
    let started = tokio::spawn(async move {
        let reg =
            EtcdRegistry::connect_with(&url, &access("s3cret"), Duration::from_secs(2), &t).await?;
        reg.register(inst("early")).await?;
        Ok::<_, handoff_discovery::DiscoveryError>(reg)
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!started.is_finished(), "waiting for etcd, not given up");
    etcd.start();
    let reg = tokio::time::timeout(Duration::from_secs(30), started)
        .await
        .expect("registered once etcd is up")
        .unwrap()
        .expect("connected and registered");
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![inst("early")]));
    tasks.shutdown().await;
}

/// Waits until `w` shows instance `id` (an `Add`, or a `Reset` holding it) before `deadline`.
async fn seen_again(
    w: &mut futures::stream::BoxStream<'static, Update>,
    id: &str,
    deadline: Instant,
) {
    loop {
        let u = next(w, deadline.saturating_duration_since(Instant::now())).await;
        if matches!(&u, Update::Reset(all) if all.contains(&inst(id))) || u == Update::Add(inst(id))
        {
            return;
        }
    }
}

/// A registration past the bound is refused; a role whose registrations add up to more than
/// gRPC's default 4 MiB answer is still read whole.
#[tokio::test]
async fn registrations_are_bounded_and_a_large_role_is_read_whole() {
    let etcd = Server::etcd();
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(5), &tasks).await.unwrap();
    let sized = |id: &str, bytes: usize| Instance { model: "m".repeat(bytes), ..inst(id) };
    let limit = handoff_discovery::etcd::MAX_REGISTRATION_BYTES;
    let refused = reg.register(sized("huge", limit)).await;
    assert!(matches!(refused, Err(handoff_discovery::DiscoveryError::TooLarge { .. })));
    let ids: Vec<String> = (0..80).map(|i| format!("p{i}")).collect();
    for id in &ids {
        reg.register(sized(id, limit - 1024)).await.unwrap();
    }
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    match next(&mut w, Duration::from_secs(10)).await {
        Update::Reset(all) => assert_eq!(all.len(), ids.len()),
        other => panic!("{other:?}"),
    }
    tasks.shutdown().await;
}

/// A registration deleted while its lease lives (`etcdctl del`, or an earlier process of the
/// same id deregistering) is put back within a TTL.
#[tokio::test]
async fn a_registration_deleted_under_a_live_lease_comes_back() {
    let etcd = Server::etcd();
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(2), &tasks).await.unwrap();
    reg.register(inst("p1")).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![inst("p1")]));
    let mut admin = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let key = format!("{}prefill/p1", handoff_discovery::etcd::KEY_PREFIX);
    assert_eq!(admin.delete(key, None).await.unwrap().deleted(), 1);
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Remove("p1".parse().unwrap()));
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Add(inst("p1")));
    tasks.shutdown().await;
}

/// A registration another writer changes while its lease lives (its addresses pointed at
/// another host) is put back within a TTL. Before, only a deleted key was: the changed one
/// kept the instance's traffic, while the real process beat on, looking healthy.
#[tokio::test]
async fn a_registration_changed_under_a_live_lease_is_put_back() {
    let etcd = Server::etcd();
    let tasks = Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(2), &tasks).await.unwrap();
    reg.register(inst("p1")).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Reset(vec![inst("p1")]));
    let mut admin = etcd_client::Client::connect([etcd.url.as_str()], None).await.unwrap();
    let key = format!("{}prefill/p1", handoff_discovery::etcd::KEY_PREFIX);
    let forged = Instance { grpc_addr: "10.9.9.9:50060".into(), ..inst("p1") };
    admin.put(key, serde_json::to_vec(&forged).unwrap(), None).await.unwrap();
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Add(forged));
    assert_eq!(next(&mut w, Duration::from_secs(5)).await, Update::Add(inst("p1")));
    tasks.shutdown().await;
}

#[tokio::test]
async fn nats_publish_subscribe_and_request_reply() {
    let nats = Server::nats();
    let bus = NatsBus::connect(&nats.url).await.unwrap();
    let mut kv = bus.subscribe("handoff.v1.kv.").await.unwrap();
    let mut asks = bus.subscribe("handoff.v1.kvsnapshot.p1").await.unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    bus.publish("handoff.v1.liveness.p1".into(), Bytes::from_static(b"no")).await.unwrap();
    bus.publish("handoff.v1.kv.p1".into(), Bytes::from_static(b"yes")).await.unwrap();
    let m = tokio::time::timeout(Duration::from_secs(5), kv.next()).await.unwrap().unwrap();
    assert_eq!((m.subject.as_str(), &m.payload[..]), ("handoff.v1.kv.p1", &b"yes"[..]));
    let b2 = bus.clone();
    let answer = tokio::spawn(async move {
        let m = asks.next().await.unwrap();
        b2.publish(m.reply.unwrap(), Bytes::from_static(b"snapshot")).await.unwrap();
    });
    let got = bus
        .request("handoff.v1.kvsnapshot.p1".into(), Bytes::new(), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(&got[..], b"snapshot");
    answer.await.unwrap();
    assert!(
        bus.request(
            "handoff.v1.kvsnapshot.nobody".into(),
            Bytes::new(),
            Duration::from_millis(300)
        )
        .await
        .is_err()
    );
}

/// Two scheduler replicas on one real NATS server share their in-flight load: requests
/// alternating between them still land on four different instances.
#[tokio::test]
async fn scheduler_replicas_share_in_flight_load_over_nats() {
    use handoff_scheduler::{Scheduler, SchedulerConfig};
    let nats = Server::nats();
    let registry = std::sync::Arc::new(handoff_discovery::MemoryRegistry::new());
    for id in ["p0", "p1", "p2", "p3"] {
        registry.register(inst(id)).await.unwrap();
    }
    let tasks = Tasks::new();
    let cfg =
        SchedulerConfig { load_share_interval: Duration::from_millis(5), ..Default::default() };
    let mut replicas = Vec::new();
    for _ in 0..2 {
        let bus: std::sync::Arc<dyn EventBus> =
            std::sync::Arc::new(NatsBus::connect(&nats.url).await.unwrap());
        replicas.push(Scheduler::start(cfg.clone(), registry.clone(), bus, &tasks).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let prompt =
        |i: u32| handoff_core::block_hashes(&(256 * i..256 * (i + 1)).collect::<Vec<_>>(), 16);
    let mut chosen = Vec::new();
    for i in 0..4u32 {
        let s = replicas[i as usize % 2].state();
        chosen.push(
            s.select(&handoff_scheduler::Ask::new(&prompt(i), 256))
                .unwrap()
                .instance
                .id
                .to_string(),
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    chosen.sort();
    chosen.dedup();
    assert_eq!(chosen.len(), 4, "each instance got one request: {chosen:?}");
    tasks.shutdown().await;
}
