//! Separate `handoff` processes finding each other through etcd and NATS, with no other
//! address flag; a prefill killed with SIGKILL under load.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use super::servers::{Handoff, Server};

fn addr_after(line: &str, scheme: &str) -> String {
    let at = line.find(scheme).unwrap_or_else(|| panic!("{scheme} in {line:?}")) + scheme.len();
    line[at..].split_whitespace().next().unwrap().to_owned()
}

fn prefill(etcd: &Server, nats: &Server, id: &str) -> Handoff {
    Handoff::spawn(&[
        "prefill",
        "--engine",
        "mock",
        "--id",
        id,
        "--tp",
        "2",
        "--bootstrap-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ])
    .0
}

async fn one(
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn processes_find_each_other_and_a_killed_prefill_leaves_routing_without_losing_requests() {
    let etcd = Server::etcd();
    let nats = Server::nats();
    let (_sched, line) = Handoff::spawn(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ]);
    let sched_addr = addr_after(&line, "grpc://");
    let mut victim = prefill(&etcd, &nats, "victim");
    let _survivor = prefill(&etcd, &nats, "survivor");
    let (_fe, line) = Handoff::spawn(&[
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
    let fe_addr = addr_after(&line, "grpc://");
    let mut sched = SchedulerClient::connect(format!("http://{sched_addr}")).await.unwrap();
    let routable = |sched: &mut SchedulerClient<tonic::transport::Channel>| {
        let mut s = sched.clone();
        async move {
            let all =
                s.list_instances(ListInstancesRequest {}).await.unwrap().into_inner().instances;
            all.into_iter().filter(|i| i.routable).map(|i| i.instance_id).collect::<Vec<_>>()
        }
    };
    let start = Instant::now();
    while routable(&mut sched).await.len() < 2 {
        assert!(start.elapsed() < Duration::from_secs(20), "both prefills routable");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let client = GenerateClient::connect(format!("http://{fe_addr}")).await.unwrap();
    let mut served = std::collections::HashSet::new();
    for seed in 0..20 {
        served.insert(one(&mut client.clone(), seed).await.expect("requests flow"));
    }
    assert_eq!(served.len(), 2, "both prefills serve: {served:?}");

    // Steady load, then kill -9 one prefill.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let mut load = Vec::new();
    for w in 0..4u32 {
        let (stop, ok, failed, mut c) = (stop.clone(), ok.clone(), failed.clone(), client.clone());
        load.push(tokio::spawn(async move {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                match one(&mut c, 1000 + w * 10_000 + i).await {
                    Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                    Err(e) => {
                        eprintln!("lost: {e}");
                        failed.fetch_add(1, Ordering::Relaxed)
                    }
                };
                i += 1;
            }
        }));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let killed = Instant::now();
    victim.kill9();
    while routable(&mut sched).await.contains(&"victim".to_owned()) {
        assert!(killed.elapsed() < Duration::from_secs(10), "victim still routable");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let out_after = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Relaxed);
    for l in load {
        l.await.unwrap();
    }
    eprintln!(
        "out of routing {out_after:?} after kill -9; {} ok, {} failed",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed)
    );
    assert!(out_after <= Duration::from_millis(3500), "out of routing after {out_after:?}");
    assert_eq!(failed.load(Ordering::Relaxed), 0, "no request lost");
    assert!(ok.load(Ordering::Relaxed) > 10);
}
