use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::test_certs::TestCa;
use super::*;

/// Echoes 4 bytes on every connection the listener hands out.
async fn echo(mut l: TlsListener) {
    loop {
        let (mut s, _) = l.accept_tls().await;
        let mut b = [0u8; 4];
        if s.read_exact(&mut b).await.is_ok() {
            let _ = s.write_all(&b).await;
            let _ = s.flush().await;
        }
    }
}

async fn round_trip(tls: &ClusterTls, port: u16) -> std::io::Result<[u8; 4]> {
    round_trip_to(tls, port, "127.0.0.1").await
}

/// A round trip to the listener on `port`, dialed as `host`.
async fn round_trip_to(tls: &ClusterTls, port: u16, host: &str) -> std::io::Result<[u8; 4]> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let mut s = tls.connector().connect(server_name(host).unwrap(), tcp).await?;
    s.write_all(b"ping").await?;
    s.flush().await?;
    let mut b = [0u8; 4];
    s.read_exact(&mut b).await?;
    Ok(b)
}

async fn listener(tls: &ClusterTls, timeout: Duration, max: usize) -> (u16, TlsListener) {
    let tcp = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = tcp.local_addr().unwrap().port();
    (port, TlsListener::with_limits(tcp, ListenerTls::Cluster(tls.clone()), timeout, max))
}

/// A connection from `host` (a loopback address of its own).
async fn from(host: [u8; 4], port: u16) -> TcpStream {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind((host, 0).into()).unwrap();
    sock.connect(([127, 0, 0, 1], port).into()).await.unwrap()
}

#[tokio::test]
async fn silent_peers_do_not_hold_up_a_handshake() {
    let ca = TestCa::new();
    let tls = ca.issue().cluster();
    let (port, l) = listener(&tls, Duration::from_secs(60), 256).await;
    let server = tokio::spawn(echo(l));
    let mut silent = Vec::new();
    // 50 silent peers on 10 hosts (127.0.0.2..11), 5 each: within the per-host bound.
    for i in 0..50u8 {
        silent.push(from([127, 0, 0, 2 + i % 10], port).await);
    }
    // Handshakes run side by side: one behind 50 silent peers finishes at once.
    let got = tokio::time::timeout(Duration::from_secs(5), round_trip(&tls, port)).await;
    assert_eq!(got.expect("not held up").unwrap(), *b"ping");

    // A stranger's certificate is refused, and the listener goes on.
    let stranger = TestCa::new().issue().cluster();
    assert!(round_trip(&stranger, port).await.is_err(), "another CA's certificate");
    assert_eq!(round_trip(&tls, port).await.unwrap(), *b"ping");
    server.abort();
}

#[tokio::test]
async fn one_host_cannot_take_every_place() {
    let tls = TestCa::new().issue().cluster();
    let (port, l) = listener(&tls, Duration::from_secs(60), 256).await;
    let server = tokio::spawn(echo(l));
    let mut hog = Vec::new();
    for _ in 0..HANDSHAKES_PER_HOST + 20 {
        hog.push(from([127, 0, 0, 9], port).await);
    }
    // Its connections past the bound are closed at once; the rest wait in their handshake.
    // All are read side by side: no per-connection deadline is raced.
    let mut reads: futures::stream::FuturesUnordered<_> = hog
        .iter_mut()
        .map(|s| async move {
            let mut b = [0u8; 1];
            matches!(s.read(&mut b).await, Ok(0) | Err(_))
        })
        .collect();
    let counted = tokio::time::timeout(Duration::from_secs(5), async {
        let mut closed = 0;
        while let Some(c) = futures::StreamExt::next(&mut reads).await {
            closed += usize::from(c);
            if closed == 20 {
                break;
            }
        }
        closed
    })
    .await;
    drop(reads);
    assert_eq!(counted.ok(), Some(20), "the hog's connections past the bound are closed");
    // ...and everyone else is served at once.
    let got = tokio::time::timeout(Duration::from_secs(5), round_trip(&tls, port)).await;
    assert_eq!(got.expect("not held up").unwrap(), *b"ping");
    server.abort();
}

#[tokio::test]
async fn handshakes_beyond_the_limit_wait_for_a_place() {
    let tls = TestCa::new().issue().cluster();
    let deadline = Duration::from_millis(300);
    let (port, l) = listener(&tls, deadline, 2).await;
    let server = tokio::spawn(echo(l));
    let _silent: Vec<TcpStream> = vec![
        TcpStream::connect(("127.0.0.1", port)).await.unwrap(),
        TcpStream::connect(("127.0.0.1", port)).await.unwrap(),
    ];
    // Both places are taken until the silent handshakes time out.
    tokio::time::sleep(Duration::from_millis(50)).await;
    let started = Instant::now();
    assert_eq!(round_trip(&tls, port).await.unwrap(), *b"ping");
    let waited = started.elapsed();
    assert!(waited >= Duration::from_millis(200), "waited for a place: {waited:?}");
    server.abort();
}

/// The two ends' rules are one: a certificate refused for what is its holder's own, and the
/// alert rustls sends back for it, agree for every reason (they were two lists, apart on a
/// certificate not yet valid and one for another purpose).
#[test]
fn both_ends_blame_a_refused_certificate_alike() {
    use rustls::CertificateError as C;
    for c in [
        C::BadEncoding,
        C::Expired,
        C::NotValidYet,
        C::Revoked,
        C::UnhandledCriticalExtension,
        C::UnknownIssuer,
        C::UnknownRevocationStatus,
        C::ExpiredRevocationList,
        C::BadSignature,
        C::NotValidForName,
        C::InvalidPurpose,
        C::ApplicationVerificationFailure,
    ] {
        let alert = rustls::AlertDescription::from(c.clone());
        assert_eq!(
            super::holders_fault(&c),
            super::HOLDERS_FAULT_ALERTS.contains(&alert),
            "{c:?} (alert {alert:?})"
        );
    }
}

/// The Helm chart's shape: one certificate for every pod of a role, naming them all with a
/// wildcard under the role's headless Service; a pod is dialed by its own name there.
#[tokio::test]
async fn a_wildcard_certificate_serves_each_pod_under_its_service() {
    let ca = TestCa::new();
    let prefills = ca.issue_for(&["*.ci-handoff-prefill.default.svc.cluster.local"]).cluster();
    let (port, l) = listener(&prefills, Duration::from_secs(10), 256).await;
    let server = tokio::spawn(echo(l));
    let dialer = ca.issue().cluster();
    let pod = "ci-handoff-prefill-7d9f8c6b5-x2x9k.ci-handoff-prefill.default.svc.cluster.local";
    assert_eq!(round_trip_to(&dialer, port, pod).await.unwrap(), *b"ping");
    for elsewhere in [
        "ci-handoff-frontend-6c8d-ab12c.ci-handoff-frontend-pods.default.svc.cluster.local",
        "a.b.ci-handoff-prefill.default.svc.cluster.local",
        "ci-handoff-prefill.default.svc.cluster.local",
    ] {
        let e = round_trip_to(&dialer, port, elsewhere).await.unwrap_err();
        assert!(refused_peer_certificate(&e), "{elsewhere}: {e}");
    }
    server.abort();
}
