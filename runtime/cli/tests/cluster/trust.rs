//! Certificates and trust changing under running processes: a CA taken out of a bundle cuts
//! the connections already up to or from holders of its certificates, not only new ones; a
//! renewed NATS client certificate is shown once NATS's client has connected with it.

use std::time::Duration;

use handoff_core::tls::ClusterTls;
use handoff_core::tls::test_certs::TestCa;
use handoff_proto::v1::ListInstancesRequest;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use tonic::transport::Channel;

use super::servers::{PemFiles, Server};
use super::tls::reloading_scheduler;
use handoff_discovery::{NatsBus, ServerAccess};

fn channel(addr: &str, tls: &ClusterTls) -> SchedulerClient<Channel> {
    let ch = handoff_proto::grpc::cluster_channel(addr, Some(tls), Duration::from_secs(2));
    SchedulerClient::new(ch.unwrap())
}

async fn listed(c: &mut SchedulerClient<Channel>) -> Result<(), tonic::Status> {
    let ask = handoff_proto::auth::request(ListInstancesRequest {}, Some("cluster-secret"));
    c.list_instances(ask).await.map(drop)
}

/// Whether a call on `c` comes to fail within 20 s (one every 100 ms).
async fn comes_to_fail(c: &mut SchedulerClient<Channel>) -> bool {
    for _ in 0..200 {
        if listed(c).await.is_err() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

/// A scheduler process's bundle loses a CA (read again every second): a client of that CA
/// whose channel was up is cut and refused from then on, while a client of the CA kept goes
/// on. And a client whose own bundle loses the scheduler's CA stops calling it on the
/// channel it had.
#[tokio::test]
async fn a_ca_taken_out_cuts_the_connections_it_trusted() {
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let scheduler_cert = kept.issue();
    let member = PemFiles::write(&scheduler_cert);
    member.reissue(&scheduler_cert, &both);
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let (_s, addr, _ops) = reloading_scheduler(&member, &etcd, &nats);

    let mut stays = channel(&addr, &kept.issue().trusting(&both));
    let mut goes = channel(&addr, &removed.issue().trusting(&both));
    // A client that reads its own files: it trusts both CAs, then the removed one alone.
    let own = kept.issue();
    let client_files = PemFiles::write(&own);
    client_files.reissue(&own, &both);
    let fickle_tls =
        ClusterTls::from_files(&client_files.cert, &client_files.key, &client_files.ca).unwrap();
    let mut fickle = channel(&addr, &fickle_tls);
    for c in [&mut stays, &mut goes, &mut fickle] {
        listed(c).await.expect("served before the change");
    }

    member.reissue(&scheduler_cert, kept.pem());
    assert!(comes_to_fail(&mut goes).await, "a client of the CA taken out is cut");
    assert!(listed(&mut goes).await.is_err(), "and refused from then on");
    listed(&mut stays).await.expect("a client of the CA kept goes on");

    client_files.reissue(&own, removed.pem());
    let taken = fickle_tls.reload(std::time::SystemTime::now()).unwrap();
    assert_eq!(taken, handoff_core::tls::Reloaded::Taken);
    let cut = listed(&mut fickle).await.expect_err("not called over the connection it had");
    // A transport's failure, as a frontend takes it: the replica passed over.
    assert!(matches!(cut.code(), tonic::Code::Unknown | tonic::Code::Unavailable), "{cut:?}");
    assert!(listed(&mut fickle).await.is_err(), "nor over a new one");
}

/// The NATS client certificate's end, as the process's metrics show it.
fn nats_client_end() -> Option<String> {
    let shown = handoff_core::tls::expiry::expiry_registry().render();
    let line = shown.lines().find(|l| l.contains("certificate=\"nats_client\""))?;
    Some(line.rsplit(' ').next()?.to_owned())
}

/// NATS's client reads its certificate files at each connect: a renewed certificate's end is
/// shown once the client has connected again (here, after its server restarted).
#[tokio::test]
async fn a_renewed_nats_client_certificate_is_shown_at_the_next_connect() {
    let ca = TestCa::new();
    let server = PemFiles::write(&ca.issue());
    let client = PemFiles::write(&ca.issue());
    let mut nats = Server::nats_tls(&server, "handoff", "s3cret");
    let user = Some(("handoff".to_owned(), "s3cret".to_owned()));
    let bus =
        NatsBus::connect_with(&nats.url, &ServerAccess { user, ..client.access() }).await.unwrap();
    // rcgen's default end: 4096-01-01.
    assert_eq!(nats_client_end().as_deref(), Some("67090118400"));

    client.reissue(&ca.issue_valid_until((3005, 1, 1)), ca.pem());
    nats.stop();
    nats.start();
    let mut shown = None;
    for _ in 0..200 {
        shown = nats_client_end();
        if shown.as_deref() == Some("32661446400") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(shown.as_deref(), Some("32661446400"), "the renewed certificate's end (3005)");
    use handoff_discovery::EventBus;
    assert!(bus.connected(), "connected with it");
}
