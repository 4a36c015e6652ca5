//! A frontend killed with SIGKILL while its requests wait in a prefill's queue: it reports
//! none of their bookings, and the scheduler counted their load until the requests'
//! deadlines (a minute), refusing or steering away the other frontends' requests. Now its
//! registration's lease lapsing ends them: their load is gone within the lease's TTL and
//! the booking grace (10 s each).

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{GenerateRequest, ListInstancesRequest, SamplingParams, TokenIds};

use super::processes::{frontend, scheduler};
use super::servers::Server;

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
