use std::io::ErrorKind;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;

use super::*;
use crate::tls::reload::tests::round_trip;
use crate::tls::test_certs::CertFiles;
use crate::tls::test_certs::TestCa;
use crate::tls::{ClusterTls, ListenerTls, Reloaded, TlsError, TlsListener, server_name};

/// Echoes 4 bytes at a time on each connection a [`TlsListener`] of the cluster's TLS hands
/// out (checked again after each reload: [`PeerRole::Client`]); how each connection's loop
/// ended is sent on the channel.
async fn echo_server(tls: ClusterTls) -> (u16, mpsc::UnboundedReceiver<ErrorKind>) {
    echo_over(ListenerTls::Cluster(tls)).await
}

async fn echo_over(tls: ListenerTls) -> (u16, mpsc::UnboundedReceiver<ErrorKind>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let mut l = TlsListener::new(l, tls);
    let (ended, ends) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        loop {
            let (mut s, _) = l.accept_tls().await;
            let ended = ended.clone();
            tokio::spawn(async move {
                let mut b = [0u8; 4];
                let end = loop {
                    if let Err(e) = s.read_exact(&mut b).await {
                        break e.kind();
                    }
                    if let Err(e) = s.write_all(&b).await {
                        break e.kind();
                    }
                };
                let _ = ended.send(end);
            });
        }
    });
    (port, ends)
}

async fn dial(
    tls: &ClusterTls,
    port: u16,
) -> Rechecked<tokio_rustls::client::TlsStream<TcpStream>> {
    let name = server_name("127.0.0.1").unwrap();
    let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let within = std::time::Duration::from_secs(10);
    tls.connect(name, port, tcp, crate::tls::Alpn::Unused, within).await.unwrap()
}

/// The connections cut whose peer `certificate`'s CA file refused, as the metrics show them
/// (each test runs in a process of its own under nextest, so the count is the test's).
pub(crate) fn cut(certificate: &str) -> Option<u64> {
    let shown = crate::tls::expiry::expiry_registry().render();
    let series = format!("handoff_tls_connections_cut_total{{certificate=\"{certificate}\"}} ");
    shown.lines().find_map(|l| l.strip_prefix(series.as_str())?.parse().ok())
}

/// A CA taken out of a listener's bundle: a client of that CA whose connection was up before
/// is cut at its next request, before it is read; a client of the CA kept goes on.
#[tokio::test]
async fn a_client_of_a_ca_taken_out_is_cut_at_its_next_use() {
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let pems = CertFiles::new(&kept.issue(), &both);
    let server = pems.cluster();
    assert_eq!(cut("cluster"), Some(0), "shown at 0 from the start");
    let (port, mut ends) = echo_server(server.clone()).await;
    let mut stays = dial(&kept.issue().trusting(&both), port).await;
    let mut goes = dial(&removed.issue().trusting(&both), port).await;
    round_trip(&mut stays).await.unwrap();
    round_trip(&mut goes).await.unwrap();

    pems.put("ca.crt", kept.pem());
    assert_eq!(server.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    assert!(round_trip(&mut goes).await.is_err(), "its request is not answered");
    assert_eq!(ends.recv().await, Some(ErrorKind::PermissionDenied), "cut by the check");
    round_trip(&mut stays).await.expect("a client of the CA kept goes on");
    assert_eq!(cut("cluster"), Some(1), "the cut counted, once");
    // A reload that keeps the CA file (a renewal of the listener's own certificate) checks
    // no connection again; one that changes it does.
    let generation = || server.peer_check(PeerRole::Client).taken_at;
    let before = generation();
    pems.put_cert(&kept.issue());
    assert_eq!(server.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    assert_eq!(generation(), before, "a renewal: the CA file as it was");
    round_trip(&mut stays).await.expect("still trusted after a renewal");
    pems.put("ca.crt", &both);
    assert_eq!(server.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    assert_eq!(generation(), before + 1, "the CA file changed");
}

/// A peer's chain is checked again at the time of its handshake: what a reload changes is
/// the trust, not the certificate's validity (a peer certificate that expired while its
/// connection was up is not cut by a reload, as it was not before one).
#[test]
fn a_chain_is_checked_again_at_its_handshakes_time() {
    let ca = TestCa::new();
    let expired = ca.issue_expired(); // valid through 2000
    let chain =
        vec![rustls::pki_types::pem::PemObject::from_pem_slice(expired.cert.as_bytes()).unwrap()];
    let check = ca.issue().cluster().peer_check(PeerRole::Client);
    let in_2000 = SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(962_409_600);
    check.verify(&chain, in_2000).expect("valid at its handshake");
    let e = check.verify(&chain, SystemTime::now()).expect_err("expired now");
    assert!(matches!(e, rustls::Error::InvalidCertificate(_)), "{e:?}");
    let stranger = TestCa::new().issue().cluster().peer_check(PeerRole::Client);
    assert!(stranger.verify(&chain, in_2000).is_err(), "another CA's trust refuses it");
}

/// A dialer whose bundle lost the CA of a server it holds a connection to: the connection is
/// refused before its next write (and a pool's look at it says so), as the unknown issuer it
/// is, not as the server's own fault.
#[tokio::test]
async fn a_server_of_a_ca_taken_out_is_refused_before_the_next_write() {
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let (port, _ends) = echo_server(removed.issue().trusting(&both)).await;
    let pems = CertFiles::new(&kept.issue(), &both);
    let client = pems.cluster();
    let mut s = dial(&client, port).await;
    round_trip(&mut s).await.unwrap();
    assert!(s.still_trusted().is_ok());

    pems.put("ca.crt", kept.pem());
    assert_eq!(client.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    let TlsError::PeerRefused(refused) = s.still_trusted().expect_err("its issuer not trusted")
    else {
        panic!("a refusal of the peer");
    };
    // The test CAs share their (empty) name: the kept CA is found as the issuer, and its
    // signature does not verify (CAs of distinct names give `UnknownIssuer`).
    use rustls::CertificateError::{BadSignature, UnknownIssuer};
    let not_its_issuer =
        matches!(refused, rustls::Error::InvalidCertificate(UnknownIssuer | BadSignature));
    assert!(not_its_issuer, "{refused:?}");
    let e = s.write_all(b"ping").await.expect_err("refused before the write");
    assert_eq!(e.kind(), ErrorKind::PermissionDenied);
    assert!(!crate::tls::refused_peer_certificate(&e), "an unknown issuer is not its fault");
    assert!(s.write_all(b"ping").await.is_err(), "and every write after it");
    assert!(s.flush().await.is_err(), "nothing flushed to it");
    assert_eq!(cut("cluster"), Some(1), "one connection, counted once");
}

/// A public endpoint's client CA taken out of its bundle: a client of that CA whose
/// connection was up is cut at its next request; a client of the CA kept goes on. Without a
/// client CA there is nothing to check again.
#[tokio::test]
async fn a_public_client_of_a_ca_taken_out_is_cut_at_its_next_use() {
    use crate::tls::public_client;
    let (site, kept, removed) = (TestCa::new(), TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let files = CertFiles::new(&site.issue(), &both);
    let public = files.public();
    let (port, mut ends) = echo_over(ListenerTls::Public(public.clone())).await;
    let client = |c: &crate::tls::test_certs::TestCert| {
        public_client(site.pem().as_bytes(), Some((c.cert.as_bytes(), c.key.as_bytes()))).unwrap()
    };
    let dial = |c: tokio_rustls::TlsConnector| async move {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        c.connect(server_name("127.0.0.1").unwrap(), tcp).await.unwrap()
    };
    let mut stays = dial(client(&kept.issue())).await;
    let mut goes = dial(client(&removed.issue())).await;
    round_trip(&mut stays).await.unwrap();
    round_trip(&mut goes).await.unwrap();

    files.put("ca.crt", kept.pem());
    assert_eq!(public.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    assert!(round_trip(&mut goes).await.is_err(), "its request is not answered");
    assert_eq!(ends.recv().await, Some(ErrorKind::PermissionDenied), "cut by the check");
    round_trip(&mut stays).await.expect("a client of the CA kept goes on");
    assert_eq!(cut("public"), Some(1), "the cut counted, once");
    assert!(site.issue().server().peer_check().is_none(), "no client CA: nothing to check");
}
