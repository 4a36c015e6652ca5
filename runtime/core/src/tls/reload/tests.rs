use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::*;
use crate::tls::expiry::expiry_registry;
use crate::tls::server_name;
use crate::tls::test_certs::{CertFiles, TestCa};

fn der(pem: &str) -> CertificateDer<'static> {
    CertificateDer::from_pem_slice(pem.as_bytes()).unwrap()
}

/// Echoes 4 bytes at a time on every connection `acceptor` takes (built once: reloads must
/// reach it), until the test ends.
async fn echo_server(acceptor: TlsAcceptor) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = l.accept().await.unwrap();
            let acceptor = acceptor.clone();
            tokio::spawn(async move {
                let Ok(mut s) = acceptor.accept(tcp).await else { return };
                let mut b = [0u8; 4];
                while s.read_exact(&mut b).await.is_ok() {
                    let _ = s.write_all(&b).await;
                    let _ = s.flush().await;
                }
            });
        }
    });
    port
}

type Dialed = tokio_rustls::client::TlsStream<TcpStream>;

/// Dials `port` with `connector` and makes one round trip: the server's leaf certificate, and
/// the connection. (A connector that dialed the server before resumes its session, which
/// shows the certificate the session began with: each dial below that looks at the
/// certificate takes a new client.)
async fn dial(
    connector: &TlsConnector,
    port: u16,
) -> std::io::Result<(CertificateDer<'static>, Dialed)> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut s = connector.connect(server_name("127.0.0.1").unwrap(), tcp).await?;
    round_trip(&mut s).await?;
    let leaf = s.get_ref().1.peer_certificates().unwrap()[0].clone().into_owned();
    Ok((leaf, s))
}

/// Whether `s`'s handshake resumed an earlier session.
fn resumed(s: &Dialed) -> bool {
    s.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
}

/// One 4-byte round trip on `s` to an echo server.
pub(crate) async fn round_trip<S>(s: &mut S) -> std::io::Result<()>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    s.write_all(b"ping").await?;
    s.flush().await?;
    let mut b = [0u8; 4];
    s.read_exact(&mut b).await?;
    assert_eq!(&b, b"ping");
    Ok(())
}

#[tokio::test]
async fn a_renewed_certificate_is_shown_from_the_next_handshake_on() {
    let ca = TestCa::new();
    let (first, renewed) = (ca.issue(), ca.issue());
    let pems = CertFiles::empty();
    pems.put("ca.crt", ca.pem());
    pems.put_cert(&first);
    let server = pems.cluster();
    let port = echo_server(server.acceptor().clone()).await;
    let client = || ca.issue().cluster();

    let (leaf, mut before) = dial(client().connector(), port).await.unwrap();
    assert_eq!(leaf, der(&first.cert));
    // A client that has dialed before: the cluster's connections resume no session.
    let again = client();
    dial(again.connector(), port).await.unwrap();
    assert!(!resumed(&dial(again.connector(), port).await.unwrap().1));
    let now = SystemTime::now();
    assert_eq!(server.reload(now).unwrap(), Reloaded::Unchanged, "nothing changed yet");

    pems.put_cert(&renewed);
    assert_eq!(server.reload(now).unwrap(), Reloaded::Taken);
    let (leaf, _) = dial(client().connector(), port).await.unwrap();
    assert_eq!(leaf, der(&renewed.cert), "a new handshake shows the renewed certificate");
    round_trip(&mut before).await.expect("a connection made before goes on");
    assert_eq!(server.reload(now).unwrap(), Reloaded::Unchanged, "taken once");
}

/// A CA change: the new CA added to the bundle, then trusted on both sides of a handshake.
#[tokio::test]
async fn a_ca_added_to_the_bundle_is_trusted_after_a_reload() {
    let (old, new) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", old.pem(), new.pem());
    let pems = CertFiles::empty();
    pems.put("ca.crt", old.pem());
    pems.put_cert(&old.issue());
    let member = pems.cluster();
    let port = echo_server(member.acceptor().clone()).await;
    // A peer with a certificate of the new CA, trusting both.
    let peer = new.issue().trusting(&both);
    let peer_port = echo_server(peer.acceptor().clone()).await;

    assert!(dial(peer.connector(), port).await.is_err(), "a client of the new CA, refused");
    assert!(dial(member.connector(), peer_port).await.is_err(), "a server of the new CA, refused");
    pems.put("ca.crt", &both);
    assert_eq!(member.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    dial(peer.connector(), port).await.expect("its client trusted now");
    dial(member.connector(), peer_port).await.expect("its server trusted now");
}

#[tokio::test]
async fn unusable_files_are_refused_once_and_the_certificate_in_use_kept() {
    let ca = TestCa::new();
    let (first, renewed) = (ca.issue(), ca.issue());
    let pems = CertFiles::empty();
    pems.put("ca.crt", ca.pem());
    pems.put_cert(&first);
    let server = pems.cluster();
    let port = echo_server(server.acceptor().clone()).await;
    let client = || ca.issue().cluster();
    let held = [Reloadable::Cluster(server.clone())];
    let now = SystemTime::now();

    // The renewed certificate without its key yet: not the key's.
    pems.put("tls.crt", &renewed.cert);
    assert!(matches!(server.reload(now), Err(TlsError::Invalid { .. })));
    assert_eq!(dial(client().connector(), port).await.unwrap().0, der(&first.cert));
    assert_eq!(look(&held, now), 0, "refused files are not tried again");
    pems.put("tls.key", &renewed.key);
    assert_eq!(look(&held, now), 1);
    assert_eq!(dial(client().connector(), port).await.unwrap().0, der(&renewed.cert));
    // A CA file that is no PEM: refused, counted.
    pems.put("ca.crt", "not a certificate");
    assert_eq!(look(&held, now), 0);
    dial(client().connector(), port).await.expect("the CA in use kept");
    // A certificate that has expired: refused, the one in use kept.
    pems.put("ca.crt", ca.pem());
    pems.put_cert(&ca.issue_expired());
    assert!(matches!(server.reload(now), Err(TlsError::Expired)));
    assert_eq!(dial(client().connector(), port).await.unwrap().0, der(&renewed.cert));
    // A key file gone: reported once, however many looks find it so.
    std::fs::remove_file(pems.path("tls.key")).unwrap();
    assert!(server.reload(now).is_err());
    assert_eq!(server.reload(now).unwrap(), Reloaded::Unchanged, "the same reason, once");
    look(&held, now);
    let text = expiry_registry().render();
    for (outcome, n) in [("taken", 1), ("refused", 1)] {
        let line = format!(
            "handoff_tls_reloads_total{{certificate=\"cluster\",outcome=\"{outcome}\"}} {n}"
        );
        assert!(text.contains(&line), "{line} in\n{text}");
    }
}

#[tokio::test]
async fn a_public_certificate_reloads_and_its_expiry_is_shown_again() {
    let ca = TestCa::new();
    let later = ca.issue_valid_until((2061, 3, 1));
    let pems = CertFiles::empty();
    pems.put_cert(&ca.issue());
    let public = ServerTls::from_files(&pems.path("tls.crt"), &pems.path("tls.key"), None).unwrap();
    let port = echo_server(public.acceptor().clone()).await;
    let client = || ca.issue().cluster();
    // A public listener's clients resume their sessions...
    let resuming = crate::tls::public_client(ca.pem().as_bytes(), None).unwrap();
    dial(&resuming, port).await.unwrap();
    assert!(resumed(&dial(&resuming, port).await.unwrap().1));

    pems.put_cert(&later);
    assert_eq!(look(&[Reloadable::Public(public.clone())], SystemTime::now()), 1);
    assert_eq!(dial(client().connector(), port).await.unwrap().0, der(&later.cert));
    // ... but none begun before a reload past it.
    let (leaf, s) = dial(&resuming, port).await.unwrap();
    assert!(!resumed(&s));
    assert_eq!(leaf, der(&later.cert));
    assert_eq!(public.chain()[0], der(&later.cert));
    let line =
        "handoff_tls_certificate_expiry_timestamp_seconds{certificate=\"public\"} 2876860800";
    assert!(expiry_registry().render().contains(line), "the new end shown");
}

/// A read that straddles a rewrite (kubelet swapping a Secret's files between the reads of
/// the certificate and the key) is read once more before it is refused.
#[test]
fn files_caught_mid_rewrite_are_read_once_more() {
    use crate::tls::files::Files;

    let pems = CertFiles::empty();
    pems.put("a", "old");
    let paths = vec![pems.path("a")];
    let files = Files::new(paths.clone(), None, Files::read_all(&paths).unwrap());
    pems.put("a", "torn");
    let tries = std::cell::Cell::new(0);
    let build = |b: &[Vec<u8>]| {
        tries.set(tries.get() + 1);
        if b[0] == b"torn" {
            // The rewrite finishes while the torn read is being built.
            pems.put("a", "whole");
            return Err(TlsError::Expired);
        }
        Ok(b[0].clone())
    };
    let mut took = None;
    let got = files.reload(SystemTime::now(), build, |v| took = Some(v));
    assert_eq!(got.unwrap(), Reloaded::Taken);
    assert_eq!((took.as_deref(), tries.get()), (Some(&b"whole"[..]), 2));

    // A torn read, and then the set in use again: nothing refused, nothing taken.
    pems.put("a", "torn");
    let back = |b: &[Vec<u8>]| {
        pems.put("a", "whole");
        Err::<Vec<u8>, _>(TlsError::Invalid { what: "test", reason: format!("{:?}", b[0]) })
    };
    let got = files.reload(SystemTime::now(), back, |_| unreachable!());
    assert_eq!(got.unwrap(), Reloaded::Unchanged);
}
