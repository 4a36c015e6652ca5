//! Separate `handoff` processes finding each other through etcd and NATS, with no other
//! address flag; a prefill, or one of two scheduler replicas, killed with SIGKILL under load;
//! a frontend running its own scheduler replica, with no scheduler process.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use super::servers::{Handoff, Server};

pub(crate) fn addr_after(line: &str, scheme: &str) -> String {
    let at = line.find(scheme).unwrap_or_else(|| panic!("{scheme} in {line:?}")) + scheme.len();
    // Up to the next space, or the comma before it.
    line[at..].split_whitespace().next().unwrap().trim_end_matches(',').to_owned()
}

fn prefill(etcd: &Server, nats: &Server, id: &str) -> Handoff {
    super::servers::prefill(etcd, nats, id, &["--tp", "2"])
}

pub(crate) async fn one(
    client: &mut GenerateClient<tonic::transport::Channel>,
    seed: u32,
) -> Result<String, tonic::Status> {
    let ids = (0..40).map(|i| 2 + (seed * 31 + i) % 30_000).collect();
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids })),
        sampling: Some(SamplingParams { max_tokens: 4, ..Default::default() }),
        deadline_ms: 10_000,
        ..Default::default()
    };
    let mut s = client.generate(req).await?.into_inner();
    let mut instance = String::new();
    while let Some(m) = s.message().await? {
        if let Some(handoff_proto::v1::generate_response::Event::Complete(c)) = m.event {
            instance = c.evidence.unwrap_or_default().instance_id;
        }
    }
    Ok(instance)
}

/// A frontend process (mock engine) on etcd and NATS, and its gRPC address.
pub(crate) fn frontend(etcd: &Server, nats: &Server) -> (Handoff, String) {
    let (fe, line) = Handoff::spawn(&[
        "frontend",
        "--engine",
        "mock",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ]);
    (fe, addr_after(&line, "grpc://"))
}

/// etcd, NATS, schedulers, two prefills and a frontend, as separate processes.
struct Fleet {
    etcd: Server,
    nats: Server,
    victim: Handoff,
    /// The second scheduler replica, when there are two.
    second_scheduler: Option<Handoff>,
    _others: Vec<Handoff>,
    sched: SchedulerClient<tonic::transport::Channel>,
    client: GenerateClient<tonic::transport::Channel>,
}

/// A scheduler process on etcd and NATS, and its gRPC address.
pub(crate) fn scheduler(etcd: &Server, nats: &Server) -> (Handoff, String) {
    let (p, line) = Handoff::spawn(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ]);
    (p, addr_after(&line, "grpc://"))
}

impl Fleet {
    async fn start() -> Fleet {
        Self::start_with(1).await
    }

    async fn start_with(schedulers: usize) -> Fleet {
        let etcd = Server::etcd();
        let nats = Server::nats();
        let (sched_p, sched_addr) = scheduler(&etcd, &nats);
        let second_scheduler = (schedulers > 1).then(|| scheduler(&etcd, &nats).0);
        let victim = prefill(&etcd, &nats, "victim");
        let survivor = prefill(&etcd, &nats, "survivor");
        let (fe, fe_addr) = frontend(&etcd, &nats);
        let sched = SchedulerClient::connect(format!("http://{sched_addr}")).await.unwrap();
        let client = GenerateClient::connect(format!("http://{fe_addr}")).await.unwrap();
        let fleet = Fleet {
            etcd,
            nats,
            victim,
            second_scheduler,
            _others: vec![sched_p, survivor, fe],
            sched,
            client,
        };
        fleet.wait_routable(2, Duration::from_secs(20)).await;
        fleet
    }

    async fn routable(&self) -> Vec<String> {
        let all = self
            .sched
            .clone()
            .list_instances(ListInstancesRequest {})
            .await
            .unwrap()
            .into_inner()
            .instances;
        all.into_iter().filter(|i| i.routable).map(|i| i.instance_id).collect()
    }

    async fn wait_routable(&self, n: usize, within: Duration) {
        let start = Instant::now();
        while self.routable().await.len() < n {
            assert!(start.elapsed() < within, "{n} prefills routable within {within:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Four clients sending requests back to back until stopped.
struct Load {
    stop: Arc<AtomicBool>,
    ok: Arc<AtomicUsize>,
    failed: Arc<AtomicUsize>,
    /// Each answered request: when it started, and how long it took.
    took: Arc<std::sync::Mutex<Vec<(Instant, Duration)>>>,
    workers: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(client: &GenerateClient<tonic::transport::Channel>) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let took = Arc::new(std::sync::Mutex::new(Vec::new()));
        let workers = (0..4u32)
            .map(|w| {
                let (stop, ok, failed, took, mut c) =
                    (stop.clone(), ok.clone(), failed.clone(), took.clone(), client.clone());
                tokio::spawn(async move {
                    let mut i = 0;
                    while !stop.load(Ordering::Relaxed) {
                        let started = Instant::now();
                        match one(&mut c, 1000 + w * 100_000 + i).await {
                            Ok(_) => {
                                took.lock().unwrap().push((started, started.elapsed()));
                                ok.fetch_add(1, Ordering::Relaxed)
                            }
                            Err(e) => {
                                eprintln!("lost: {e}");
                                failed.fetch_add(1, Ordering::Relaxed)
                            }
                        };
                        i += 1;
                    }
                })
            })
            .collect();
        Load { stop, ok, failed, took, workers }
    }

    /// Median and longest latency of the requests started within `[from, to)`, and how many.
    fn latency(&self, from: Instant, to: Instant) -> (Duration, Duration, usize) {
        let mut t: Vec<Duration> = self
            .took
            .lock()
            .unwrap()
            .iter()
            .filter(|(s, _)| *s >= from && *s < to)
            .map(|(_, d)| *d)
            .collect();
        t.sort();
        let n = t.len();
        (t.get(n / 2).copied().unwrap_or_default(), t.last().copied().unwrap_or_default(), n)
    }

    /// Stops and returns (ok, failed).
    async fn finish(self) -> (usize, usize) {
        self.stop.store(true, Ordering::Relaxed);
        for w in self.workers {
            w.await.unwrap();
        }
        (self.ok.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_find_each_other_and_a_killed_prefill_leaves_routing_without_losing_requests() {
    let mut f = Fleet::start().await;
    let mut served = std::collections::HashSet::new();
    for seed in 0..20 {
        served.insert(one(&mut f.client.clone(), seed).await.expect("requests flow"));
    }
    assert_eq!(served.len(), 2, "both prefills serve: {served:?}");

    let load = Load::start(&f.client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    f.victim.kill9();
    while f.routable().await.contains(&"victim".to_owned()) {
        assert!(killed.elapsed() < Duration::from_secs(10), "victim still routable");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let out_after = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (ok, failed) = load.finish().await;
    eprintln!("out of routing {out_after:?} after kill -9; {ok} ok, {failed} failed");
    assert!(out_after <= Duration::from_millis(3500), "out of routing after {out_after:?}");
    assert_eq!(failed, 0, "no request lost");
    assert!(ok > 10);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_and_nats_restarts_under_load_lose_no_request() {
    let mut f = Fleet::start().await;
    let load = Load::start(&f.client);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // etcd away for 3 s: registrations and watches ride it out.
    f.etcd.stop();
    tokio::time::sleep(Duration::from_secs(3)).await;
    f.etcd.start();
    // NATS away for 30 s, ten times the 3 s liveness timeout: silence from every instance
    // at once is the bus, so nobody is taken out of routing, and no prefill waits on a
    // publish (KV events and heartbeats leave through a bounded queue with a timeout).
    let steady = Instant::now();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let away = Instant::now();
    f.nats.stop();
    tokio::time::sleep(Duration::from_secs(30)).await;
    assert_eq!(f.routable().await.len(), 2, "routing goes on with the last known state");
    let back = Instant::now();
    f.nats.start();
    let (before_p50, before_max, before_n) = load.latency(steady, away);
    let (during_p50, during_max, during_n) = load.latency(away, back);
    eprintln!(
        "request latency before NATS stopped: p50 {before_p50:?} max {before_max:?} ({before_n}); \
         during its 30 s away: p50 {during_p50:?} max {during_max:?} ({during_n})"
    );
    assert!(during_n > 10, "requests flowed while NATS was away");
    // Generous: what it replaces is a request hung for the whole outage.
    assert!(
        during_max < Duration::from_secs(5),
        "a request took {during_max:?} while NATS was away"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    f.wait_routable(2, Duration::from_secs(10)).await;
    let (ok, failed) = load.finish().await;
    eprintln!("etcd and NATS restarts: {ok} ok, {failed} failed");
    assert_eq!(failed, 0, "no request lost");
    assert!(ok > 50);
    // Requests keep flowing, to both instances. (An instance whose NATS client reconnects
    // later than the other's is briefly out of routing, and back at its next heartbeat.)
    let mut served = std::collections::HashSet::new();
    let since = Instant::now();
    for seed in 0.. {
        served.insert(one(&mut f.client.clone(), 5_000_000 + seed).await.expect("requests flow"));
        if served.len() == 2 {
            break;
        }
        assert!(since.elapsed() < Duration::from_secs(15), "only {served:?} served");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_prefill_without_failing_a_request() {
    let mut f = Fleet::start().await;
    let load = Load::start(&f.client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = f.victim.child.id().to_string();
    let status = std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(status.success());
    let start = Instant::now();
    while f.routable().await.contains(&"victim".to_owned()) {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "a draining prefill leaves routing at once"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let exited = tokio::task::spawn_blocking(move || f.victim.child.wait()).await.unwrap().unwrap();
    assert!(exited.success(), "drained and exited cleanly: {exited:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (ok, failed) = load.finish().await;
    eprintln!("drain: out of routing in {:?}; {ok} ok, {failed} failed", start.elapsed());
    assert_eq!(failed, 0, "no request failed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_scheduler_replica_costs_no_request() {
    let f = Fleet::start_with(2).await;
    // The frontend follows both replicas (each registered in etcd) and spreads over them.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let load = Load::start(&f.client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = load.ok.load(Ordering::Relaxed);
    let killed = Instant::now();
    let mut second = f.second_scheduler.expect("two replicas");
    second.kill9();
    // Served again: the first request to complete after the kill.
    while load.ok.load(Ordering::Relaxed) <= before + 4 {
        assert!(killed.elapsed() < Duration::from_secs(10), "requests resume");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let resumed = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    // What routing around the dead replica cost: the slowest request in flight at the kill
    // or started within 2 s after, against the slowest before.
    let (p50, before_max, _) = load.latency(killed - Duration::from_millis(400), killed);
    let (_, around_max, _) =
        load.latency(killed - Duration::from_millis(50), killed + Duration::from_secs(2));
    let (ok, failed) = load.finish().await;
    eprintln!(
        "scheduler replica killed: 4 requests served {resumed:?} after; slowest request around \
         the kill {around_max:?} (before: p50 {p50:?}, max {before_max:?}); {ok} ok, {failed} failed"
    );
    assert_eq!(failed, 0, "no request lost");
    assert!(ok > before + 20, "requests kept flowing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_scheduler_replica_costs_a_select_timeout_not_a_request() {
    let f = Fleet::start_with(2).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let load = Load::start(&f.client);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let second = f.second_scheduler.as_ref().expect("two replicas");
    let pid = second.child.id().to_string();
    let signal = |sig: &str| {
        let status = std::process::Command::new("kill").args([sig, &pid]).status().unwrap();
        assert!(status.success(), "kill {sig}");
    };
    // SIGSTOP: a hung process, not a dead one: its connections stay open and answer nothing.
    let stopped = Instant::now();
    signal("-STOP");
    tokio::time::sleep(Duration::from_secs(4)).await;
    signal("-CONT");
    let (p50, before_max, _) = load.latency(stopped - Duration::from_millis(400), stopped);
    let (_, hung_max, n) =
        load.latency(stopped - Duration::from_millis(50), stopped + Duration::from_secs(4));
    let (ok, failed) = load.finish().await;
    eprintln!(
        "scheduler replica hung 4 s: slowest request meanwhile {hung_max:?} of {n} (before: p50 \
         {p50:?}, max {before_max:?}); {ok} ok, {failed} failed"
    );
    assert_eq!(failed, 0, "no request lost");
    assert!(n > 20, "requests kept flowing while a replica hung");
}

/// `handoff frontend --scheduler-in-frontend`, and no scheduler process: the frontend's own
/// replica knows the prefills through etcd before the frontend is announced, routes by
/// their KV events over NATS, serves its metrics (not the process's traffic, which the
/// frontend's own `/metrics` serves) and readiness, and its gRPC API for `handoff ctl`, with
/// the cluster's token, while staying out of discovery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_running_its_own_scheduler_needs_no_scheduler_process() {
    use super::operations::{http_get, spawn_frontend, wait_ready, wait_routable};
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let prefill = |id| super::servers::prefill(&etcd, &nats, id, &["--tp", "2", "--token", "t"]);
    let _prefills = [prefill("a"), prefill("b")];
    let (_fe, line) = spawn_frontend(&[
        "--token",
        "t",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
        "--scheduler-in-frontend",
        "--scheduler-ops-listen",
        "127.0.0.1:0",
        "--scheduler-listen",
        "127.0.0.1:0",
    ]);
    assert!(line.contains("scheduler in-process"), "{line}");
    let ops = addr_after(&line, "ops http://");
    let its_grpc = addr_after(&line, "its grpc://");
    // Announced only once its replica knows the prefills registered before it started.
    let known: f64 = http_get(&ops, "/metrics")
        .await
        .1
        .lines()
        .filter_map(|l| {
            l.strip_prefix("handoff_scheduler_instances{")?.rsplit(' ').next()?.parse::<f64>().ok()
        })
        .sum();
    assert_eq!(known, 2.0, "both prefills known when the frontend is announced");
    wait_routable(&ops, 2).await;
    wait_ready(&ops, Duration::from_secs(10)).await;
    let url = format!("http://{}", addr_after(&line, "grpc://"));
    let mut client = GenerateClient::connect(url).await.unwrap();
    let first = one(&mut client, 7).await.unwrap();
    let start = Instant::now();
    let cached = |scrape: &str| {
        scrape.lines().any(|l| {
            l.strip_prefix("handoff_scheduler_instance_cached_blocks{")
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .is_some_and(|v| v > 0.0)
        })
    };
    let scrape = http_get(&ops, "/metrics").await.1;
    assert!(!scrape.contains("handoff_served_requests_total"), "traffic is the frontend's");
    while !cached(&http_get(&ops, "/metrics").await.1) {
        assert!(start.elapsed() < Duration::from_secs(10), "its KV events reach the frontend");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    for _ in 0..5 {
        assert_eq!(one(&mut client, 7).await.unwrap(), first, "the prompt goes where its KV is");
    }
    // `handoff ctl` reaches the replica at the address given, and finds none registered.
    let ctl = |args: &[&str]| super::operations::run_ctl(&etcd, &nats, args);
    let (ok, listed, err) = ctl(&["--token", "t", "--scheduler", &its_grpc, "instances"]);
    assert!(ok, "{err}");
    assert!(listed.contains(&format!("as seen by scheduler {its_grpc}")), "{listed}");
    let mut ids: Vec<&str> = listed
        .lines()
        .filter(|l| l.starts_with("prefill"))
        .filter_map(|l| l.split_whitespace().nth(1))
        .collect();
    ids.sort();
    assert_eq!(ids, ["a", "b"], "{listed}");
    let (ok, _, err) = ctl(&["--scheduler", &its_grpc, "instances"]);
    assert!(!ok && err.to_lowercase().contains("token"), "without the token: {err}");
    let (ok, _, err) = ctl(&["--token", "t", "instances"]);
    assert!(!ok && err.contains("--scheduler-listen"), "{err}");
}
