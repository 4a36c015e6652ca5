//! Frontends as processes. Readiness in front of engines alone: an SGLang engine it drives
//! counts as a prefill instance. Its operations listener, up while it waits. And a frontend killed with SIGKILL while its requests wait
//! in a prefill's queue: it reports
//! none of their bookings, and the scheduler counted their load until the requests'
//! deadlines (a minute), refusing or steering away the other frontends' requests. Now its
//! registration's lease lapsing ends them: their load is gone within the lease's TTL and
//! the booking grace (10 s each).

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use super::processes::{addr_after, frontend, scheduler};
use super::servers::{Handoff, Server};

/// The bookings the scheduler at `sched` holds on every instance.
async fn booked(sched: &mut SchedulerClient<tonic::transport::Channel>) -> u32 {
    let all = sched.list_instances(ListInstancesRequest {}).await.unwrap().into_inner();
    all.instances.iter().map(|i| i.in_flight).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_frontends_load_is_forgotten_within_its_lease_and_the_grace() {
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let (_scheduler, addr) = scheduler(&etcd, &nats);
    let mut sched = SchedulerClient::connect(format!("http://{addr}")).await.unwrap();
    // 40 tokens at 20 ms each: 0.8 s a prompt, one at a time.
    let _prefill = super::servers::prefill(&etcd, &nats, "slow", &["--mock-prefill-us", "20000"]);
    let (mut frontend, addr) = frontend(&etcd, &nats);
    let client = GenerateClient::connect(format!("http://{addr}")).await.unwrap();
    // Twelve requests at once, each with a minute: most wait in the prefill's queue.
    let mut asked = Vec::new();
    for seed in 0..12u32 {
        let mut c = client.clone();
        asked.push(tokio::spawn(async move {
            let ids = (0..40).map(|i| 2 + (seed * 31 + i) % 30_000).collect();
            let req = GenerateRequest {
                input: Some(Input::TokenIds(TokenIds { ids })),
                sampling: Some(SamplingParams { max_tokens: 2, ..Default::default() }),
                deadline_ms: 60_000,
                ..Default::default()
            };
            let _ = c.generate(req).await;
        }));
    }
    let since = Instant::now();
    while booked(&mut sched).await < 6 {
        assert!(since.elapsed() < Duration::from_secs(30), "requests booked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    frontend.kill9();
    let killed = Instant::now();
    while booked(&mut sched).await > 0 {
        assert!(
            killed.elapsed() < Duration::from_secs(35),
            "the killed frontend's bookings still held after 35 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("a killed frontend's bookings gone {:?} after the kill", killed.elapsed());
    for a in asked {
        a.abort();
    }
}

/// A frontend in front of engines alone (no handoff prefill), following etcd, is ready once
/// an engine it drives registers: an SGLang server with its bootstrap directory. Before, its
/// readiness waited for a handoff prefill forever (a Kubernetes Service sent it no client).
/// A vLLM engine counts only for a frontend that drives vLLM (`--drive-vllm`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_in_front_of_engines_alone_is_ready_once_one_it_drives_registers() {
    use handoff_discovery::{EngineEndpoints, EtcdRegistry, Instance, Registry, Role};
    let etcd = Server::etcd();
    let nats = Server::nats();
    let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let (_sched, _) = Handoff::spawn(&[&["scheduler", "--listen", "127.0.0.1:0"][..], &d].concat());
    let (_fe, line) = super::operations::spawn_frontend(&d);
    let fe_http = addr_after(&line, "http://");
    let not_ready = (503, "not ready: no prefill instance registered".to_owned());
    assert_eq!(super::operations::http_get(&fe_http, "/readyz").await, not_ready);
    let tasks = handoff_core::Tasks::new();
    let reg = EtcdRegistry::connect(&etcd.url, Duration::from_secs(10), &tasks).await.unwrap();
    let engine = |id: &str, kind: &str| Instance {
        engine: Some(Box::new(EngineEndpoints {
            kind: kind.into(),
            events: vec!["tcp://127.0.0.1:1".into()],
            ..Default::default()
        })),
        ..Instance::fixture(id.parse().unwrap(), Role::Engine)
    };
    reg.register(engine("vllm-1", "vllm")).await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        super::operations::http_get(&fe_http, "/readyz").await,
        not_ready,
        "a vLLM engine, and this frontend does not drive vLLM"
    );
    reg.register(engine("sglang-1", "sglang")).await.unwrap();
    super::operations::wait_ready(&fe_http, Duration::from_secs(10)).await;
    tasks.shutdown().await;
}

/// Found in review (the Helm chart): a frontend's `/livez` was only on its public listener,
/// bound after the wait for a scheduler (a startup probe killed a frontend waiting out a
/// scheduler outage), served over the public API's TLS (plain-HTTP probes failed) and behind
/// its connection limit. `--ops-listen` is up from the start: alive, and not ready until
/// a scheduler is known; and then they are not on the public API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontends_ops_listener_answers_while_it_waits_for_a_scheduler() {
    use super::operations::http_get;
    let etcd = Server::etcd();
    let nats = Server::nats();
    let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let ops = format!("127.0.0.1:{}", super::ports::free_port());
    let args: Vec<String> = [
        &["frontend", "--engine", "mock", "--listen", "127.0.0.1:0"][..],
        &["--http-listen", "127.0.0.1:0", "--ops-listen", ops.as_str()],
        &d,
    ]
    .concat()
    .into_iter()
    .map(String::from)
    .collect();
    let starting = std::thread::spawn(move || {
        Handoff::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>())
    });
    let start = Instant::now();
    while tokio::net::TcpStream::connect(&ops).await.is_err() {
        assert!(start.elapsed() < Duration::from_secs(20), "no ops listener at {ops}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(http_get(&ops, "/livez").await, (200, "ok".to_owned()));
    let waiting = (503, "not ready: no scheduler replica known".to_owned());
    assert_eq!(http_get(&ops, "/readyz").await, waiting);
    assert!(!starting.is_finished(), "still waiting for a scheduler");
    let (_sched, _) = Handoff::spawn(&[&["scheduler", "--listen", "127.0.0.1:0"][..], &d].concat());
    let (_fe, line) = starting.join().unwrap();
    assert!(line.contains(&format!("ops http://{ops}")), "{line}");
    let no_prefill = (503, "not ready: no prefill instance registered".to_owned());
    assert_eq!(http_get(&ops, "/readyz").await, no_prefill);
    // Given a listener of their own, they are not on the public API, for clients to read.
    let public = addr_after(&line, "http://");
    for path in ["/metrics", "/readyz", "/livez"] {
        assert_eq!(http_get(&public, path).await.0, 404, "{path}");
    }
}
