//! Scenarios on the network-namespace test bed (`netbed`): every role on a host of its own,
//! started with its host's address (`--advertise-host`, `--transfer-bind`), etcd and NATS on
//! the machine's side of the bridge.

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use super::netbed::Bed;
use super::processes::addr_after;
use super::servers::{Handoff, Server};

const TOKEN: &str = "netbed-token";

fn bound(ip: &str) -> String {
    format!("{ip}:0")
}

/// A frontend cut off from one prefill that the scheduler still hears: every request is
/// served, the attempts on the unreachable prefill fail fast and are retried on the other, and
/// that prefill's circuit breaker opens (the other's stays closed), after which no request
/// tries it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_cut_off_from_one_prefill_routes_around_it() {
    let bed = Bed::new(4);
    let (sched_h, a_h, b_h, fe_h) = (&bed.hosts[0], &bed.hosts[1], &bed.hosts[2], &bed.hosts[3]);
    let etcd = Server::etcd_on(&bed.gateway);
    let nats = Server::nats_on(&bed.gateway);
    let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str(), "--token", TOKEN];
    let (_sched, line) = Handoff::spawn_in(
        &sched_h.ns,
        &[&["scheduler", "--listen", &bound(&sched_h.ip), "--advertise-host", &sched_h.ip][..], &d]
            .concat(),
    );
    let sched_addr = addr_after(&line, "grpc://");
    let prefill = |h: &super::netbed::Host, id: &str| {
        Handoff::spawn_in(
            &h.ns,
            &[
                &["prefill", "--engine", "mock", "--id", id][..],
                &["--bootstrap-listen", &bound(&h.ip), "--grpc-listen", &bound(&h.ip)],
                &["--advertise-host", &h.ip, "--transfer-bind", &h.ip],
                &d,
            ]
            .concat(),
        )
        .0
    };
    let (_a, _b) = (prefill(a_h, "a"), prefill(b_h, "b"));
    let (_fe, line) = Handoff::spawn_in(
        &fe_h.ns,
        &[
            &["frontend", "--engine", "mock", "--listen", &bound(&fe_h.ip)][..],
            &["--http-listen", &bound(&fe_h.ip), "--advertise-host", &fe_h.ip],
            &["--transfer-bind", &fe_h.ip],
            &d,
        ]
        .concat(),
    );
    let fe_addr = addr_after(&line, "grpc://");
    let sched = SchedulerClient::connect(format!("http://{sched_addr}")).await.unwrap();
    let list = |mut s: SchedulerClient<tonic::transport::Channel>| async move {
        let ask = handoff_proto::auth::request(ListInstancesRequest {}, Some(TOKEN));
        s.list_instances(ask).await.unwrap().into_inner().instances
    };
    let start = Instant::now();
    while list(sched.clone()).await.iter().filter(|i| i.routable).count() < 2 {
        assert!(start.elapsed() < Duration::from_secs(20), "both prefills routable");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = GenerateClient::connect(format!("http://{fe_addr}")).await.unwrap();
    let one = |seed: u32| {
        let ids = (0..40).map(|i| 2 + (seed * 31 + i) % 30_000).collect();
        let req = GenerateRequest {
            input: Some(handoff_proto::v1::generate_request::Input::TokenIds(TokenIds { ids })),
            sampling: Some(SamplingParams { max_tokens: 2, ..Default::default() }),
            deadline_ms: 10_000,
            ..Default::default()
        };
        let mut c = client.clone();
        async move {
            let mut s = c.generate(req).await?.into_inner();
            let mut evidence = None;
            while let Some(m) = s.message().await? {
                if let Some(handoff_proto::v1::generate_response::Event::Complete(done)) = m.event {
                    evidence = done.evidence;
                }
            }
            Ok::<_, tonic::Status>(evidence.unwrap_or_default())
        }
    };
    // Both serve while the network is whole.
    for seed in 0..6 {
        let ev = one(seed).await.unwrap();
        assert!(ev.failed_attempts.is_empty(), "{ev:?}");
    }

    bed.cut(3, &a_h.ip);
    let cut = Instant::now();
    let (mut failed_on_a, mut last_failure) = (0, None);
    for seed in 100..140 {
        let ev = one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        assert_eq!(ev.instance_id, "b", "served by the reachable prefill");
        for a in &ev.failed_attempts {
            assert_eq!(a.instance_id, "a", "{a:?}");
            failed_on_a += 1;
            last_failure = Some(cut.elapsed());
        }
    }
    let instances = list(sched.clone()).await;
    let breaker = |id: &str| instances.iter().find(|i| i.instance_id == id).unwrap().breaker_closed;
    eprintln!(
        "cut: 40 requests, 0 failed; {failed_on_a} attempts on the cut-off prefill, the last {last_failure:?} after the cut; breakers a closed={} b closed={}",
        breaker("a"),
        breaker("b")
    );
    assert!(failed_on_a > 0, "some request first tried the cut-off prefill");
    assert!(!breaker("a") && breaker("b"), "a's breaker opened, b's did not");
    // The scheduler still hears a: it stays registered and heartbeating, just not chosen.
    assert!(instances.iter().any(|i| i.instance_id == "a" && i.routable));
}
