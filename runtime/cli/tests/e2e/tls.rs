//! A cluster with TLS everywhere: mutual TLS between its own processes (gRPC, bootstrap
//! directories, KV transfers) and a public certificate on the frontend's listeners. Requests
//! are served; a peer without a certificate from the cluster's CA reaches nothing.

use std::sync::Arc;
use std::time::Duration;

use handoff::ClusterConfig;
use handoff_bootstrap::DirectoryClient;
use handoff_core::tls::ClusterTls;
use handoff_core::tls::test_certs::{TestCa, TestCert};
use handoff_frontend::FrontendConfig;
use handoff_proto::auth;
use handoff_proto::grpc::cluster_channel;
use handoff_proto::v1::ListInstancesRequest;
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use handoff_transfer::TransferKind;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use super::support::*;

const TOKEN: &str = "cluster-secret";

fn secure(member: &TestCert, public: &TestCert) -> ClusterConfig {
    let tls = member.cluster();
    ClusterConfig {
        prefills: 2,
        token: Some(TOKEN.into()),
        tls: Some(tls.clone()),
        transfer: TransferKind::Tcp {
            bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise_ip: None,
            tls: Some(tls),
            // KV over the TLS sockets themselves, not the same-host shared memory.
            shared_memory: false,
        },
        frontend: FrontendConfig { public_tls: Some(public.server()), ..FrontendConfig::default() },
        ..ClusterConfig::ephemeral()
    }
}

async fn list(addr: &str, tls: Option<&ClusterTls>) -> Result<usize, tonic::Status> {
    let ch = cluster_channel(addr, tls, Duration::from_secs(2)).unwrap();
    let req = auth::request(ListInstancesRequest {}, Some(TOKEN));
    Ok(SchedulerClient::new(ch).list_instances(req).await?.into_inner().instances.len())
}

/// `GET /v1/models` over TLS trusting `ca`: the status line.
async fn https_models(port: u16, ca: &str) -> std::io::Result<String> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::pem::PemObject::pem_slice_iter(ca.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    let name = handoff_core::tls::server_name("127.0.0.1").unwrap();
    let mut s = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await?;
    s.write_all(b"GET /v1/models HTTP/1.1\r\nhost: h\r\nconnection: close\r\n\r\n").await?;
    let mut out = String::new();
    s.read_to_string(&mut out).await?;
    Ok(out.lines().next().unwrap_or_default().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_with_tls_everywhere_serves_and_refuses_strangers() {
    let (cluster_ca, public_ca) = (TestCa::new(), TestCa::new());
    let (member, public) = (cluster_ca.issue(), public_ca.issue());
    let c = cluster(secure(&member, &public)).await;

    // Public Generate over TLS, trusting the public CA only: served, KV over mutual TLS.
    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(public_ca.pem()));
    let ep = Endpoint::from_shared(format!("https://{}", c.frontend_addr)).unwrap();
    let mut cl = GenerateClient::new(ep.tls_config(tls).unwrap().connect().await.unwrap());
    for seed in 0..6 {
        let got = generate(&mut cl, &prompt(seed, 64), 4).await;
        assert!(got.is_ok(), "request {seed}: {got:?}");
    }
    // Plain gRPC to the public listener is not served.
    let plain = GenerateClient::connect(format!("http://{}", c.frontend_addr)).await;
    if let Ok(mut plain) = plain {
        assert!(generate(&mut plain, &prompt(1, 8), 1).await.is_err(), "plain Generate");
    }
    // The OpenAI API over HTTPS.
    let status = https_models(c.http_addr.port(), public_ca.pem()).await.unwrap();
    assert!(status.contains("200"), "{status}");

    // The scheduler: a member is answered. Refused: a plain client; a TLS client that trusts
    // the cluster's CA but shows no certificate, or one from another CA (the public one too:
    // a public certificate is no cluster membership).
    let addr = c.scheduler_addr.to_string();
    assert_eq!(list(&addr, Some(&member.cluster())).await.unwrap(), 2);
    assert!(list(&addr, None).await.is_err(), "plain client");
    let bare = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(cluster_ca.pem()));
    let ep = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(bare).unwrap();
    let req = auth::request(ListInstancesRequest {}, Some(TOKEN));
    let no_cert = match ep.connect().await {
        Ok(ch) => SchedulerClient::new(ch).list_instances(req).await.is_err(),
        Err(_) => true,
    };
    assert!(no_cert, "a TLS client without a certificate");
    let impostors = [TestCa::new().issue(), public.clone()].map(|c| c.trusting(cluster_ca.pem()));
    for (i, impostor) in impostors.iter().enumerate() {
        assert!(list(&addr, Some(impostor)).await.is_err(), "impostor {i} at the scheduler");
    }

    // The bootstrap directory: the same rule.
    let dir = &c.prefills[0].bootstrap_addr;
    let info = DirectoryClient::with_tls(None, Some(&member.cluster())).server_info(dir).await;
    assert!(info.is_ok(), "member reads the directory: {info:?}");
    assert!(DirectoryClient::new(None).server_info(dir).await.is_err(), "plain HTTP");
    for (i, impostor) in impostors.iter().enumerate() {
        let got = DirectoryClient::with_tls(None, Some(impostor)).server_info(dir).await;
        assert!(got.is_err(), "impostor {i} reads the directory");
    }

    // Still serving after the strangers.
    assert!(generate(&mut cl, &prompt(9, 64), 4).await.is_ok());
    c.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn public_listeners_can_require_client_certificates() {
    use handoff_core::tls::ServerTls;
    use tonic::transport::Identity;

    let (public_ca, clients_ca) = (TestCa::new(), TestCa::new());
    let cert = public_ca.issue();
    let public = ServerTls::from_pem(
        cert.cert.as_bytes(),
        cert.key.as_bytes(),
        Some(clients_ca.pem().as_bytes()),
    )
    .unwrap();
    let c = cluster(ClusterConfig {
        frontend: FrontendConfig { public_tls: Some(public), ..FrontendConfig::default() },
        ..ClusterConfig::ephemeral()
    })
    .await;
    let call = |identity: Option<TestCert>| {
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(public_ca.pem()));
        if let Some(id) = identity {
            tls = tls.identity(Identity::from_pem(id.cert, id.key));
        }
        let ep = Endpoint::from_shared(format!("https://{}", c.frontend_addr)).unwrap();
        let mut cl = GenerateClient::new(ep.tls_config(tls).unwrap().connect_lazy());
        async move { generate(&mut cl, &prompt(3, 32), 2).await }
    };
    assert!(call(Some(clients_ca.issue())).await.is_ok(), "a client with a certificate");
    assert!(call(None).await.is_err(), "a client without one");
    assert!(call(Some(TestCa::new().issue())).await.is_err(), "a client from another CA");
    c.tasks.shutdown().await;
}
