//! Scenarios on the network-namespace test bed (`netbed`): every role on a host of its own,
//! started with its host's address (`--advertise-host`, `--transfer-bind`), etcd and NATS on
//! the machine's side of the bridge.

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use handoff_proto::v1::Evidence;

use super::netbed::{Bed, Host};
use super::processes::addr_after;
use super::servers::{Handoff, Server};

const TOKEN: &str = "netbed-token";

fn bound(ip: &str) -> String {
    format!("{ip}:0")
}

/// A mock prefill `id` on host `h`, advertising `advertise` (discovery flags not included).
fn prefill_args<'a>(id: &'a str, h: &'a Host, advertise: &'a str) -> Vec<String> {
    let listen = bound(&h.ip);
    [
        "prefill",
        "--engine",
        "mock",
        "--id",
        id,
        "--bootstrap-listen",
        &listen,
        "--grpc-listen",
        &listen,
        "--advertise-host",
        advertise,
        "--transfer-bind",
        &h.ip,
        "--lease-ttl-secs",
        "2",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// A scheduler on host 0, prefills `a` and `b` on hosts 1 and 2 (leases of 2 s), a frontend
/// on host 3, and a second scheduler replica on host 4 when asked; etcd and NATS on the
/// machine, on addresses of their own.
struct Fleet {
    _roles: Vec<Handoff>,
    /// The discovery flags every role runs with.
    discovery: Vec<String>,
    _servers: (Server, Server),
    sched: SchedulerClient<tonic::transport::Channel>,
    client: GenerateClient<tonic::transport::Channel>,
    /// Last: the processes inside its namespaces stop first.
    bed: Bed,
}

impl Fleet {
    async fn start() -> Fleet {
        Self::start_with(1).await
    }

    async fn start_with(schedulers: usize) -> Fleet {
        let bed = Bed::new(3 + schedulers);
        let etcd = Server::etcd_on(&bed.gateway);
        let nats = Server::nats_on(&bed.gateway2);
        let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str(), "--token", TOKEN];
        let h = bed.hosts.clone();
        let scheduler = |h: &Host| {
            Handoff::spawn_in(
                &h.ns,
                &[&["scheduler", "--listen", &bound(&h.ip), "--advertise-host", &h.ip][..], &d]
                    .concat(),
            )
        };
        let (first, line) = scheduler(&h[0]);
        let sched_addr = addr_after(&line, "grpc://");
        let mut roles = vec![first];
        roles.extend(h.iter().skip(4).map(|h| scheduler(h).0));
        let prefill = |h: &Host, id: &str| {
            let mut args = prefill_args(id, h, &h.ip);
            args.extend(d.iter().map(|s| s.to_string()));
            Handoff::spawn_in(&h.ns, &args.iter().map(String::as_str).collect::<Vec<_>>()).0
        };
        let (a, b) = (prefill(&h[1], "a"), prefill(&h[2], "b"));
        let (fe, line) = Handoff::spawn_in(
            &h[3].ns,
            &[
                &["frontend", "--engine", "mock", "--listen", &bound(&h[3].ip)][..],
                &["--http-listen", &bound(&h[3].ip), "--advertise-host", &h[3].ip],
                &["--transfer-bind", &h[3].ip],
                &d,
            ]
            .concat(),
        );
        let fe_addr = addr_after(&line, "grpc://");
        let sched = SchedulerClient::connect(format!("http://{sched_addr}")).await.unwrap();
        let client = GenerateClient::connect(format!("http://{fe_addr}")).await.unwrap();
        roles.extend([a, b, fe]);
        let fleet = Fleet {
            _roles: roles,
            discovery: d.iter().map(|s| s.to_string()).collect(),
            _servers: (etcd, nats),
            sched,
            client,
            bed,
        };
        let start = Instant::now();
        while fleet.instances().await.iter().filter(|i| i.routable).count() < 2 {
            assert!(start.elapsed() < Duration::from_secs(20), "both prefills routable");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        fleet
    }

    async fn instances(&self) -> Vec<handoff_proto::v1::InstanceStatus> {
        let ask = handoff_proto::auth::request(ListInstancesRequest {}, Some(TOKEN));
        self.sched.clone().list_instances(ask).await.unwrap().into_inner().instances
    }

    /// One request of 40 tokens for 2: its evidence and time to first token.
    async fn one(&self, seed: u32) -> Result<(Evidence, Duration), tonic::Status> {
        self.one_of(seed, 40).await
    }

    /// One request of `tokens` tokens for 2: its evidence and time to first token.
    async fn one_of(&self, seed: u32, tokens: u32) -> Result<(Evidence, Duration), tonic::Status> {
        let ids = (0..tokens).map(|i| 2 + (seed * 31 + i) % 30_000).collect();
        let req = GenerateRequest {
            input: Some(handoff_proto::v1::generate_request::Input::TokenIds(TokenIds { ids })),
            sampling: Some(SamplingParams { max_tokens: 2, ..Default::default() }),
            deadline_ms: 10_000,
            ..Default::default()
        };
        let start = Instant::now();
        let mut s = self.client.clone().generate(req).await?.into_inner();
        let (mut evidence, mut ttft) = (None, None);
        while let Some(m) = s.message().await? {
            ttft.get_or_insert_with(|| start.elapsed());
            if let Some(handoff_proto::v1::generate_response::Event::Complete(done)) = m.event {
                evidence = done.evidence;
            }
        }
        Ok((evidence.unwrap_or_default(), ttft.unwrap_or_default()))
    }
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// A frontend cut off from one prefill that the scheduler still hears: every request is
/// served, the attempts on the unreachable prefill fail fast and are retried on the other, and
/// that prefill's circuit breaker opens (the other's stays closed), after which no request
/// tries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_cut_off_from_one_prefill_routes_around_it() {
    let f = Fleet::start().await;
    let mut whole = Vec::new();
    for seed in 0..20 {
        let (ev, ttft) = f.one(seed).await.unwrap();
        assert!(ev.failed_attempts.is_empty(), "both serve while the network is whole: {ev:?}");
        whole.push(ttft);
    }
    let a_ip = f.bed.hosts[1].ip.clone();
    f.bed.cut(3, &a_ip);
    let cut = Instant::now();
    let (mut failed_on_a, mut last_failure, mut cut_ttft) = (0, None, Vec::new());
    for seed in 100..140 {
        let (ev, ttft) = f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        cut_ttft.push(ttft);
        assert_eq!(ev.instance_id, "b", "served by the reachable prefill");
        for a in &ev.failed_attempts {
            assert_eq!(a.instance_id, "a", "{a:?}");
            failed_on_a += 1;
            last_failure = Some(cut.elapsed());
        }
    }
    let instances = f.instances().await;
    let breaker = |id: &str| instances.iter().find(|i| i.instance_id == id).unwrap().breaker_closed;
    whole.sort();
    cut_ttft.sort();
    eprintln!(
        "cut: 40 requests, 0 failed; {failed_on_a} attempts on the cut-off prefill, the last {last_failure:?} after the cut; breakers a closed={} b closed={}; TTFT p50/p99 whole {:?}/{:?}, after the cut {:?}/{:?}",
        breaker("a"),
        breaker("b"),
        pct(&whole, 0.5),
        pct(&whole, 0.99),
        pct(&cut_ttft, 0.5),
        pct(&cut_ttft, 0.99)
    );
    assert!(failed_on_a > 0, "some request first tried the cut-off prefill");
    assert!(!breaker("a") && breaker("b"), "a's breaker opened, b's did not");
    // The scheduler still hears a: it stays registered and heartbeating, just not chosen.
    assert!(instances.iter().any(|i| i.instance_id == "a" && i.routable));
}

/// A prefill cut off from etcd only (NATS and its peers still reachable): its lease lapses and
/// it leaves routing; when the cut heals it registers again and is routed to again. No
/// request fails meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_cut_off_from_etcd_leaves_and_rejoins() {
    let f = Fleet::start().await;
    let listed =
        |all: &[handoff_proto::v1::InstanceStatus]| all.iter().any(|i| i.instance_id == "a");
    let etcd_ip = f.bed.gateway.clone();
    f.bed.cut(1, &etcd_ip);
    let cut = Instant::now();
    let mut seed = 0;
    while listed(&f.instances().await) {
        assert!(cut.elapsed() < Duration::from_secs(15), "a's lease lapses");
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        seed += 1;
    }
    let gone = cut.elapsed();
    for _ in 0..10 {
        let (ev, _) = f.one(seed).await.unwrap();
        assert_eq!(ev.instance_id, "b", "out of routing");
        seed += 1;
    }
    f.bed.heal(1, &etcd_ip);
    let healed = Instant::now();
    while !f.instances().await.iter().any(|i| i.instance_id == "a" && i.routable) {
        assert!(healed.elapsed() < Duration::from_secs(20), "a registers again");
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        seed += 1;
    }
    let back = healed.elapsed();
    // Routed to again: some request lands on a.
    let mut on_a = false;
    for _ in 0..40 {
        let (ev, _) = f.one(seed).await.unwrap();
        on_a |= ev.instance_id == "a";
        seed += 1;
    }
    eprintln!(
        "etcd cut: {seed} requests, 0 failed; out of routing {gone:?} after the cut, back {back:?} after the heal"
    );
    assert!(on_a, "a serves again");
}

/// One of two scheduler replicas cut off from NATS, not from the frontend: it hears no more
/// heartbeats, load or KV events, and keeps routing on what it last knew (silence from
/// everyone at once is taken for the bus, not the fleet), while the other replica routes on
/// fresh state. No request fails, through the liveness timeout and well beyond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_cut_off_from_nats_costs_no_request() {
    let f = Fleet::start_with(2).await;
    let nats_ip = f.bed.gateway2.clone();
    f.bed.cut(0, &nats_ip);
    let cut = Instant::now();
    let (mut sent, mut by) = (0u32, std::collections::HashMap::<String, u32>::new());
    while cut.elapsed() < Duration::from_secs(8) {
        let (ev, _) = f.one(sent).await.unwrap_or_else(|e| panic!("request {sent} failed: {e}"));
        *by.entry(ev.instance_id).or_default() += 1;
        sent += 1;
    }
    // The cut-off replica still answers, from the state it last knew.
    let listed = f.instances().await;
    eprintln!(
        "nats cut: {sent} requests over 8 s, 0 failed; served by {by:?}; the cut-off replica lists {} instances",
        listed.len()
    );
    assert_eq!(listed.len(), 2, "it still knows both prefills (etcd is reachable)");
    assert!(by.len() == 2, "both prefills keep serving: {by:?}");
}

/// A prefill that advertises another host's address (host 0's, where nothing serves its
/// ports) refuses to start: it dials its own directory at the advertised address first, and
/// says which address it could not reach. It never registers; the fleet serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_advertised_address_is_refused_at_startup() {
    let f = Fleet::start().await;
    let (h, wrong) = (&f.bed.hosts[1], f.bed.hosts[0].ip.clone());
    let args = [prefill_args("c", h, &wrong), f.discovery.clone()].concat();
    let started = Instant::now();
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", &h.ns, env!("CARGO_BIN_EXE_handoff")])
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It must exit by itself; one that starts is killed and fails the test (not hangs it).
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let refused = started.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.is_some_and(|s| !s.success()), "it does not start: {stderr}");
    assert!(
        stderr.contains(&format!("--advertise-host {wrong} is not an address of this host")),
        "warned first: {stderr}"
    );
    assert!(
        stderr.contains(&format!("directory {wrong}:")) && stderr.contains("unreachable"),
        "the error names the address it could not reach: {stderr}"
    );
    for seed in 0..10 {
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
    }
    let ids: Vec<String> = f.instances().await.into_iter().map(|i| i.instance_id).collect();
    eprintln!("wrong address: refused after {refused:?}; 10 requests, 0 failed; instances {ids:?}");
    assert_eq!(ids.len(), 2, "c never registered: {ids:?}");
}

/// A prefill whose link sends at most 100 Mbit/s, beside one on the full link, 1000-token
/// prompts (1 MB of the mock's KV each: 80 ms at 100 Mbit/s). Expectation stated: no request
/// fails; the requests the slow prefill serves pay about the KV's time on its link; once its
/// heartbeats carry the time its KV takes after the compute, `kv_aware` prices that like a
/// longer prompt and the big prompts go to the other prefill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_on_a_100_mbit_link_loses_the_big_prompts_once_measured() {
    let f = Fleet::start().await;
    let mut whole: Vec<Duration> = Vec::new();
    for seed in 0..10 {
        whole.push(f.one_of(seed, 1000).await.unwrap().1);
    }
    f.bed.limit(1, "100mbit");
    let limited = Instant::now();
    let (mut seed, mut slow, mut learning) = (100, Vec::new(), 0);
    // Until the scheduler has heard it: a's heartbeats report its KV's time after the compute
    // well above b's (an event waited for, not a span of time).
    let heard = |all: &[handoff_proto::v1::InstanceStatus]| {
        let send = |id: &str| all.iter().find(|i| i.instance_id == id).map(|i| i.send_ns_per_token);
        matches!((send("a"), send("b")), (Some(a), Some(b)) if a > 4 * b.max(1))
    };
    while !heard(&f.instances().await) {
        assert!(limited.elapsed() < Duration::from_secs(20), "a's slow link reported");
        let (ev, ttft) = f.one_of(seed, 1000).await.unwrap_or_else(|e| panic!("{seed}: {e}"));
        assert!(ev.failed_attempts.is_empty(), "slow is not failed: {ev:?}");
        if ev.instance_id == "a" {
            slow.push(ttft);
        }
        (seed, learning) = (seed + 1, learning + 1);
    }
    let learned = limited.elapsed();
    let mut after = Vec::new();
    for _ in 0..30 {
        let (ev, ttft) = f.one_of(seed, 1000).await.unwrap_or_else(|e| panic!("{seed}: {e}"));
        after.push((ev.instance_id, ttft));
        seed += 1;
    }
    whole.sort();
    slow.sort();
    let mut fast: Vec<Duration> = after.iter().map(|a| a.1).collect();
    fast.sort();
    let on_a = after.iter().filter(|a| a.0 == "a").count();
    eprintln!(
        "100 Mbit on a: {learning} requests of 1000 tokens while it was learned in {learned:?} ({} on a: TTFT p50 {:?}), then 30 with {on_a} on a: TTFT p50 {:?} p99 {:?}; 0 failed; before the limit p50 {:?} p99 {:?}",
        slow.len(),
        slow.get(slow.len() / 2),
        pct(&fast, 0.5),
        pct(&fast, 0.99),
        pct(&whole, 0.5),
        pct(&whole, 0.99)
    );
    // 1000 tokens x 1 KB of KV is 82 ms at 100 Mbit/s (less the bucket's 64 KB burst): a
    // floor set by the link, which no load on this machine can lower.
    assert!(slow.first().is_some_and(|t| *t >= Duration::from_millis(70)), "{slow:?}");
    assert_eq!(on_a, 0, "the big prompts go to the prefill on the full link");
}
