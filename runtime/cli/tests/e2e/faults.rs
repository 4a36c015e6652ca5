//! Faults injected through the transfer seam: every one fails its attempt before a token is
//! decoded from it, the request is retried on the other instance with a fresh room, and the
//! client still gets the right tokens. With no instance left: a clear error, not a hang.

use std::time::{Duration, Instant};

use handoff::ClusterConfig;
use handoff_transfer::{Fault, FaultSwitch};

use super::support::*;

#[tokio::test]
async fn each_fault_is_caught_and_the_request_retried_elsewhere() {
    for (fault, reason) in [
        (Fault::WrongRoom, "bootstrap_room mismatch"),
        (Fault::FlipByte, "checksum mismatch"),
        (Fault::Truncate, "short transfer"),
        (Fault::SenderGone, "sender gone"),
    ] {
        let switch = FaultSwitch::new();
        switch.arm(fault, usize::MAX);
        let cfg = ClusterConfig {
            faults: vec![Some(switch.clone()), None],
            ..ClusterConfig::ephemeral()
        };
        let c = cluster(cfg).await;
        let mut cl = client(&c).await;
        let mut retried = 0;
        for seed in 0..6 {
            let p = prompt(seed, 50);
            let (tokens, done) =
                generate(&mut cl, &p, 6).await.unwrap_or_else(|e| panic!("{fault:?}: {e}"));
            assert_eq!(tokens, aggregated(&*engine(), &p, 6).await, "{fault:?}: right tokens");
            let ev = done.evidence.unwrap();
            assert_eq!(ev.instance_id, "prefill-1", "{fault:?}: served by the healthy instance");
            for a in &ev.failed_attempts {
                retried += 1;
                assert_eq!(a.instance_id, "prefill-0");
                assert_ne!(a.bootstrap_room, ev.bootstrap_room, "a fresh room per attempt");
                assert!(a.error.contains(reason), "{fault:?}: {}", a.error);
            }
        }
        assert!(retried > 0, "{fault:?}: some request was first sent to the faulty instance");
        assert!(switch.remaining() < usize::MAX, "{fault:?}: the fault was exercised");
        c.shutdown().await;
    }
}

#[tokio::test]
async fn with_no_healthy_instance_the_client_gets_a_clear_error() {
    let (a, b) = (FaultSwitch::new(), FaultSwitch::new());
    a.arm(Fault::FlipByte, usize::MAX);
    b.arm(Fault::SenderGone, usize::MAX);
    let cfg = ClusterConfig { faults: vec![Some(a), Some(b)], ..ClusterConfig::ephemeral() };
    let c = cluster(cfg).await;
    let mut cl = client(&c).await;
    let started = Instant::now();
    let err = generate(&mut cl, &prompt(1, 40), 4).await.expect_err("no instance can serve");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(
        err.message().contains("checksum mismatch") && err.message().contains("sender gone"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(10), "failed fast, not at a deadline");
    assert_eq!(c.frontend.agent().inbox().regions(), 0);
    // The operator's view: the request's evidence by any of its rooms, and the failures
    // counted by stage and cause.
    let room: u64 =
        err.message().split("room ").nth(1).unwrap().split(':').next().unwrap().parse().unwrap();
    let t = c.frontend.trace(room).expect("the failed request is remembered");
    assert_eq!(t.code, "Unavailable");
    assert_eq!(t.attempts.len(), 2, "{t:?}");
    assert!(t.attempts.iter().all(|a| !a.error.is_empty()), "{t:?}");
    let scrape = c.frontend.ops().scrape();
    let failures: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("handoff_frontend_attempt_failures_total{"))
        .filter(|l| l.contains("cause=\"instance\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(failures, 2.0, "{scrape}");
    assert!(scrape.contains("handoff_frontend_requests_total{outcome=\"failed\"} 1"), "{scrape}");
    c.shutdown().await;
}

#[tokio::test]
async fn a_token_guards_handshakes_and_the_right_one_passes() {
    let cfg = ClusterConfig { token: Some("s3cret".into()), ..ClusterConfig::ephemeral() };
    let c = cluster(cfg).await;
    let mut cl = client(&c).await;
    let p = prompt(5, 40);
    assert_eq!(generate(&mut cl, &p, 4).await.unwrap().0, aggregated(&*engine(), &p, 4).await);
    c.shutdown().await;

    // A frontend with the wrong token never gets KV: the scheduler refuses its selections
    // (and the ranks' transfer listeners would refuse its connections at their hello).
    let mut cfg = ClusterConfig { token: Some("s3cret".into()), ..ClusterConfig::ephemeral() };
    cfg.frontend.transfer_token = Some("wrong".into());
    let c = cluster(cfg).await;
    let mut cl = client(&c).await;
    let err = generate(&mut cl, &p, 4).await.expect_err("refused");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
    assert!(err.message().contains("wrong bearer token"), "{err}");
    c.shutdown().await;
}

/// Discovery that takes registrations but cannot be told of a departure (etcd away).
struct CannotDeregister(handoff_discovery::MemoryRegistry);

#[async_trait::async_trait]
impl handoff_discovery::Registry for CannotDeregister {
    async fn register(
        &self,
        instance: handoff_discovery::Instance,
    ) -> Result<(), handoff_discovery::DiscoveryError> {
        self.0.register(instance).await
    }

    async fn deregister(
        &self,
        _: &handoff_core::InstanceId,
    ) -> Result<(), handoff_discovery::DiscoveryError> {
        Err(handoff_discovery::DiscoveryError::Unavailable("etcd is away".into()))
    }

    async fn watch(
        &self,
        role: handoff_discovery::Role,
    ) -> Result<
        futures::stream::BoxStream<'static, handoff_discovery::Update>,
        handoff_discovery::DiscoveryError,
    > {
        self.0.watch(role).await
    }
}

/// The mock engine at 5 ms a prefill token.
fn slow_engine() -> std::sync::Arc<handoff_engine::MockEngine> {
    std::sync::Arc::new(handoff_engine::MockEngine::new(handoff_engine::MockConfig {
        prefill_per_token: Duration::from_millis(5),
        ..Default::default()
    }))
}

/// Waits (up to 30 s) until the scheduler knows every prefill's cost per token (from its
/// first heartbeat), on which an attempt's time is reckoned.
async fn until_costs_known(c: &handoff::Cluster) {
    let since = Instant::now();
    let state = c.schedulers[0].scheduler.state();
    while state.instances().iter().any(|i| i.token_cost_us <= 0.0) {
        assert!(since.elapsed() < Duration::from_secs(30), "the prefills' costs are heard");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Waits (up to 5 s) until the first prefill runs a request.
async fn until_running(c: &handoff::Cluster) {
    let since = Instant::now();
    while c.prefills[0].running() == 0 {
        assert!(since.elapsed() < Duration::from_secs(5), "the request reaches the prefill");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A cluster of `cfg` on `engine` whose discovery cannot be told of a departure.
async fn cannot_deregister(
    cfg: ClusterConfig,
    engine: std::sync::Arc<handoff_engine::MockEngine>,
) -> handoff::Cluster {
    use std::sync::Arc;
    let engines = || Ok(engine.clone() as Arc<dyn handoff_engine::Engine>);
    let registry = Arc::new(CannotDeregister(handoff_discovery::MemoryRegistry::new()));
    let bus = Arc::new(handoff_discovery::MemoryBus::new());
    handoff::Cluster::start_with(cfg, &engines, registry, bus, handoff_core::Tasks::new())
        .await
        .unwrap()
}

/// A drain while discovery is out of reach still waits for the request in flight (before,
/// it gave up at once and the process exited under it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_its_requests_when_discovery_is_out_of_reach() {
    let engine = slow_engine();
    let cfg = ClusterConfig { prefills: 1, ..ClusterConfig::ephemeral() };
    let c = cannot_deregister(cfg, engine).await;
    let mut cl = client(&c).await;
    // 100 tokens at 5 ms: half a second of prefill.
    let request = tokio::spawn(async move { generate(&mut cl, &prompt(1, 100), 4).await });
    until_running(&c).await;
    c.prefills[0].drain(Duration::from_secs(10)).await.expect("drains all the same");
    assert_eq!(c.prefills[0].running(), 0, "waited for the request in flight");
    request.await.unwrap().expect("the request in flight is served");
}

/// A draining instance answers no KV snapshot request: a replacement registered under its
/// id before it stops (a ctl drain leaves the process running) would otherwise have the
/// schedulers resync the new one's index from the old one's cache, and take the new one's
/// events, numbered from 1, for old ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_instance_answers_no_snapshot_request() {
    let c = cluster(ClusterConfig { prefills: 1, ..ClusterConfig::ephemeral() }).await;
    let subject = handoff_discovery::events::snapshot_subject(&"prefill-0".parse().unwrap());
    let ask = |within| c.bus.request(subject.clone(), bytes::Bytes::new(), within);
    ask(Duration::from_secs(5)).await.expect("answered while serving");
    c.prefills[0].drain(Duration::ZERO).await.expect("drained");
    assert!(ask(Duration::from_millis(500)).await.is_err(), "answered while draining");
    c.shutdown().await;
}

/// A draining instance takes no new request even when discovery could not be told (etcd
/// away, so a scheduler still routes to it): each one routed there is refused and served by
/// the other instance. Before, the draining instance served them, past its grace.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_instance_refuses_new_requests_when_discovery_is_out_of_reach() {
    // Round robin: the scheduler goes to the draining instance every other request.
    let scheduler = handoff_scheduler::SchedulerConfig {
        default_policy: handoff_scheduler::PolicyKind::RoundRobin,
        ..Default::default()
    };
    let c = cannot_deregister(ClusterConfig { scheduler, ..ClusterConfig::ephemeral() }, engine())
        .await;
    c.prefills[0].drain(Duration::ZERO).await.expect("drains all the same");
    let mut cl = client(&c).await;
    let mut refused = 0;
    for seed in 0..8 {
        let (_, done) = generate(&mut cl, &prompt(seed, 40), 2).await.expect("served");
        let ev = done.evidence.unwrap();
        assert_eq!(ev.instance_id, "prefill-1", "served by the instance not draining");
        for a in &ev.failed_attempts {
            assert_eq!(a.instance_id, "prefill-0");
            assert!(a.error.contains("draining"), "{}", a.error);
            refused += 1;
        }
    }
    assert!(refused > 0, "the scheduler still routed to the draining instance");
}

/// A cluster whose first prefill's engine is `first` (another model), the others' and the
/// frontend's the default mock.
async fn cluster_with_first_prefill(first: handoff_engine::MockConfig) -> handoff::Cluster {
    let first = std::sync::Arc::new(handoff_engine::MockEngine::new(first));
    cluster_with_first_engine(ClusterConfig::ephemeral(), first).await
}

/// A cluster of `cfg` whose first prefill's engine is `first`, the others' and the
/// frontend's the default mock.
async fn cluster_with_first_engine(
    cfg: ClusterConfig,
    first: std::sync::Arc<dyn handoff_engine::Engine>,
) -> handoff::Cluster {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Engines are made prefills first, then the frontend.
    let made = AtomicUsize::new(0);
    let engines = || match made.fetch_add(1, Ordering::Relaxed) {
        0 => Ok(first.clone()),
        _ => Ok(Arc::new(handoff_engine::MockEngine::new(handoff_engine::MockConfig::default()))
            as Arc<dyn handoff_engine::Engine>),
    };
    handoff::Cluster::start_with(
        cfg,
        &engines,
        Arc::new(handoff_discovery::MemoryRegistry::new()),
        Arc::new(handoff_discovery::MemoryBus::new()),
        handoff_core::Tasks::new(),
    )
    .await
    .unwrap()
}

/// Serves prompts until one was tried on prefill-0 (another model's) and refused for `why`:
/// each is served by prefill-1 with the right tokens.
async fn served_past_the_other_model(c: &handoff::Cluster, why: &str) {
    let mut cl = client(c).await;
    let mut refused = 0;
    for seed in 0..8 {
        let p = prompt(seed, 40);
        let (tokens, done) = generate(&mut cl, &p, 3).await.expect("served");
        assert_eq!(tokens, aggregated(&*engine(), &p, 3).await, "right tokens");
        let ev = done.evidence.unwrap();
        assert_eq!(ev.instance_id, "prefill-1", "served by the instance of the same model");
        for a in &ev.failed_attempts {
            assert_eq!(a.instance_id, "prefill-0");
            assert!(a.error.contains(why), "{}", a.error);
            refused += 1;
        }
    }
    assert!(refused > 0, "the scheduler never chose the other model's instance");
}

/// A prefill whose first token is outside the decode's vocabulary (another model, or a
/// broken one) fails its attempt before a token reaches the client, and the request is
/// served by the other instance. Before, the token went to the client and into the decode
/// batch, where SmolLM2 failed every sequence decoded with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_token_outside_the_vocabulary_is_refused_and_retried_elsewhere() {
    let other = handoff_engine::MockConfig { vocab: 1 << 30, ..Default::default() };
    let c = cluster_with_first_prefill(other).await;
    served_past_the_other_model(&c, "outside the vocabulary of 32000").await;
}

/// A prefill of another model (KV of another size, a smaller vocabulary, or other weights of
/// the same shape) refuses the request as a mismatch, not as the client's bad input: the
/// frontend tries the other instance. Before, the client got INVALID_ARGUMENT (400) and the
/// scheduler, told the client erred, kept sending a share of all requests there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_of_another_model_is_a_mismatch_retried_elsewhere() {
    let deeper = handoff_engine::MockConfig {
        shape: handoff_engine::KvShape { layers: 8, kv_heads: 4, head_bytes: 32 },
        ..Default::default()
    };
    served_past_the_other_model(&cluster_with_first_prefill(deeper).await, "this shard needs")
        .await;
    let smaller = handoff_engine::MockConfig { vocab: 2_000, ..Default::default() };
    served_past_the_other_model(&cluster_with_first_prefill(smaller).await, "vocabulary of 2000")
        .await;
    // Found in review: other weights of the same shape (a fine-tune, another quantization)
    // sent KV the decode continued from into fluent, wrong text.
    let retrained = handoff_engine::MockConfig { fingerprint: 7, ..Default::default() };
    let serves = "this instance serves 0000000000000007";
    served_past_the_other_model(&cluster_with_first_prefill(retrained).await, serves).await;
}

/// A test engine: the mock, whose prefills after the instance's two warm-up ones never
/// finish, as an engine hung behind a live process.
struct HungAfterWarmUp {
    mock: handoff_engine::MockEngine,
    prefills: std::sync::atomic::AtomicUsize,
}

impl HungAfterWarmUp {
    async fn hang_unless_warming_up(&self) {
        if self.prefills.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= 2 {
            std::future::pending::<()>().await;
        }
    }
}

#[async_trait::async_trait]
impl handoff_engine::Engine for HungAfterWarmUp {
    fn info(&self) -> &handoff_engine::ModelInfo {
        self.mock.info()
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, handoff_engine::EngineError> {
        self.mock.tokenize(text)
    }

    fn detokenize(&self, tokens: &[u32]) -> String {
        self.mock.detokenize(tokens)
    }

    fn chat_prompt(
        &self,
        messages: &[handoff_engine::ChatMessage],
    ) -> Result<String, handoff_engine::EngineError> {
        self.mock.chat_prompt(messages)
    }

    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<handoff_engine::Kv>,
        sampling: &handoff_engine::Sampling,
    ) -> Result<handoff_engine::Prefilled, handoff_engine::EngineError> {
        self.hang_unless_warming_up().await;
        self.mock.prefill(tokens, prefix, sampling).await
    }

    fn decoder(
        &self,
        kv: handoff_engine::Kv,
        last_token: u32,
        sampling: &handoff_engine::Sampling,
    ) -> Result<Box<dyn handoff_engine::Decoder>, handoff_engine::EngineError> {
        self.mock.decoder(kv, last_token, sampling)
    }
}

/// A prefill whose engine hangs while the instance stays up (its heartbeats go on) gives no
/// answer within the wait expected of it plus the attempt timeout: its fault, counted by the
/// scheduler's breaker, and the request is served by the other instance. Before, the timeout
/// was taken as the request's own deadline, which no breaker counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_hangs_behind_live_heartbeats_is_at_fault() {
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.attempt_timeout = Duration::from_secs(1);
    let hung = HungAfterWarmUp {
        mock: handoff_engine::MockEngine::new(handoff_engine::MockConfig::default()),
        prefills: Default::default(),
    };
    let c = cluster_with_first_engine(cfg, std::sync::Arc::new(hung)).await;
    until_costs_known(&c).await;
    served_past_the_other_model(&c, "no answer within the wait expected of it").await;
}

/// An attempt is given the wait expected ahead of it, its own prefill and the attempt
/// timeout: a prompt whose prefill alone takes longer than the timeout is served. Before, its
/// own prefill was left out, and such a prompt timed out on every instance.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_longer_than_the_attempt_timeout_is_waited_for() {
    let mut cfg = ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() };
    cfg.frontend.attempt_timeout = Duration::from_millis(500);
    let c = handoff::Cluster::start_shared(cfg, slow_engine()).await.unwrap();
    until_costs_known(&c).await;
    let mut cl = client(&c).await;
    // 300 tokens at 5 ms: 1.5 s of prefill.
    let (_, done) = generate(&mut cl, &prompt(1, 300), 2).await.expect("served");
    assert!(done.evidence.unwrap().failed_attempts.is_empty(), "served at the first attempt");
}

/// A request that waits in a busy prefill's queue past its deadline is refused as an
/// overload (`RESOURCE_EXHAUSTED`: the instance is alive and busy, not silent), so a client
/// whose every attempt did so gets 429, and no breaker counts it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_passed_in_a_prefills_queue_is_an_overload() {
    use handoff_proto::v1::PrefillRequest;
    use handoff_proto::v1::prefill_client::PrefillClient;
    let engine = slow_engine();
    let cfg = ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() };
    let c = handoff::Cluster::start_shared(cfg, engine).await.unwrap();
    let mut cl = client(&c).await;
    // 200 tokens at 5 ms: a second of the only engine slot.
    let busy = tokio::spawn(async move { generate(&mut cl, &prompt(1, 200), 2).await });
    until_running(&c).await;
    let addr = &c.prefills[0].grpc_addr;
    let mut prefill = PrefillClient::connect(format!("http://{addr}")).await.unwrap();
    let late = PrefillRequest {
        bootstrap_room: 7,
        token_ids: vec![1, 2, 3],
        deadline_ms: 50,
        ..Default::default()
    };
    let e = prefill.prefill(late).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e}");
    assert!(e.message().contains("deadline passed in the engine's queue"), "{e}");
    // Counted apart from a full queue's refusals: a queue that does not move shows.
    let scrape = c.prefills[0].ops().scrape();
    assert!(scrape.contains("requests_total{result=\"queue_deadline\"} 1\n"), "{scrape}");
    busy.await.unwrap().expect("the request holding the engine is served");
}

/// A prefill that cannot connect back to the decode's receiver (a firewall on the decode's
/// side, a wrong advertised address: here one where nothing listens) fails the attempt on
/// the path back to the decode, not on the instance: no breaker counts it, and this
/// frontend's own view of what it cannot reach does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_that_cannot_reach_the_decodes_receiver_is_not_at_fault() {
    let c = cluster(ClusterConfig { prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let unreachable = handoff_transfer::TransferKind::Tcp {
        bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        advertise_ip: Some("127.0.0.2".into()),
        tls: None,
        shared_memory: false,
    };
    let e = match try_direct_attempt_over(&c, &*engine(), 1, &prompt(1, 32), unreachable).await {
        Err(e) => e,
        Ok(_) => panic!("the KV came to a receiver nobody could reach"),
    };
    assert_eq!(e.cause(), Some(handoff_frontend::Cause::Decode), "{e}");
    assert!(e.to_string().contains("cannot reach the decode's receiver"), "{e}");
    assert!(handoff_frontend::reach::unreachable(&e), "{e}");
    c.shutdown().await;
}

/// A prefill draining refuses new work (a request routed to it before its deregistration was
/// seen): that is not its fault (no breaker counts it, the frontend keeps its way of calling
/// it), but another instance is asked, as when one is full.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefills_refusal_is_not_its_fault() {
    let c = cluster(ClusterConfig::ephemeral()).await;
    c.prefills[0].drain(Duration::ZERO).await.expect("drained");
    let e = match try_direct_attempt(&c, &*engine(), 1, &prompt(1, 32)).await {
        Err(e) => e,
        Ok(_) => panic!("a draining prefill took new work"),
    };
    assert_eq!(e.cause(), Some(handoff_frontend::Cause::Overloaded), "{e}");
    assert!(e.to_string().contains("draining"), "{e}");
    c.shutdown().await;
}
