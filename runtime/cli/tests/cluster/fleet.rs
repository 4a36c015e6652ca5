//! [`Fleet`]: a whole cluster on the network-namespace test bed (`netbed`), every role on a
//! host of its own, started with its host's address (`--advertise-host`, `--transfer-bind`):
//! etcd, NATS, two scheduler replicas, three mock prefills and two frontends.

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_proto::v1::{
    Evidence, GenerateRequest, InstanceStatus, ListInstancesRequest, SamplingParams, TokenIds,
};

use super::netbed::{Bed, Host};
use super::processes::addr_after;
use super::servers::{Handoff, Server};

const TOKEN: &str = "netbed-token";

/// Where each role lives on the bed.
pub(crate) const SCHEDULER: usize = 0;
/// Prefill `a`'s host.
pub(crate) const A: usize = 1;
/// Prefill `b`'s host.
pub(crate) const B: usize = 2;
/// The first frontend's host (the one [`Fleet::one`] asks).
pub(crate) const FRONTEND: usize = 3;
/// The second scheduler replica's host.
pub(crate) const SCHEDULER2: usize = 4;
/// Prefill `c`'s host.
pub(crate) const C: usize = 5;
/// The second frontend's host.
pub(crate) const FRONTEND2: usize = 6;
/// etcd's host.
pub(crate) const ETCD: usize = 7;
/// NATS's host.
pub(crate) const NATS: usize = 8;

fn bound(ip: &str) -> String {
    format!("{ip}:0")
}

/// A mock prefill `id` on host `h`, advertising `advertise` (discovery flags not included).
pub(crate) fn prefill_args<'a>(id: &'a str, h: &'a Host, advertise: &'a str) -> Vec<String> {
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

/// The fleet (see the module docs); prefills `a`, `b` and `c` hold leases of 2 s.
pub(crate) struct Fleet {
    _roles: Vec<Handoff>,
    /// The discovery flags every role runs with.
    pub(crate) discovery: Vec<String>,
    _servers: (Server, Server),
    sched: SchedulerClient<tonic::transport::Channel>,
    /// The second replica's.
    sched2: SchedulerClient<tonic::transport::Channel>,
    /// The first frontend's client.
    client: GenerateClient<tonic::transport::Channel>,
    /// The second frontend's.
    client2: GenerateClient<tonic::transport::Channel>,
    /// Last: the processes inside its namespaces stop first.
    pub(crate) bed: Bed,
}

impl Fleet {
    pub(crate) async fn start() -> Fleet {
        let bed = Bed::new(9);
        let h = bed.hosts.clone();
        let etcd = Server::etcd_in(&h[ETCD].ns, &h[ETCD].ip);
        let nats = Server::nats_in(&h[NATS].ns, &h[NATS].ip);
        let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str(), "--token", TOKEN];
        let scheduler = |h: &Host| {
            Handoff::spawn_in(
                &h.ns,
                &[&["scheduler", "--listen", &bound(&h.ip), "--advertise-host", &h.ip][..], &d]
                    .concat(),
            )
        };
        let (first, line) = scheduler(&h[SCHEDULER]);
        let sched_addr = addr_after(&line, "grpc://");
        let (second, line) = scheduler(&h[SCHEDULER2]);
        let sched2_addr = addr_after(&line, "grpc://");
        let mut roles = vec![first, second];
        for (host, id) in [(A, "a"), (B, "b"), (C, "c")] {
            let mut args = prefill_args(id, &h[host], &h[host].ip);
            args.extend(d.iter().map(|s| s.to_string()));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            roles.push(Handoff::spawn_in(&h[host].ns, &args).0);
        }
        let mut clients = Vec::new();
        for host in [&h[FRONTEND], &h[FRONTEND2]] {
            let (fe, line) = Handoff::spawn_in(
                &host.ns,
                &[
                    &["frontend", "--engine", "mock", "--listen", &bound(&host.ip)][..],
                    &["--http-listen", &bound(&host.ip), "--advertise-host", &host.ip],
                    &["--transfer-bind", &host.ip],
                    &d,
                ]
                .concat(),
            );
            let at = addr_after(&line, "grpc://");
            clients.push(GenerateClient::connect(format!("http://{at}")).await.unwrap());
            roles.push(fe);
        }
        let sched = SchedulerClient::connect(format!("http://{sched_addr}")).await.unwrap();
        let sched2 = SchedulerClient::connect(format!("http://{sched2_addr}")).await.unwrap();
        let (client2, client) = (clients.pop().unwrap(), clients.pop().unwrap());
        let fleet = Fleet {
            _roles: roles,
            discovery: d.iter().map(|s| s.to_string()).collect(),
            _servers: (etcd, nats),
            sched,
            sched2,
            client,
            client2,
            bed,
        };
        let start = Instant::now();
        while fleet.instances().await.iter().filter(|i| i.routable).count() < 3 {
            assert!(start.elapsed() < Duration::from_secs(20), "the prefills routable");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        fleet
    }

    /// The instances the first scheduler replica lists.
    pub(crate) async fn instances(&self) -> Vec<InstanceStatus> {
        list(&self.sched).await
    }

    /// The instances each replica lists (the first's, then the second's).
    pub(crate) async fn instances_on_both(&self) -> [Vec<InstanceStatus>; 2] {
        [list(&self.sched).await, list(&self.sched2).await]
    }

    /// One request of 40 tokens for 2 through the first frontend: its evidence and time to
    /// first token.
    pub(crate) async fn one(&self, seed: u32) -> Result<(Evidence, Duration), tonic::Status> {
        self.one_of(seed, 40).await
    }

    /// As [`Fleet::one`], through the second frontend.
    pub(crate) async fn one_via_second(
        &self,
        seed: u32,
    ) -> Result<(Evidence, Duration), tonic::Status> {
        generate(&self.client2, seed, 40).await
    }

    /// One request of `tokens` tokens for 2 through the first frontend: its evidence and
    /// time to first token.
    pub(crate) async fn one_of(
        &self,
        seed: u32,
        tokens: u32,
    ) -> Result<(Evidence, Duration), tonic::Status> {
        generate(&self.client, seed, tokens).await
    }
}

async fn list(sched: &SchedulerClient<tonic::transport::Channel>) -> Vec<InstanceStatus> {
    let ask = handoff_proto::auth::request(ListInstancesRequest {}, Some(TOKEN));
    sched.clone().list_instances(ask).await.unwrap().into_inner().instances
}

async fn generate(
    client: &GenerateClient<tonic::transport::Channel>,
    seed: u32,
    tokens: u32,
) -> Result<(Evidence, Duration), tonic::Status> {
    let ids = (0..tokens).map(|i| 2 + (seed * 31 + i) % 30_000).collect();
    let req = GenerateRequest {
        input: Some(handoff_proto::v1::generate_request::Input::TokenIds(TokenIds { ids })),
        sampling: Some(SamplingParams { max_tokens: 2, ..Default::default() }),
        deadline_ms: 10_000,
        ..Default::default()
    };
    let start = Instant::now();
    let mut s = client.clone().generate(req).await?.into_inner();
    let (mut evidence, mut ttft) = (None, None);
    while let Some(m) = s.message().await? {
        ttft.get_or_insert_with(|| start.elapsed());
        if let Some(handoff_proto::v1::generate_response::Event::Complete(done)) = m.event {
            evidence = done.evidence;
        }
    }
    Ok((evidence.unwrap_or_default(), ttft.unwrap_or_default()))
}

/// The `p` quantile of `sorted`.
pub(crate) fn pct(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}
