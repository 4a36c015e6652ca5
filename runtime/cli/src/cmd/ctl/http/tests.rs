use handoff_core::tls::test_certs::{TestCa, TestCert};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// A listener that answers each of `n` connections with `answer` and hands back what it was
/// sent.
async fn listener(answer: &'static [u8], n: usize) -> (String, tokio::task::JoinHandle<Vec<u8>>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let heard = tokio::spawn(async move {
        let mut heard = Vec::new();
        for _ in 0..n {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = [0u8; 4096];
            let n = s.read(&mut buf).await.unwrap_or(0);
            heard.extend_from_slice(&buf[..n]);
            let _ = s.write_all(answer).await;
        }
        heard
    });
    (addr, heard)
}

/// Over plain HTTP the token goes only to a listener that answered HTTP without it: a TLS
/// listener (whose answer to plain bytes is an alert, not HTTP) never sees it.
#[tokio::test]
async fn the_token_is_not_sent_in_the_clear_to_a_listener_that_is_not_http() {
    // A TLS alert record, as a TLS listener answers plain bytes.
    let (addr, heard) = listener(b"\x15\x03\x03\x00\x02\x02\x46", 1).await;
    let e = get(&addr, "/v1/debug/requests/1", Some("s3cret"), None).await.unwrap_err();
    assert!(e.to_string().contains("--public-ca"), "{e}");
    let heard = heard.await.unwrap();
    assert!(!heard.is_empty());
    assert!(!String::from_utf8_lossy(&heard).contains("s3cret"), "the token went out in the clear");

    // A plain HTTP listener asking for it gets it.
    let (addr, heard) =
        listener(b"HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\n\r\n", 2).await;
    let (code, _) = get(&addr, "/v1/debug/requests/1", Some("s3cret"), None).await.unwrap();
    assert_eq!(code, 401);
    let heard = String::from_utf8_lossy(&heard.await.unwrap()).into_owned();
    assert_eq!(heard.matches("GET ").count(), 2, "{heard}");
    assert!(heard.contains("authorization: Bearer s3cret"), "{heard}");
}

/// An answer shorter than its `content-length` (a peer gone mid-way) is an error, not a
/// body cut short.
#[tokio::test]
async fn an_answer_cut_short_is_an_error() {
    let (addr, heard) = listener(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nabc", 1).await;
    let e = get(&addr, "/v1/debug/requests/1", None, None).await.unwrap_err();
    assert!(e.to_string().contains("cut short"), "{e}");
    assert!(heard.await.unwrap().starts_with(b"GET "), "the listener served the one request");
}

/// A listener with `server`'s certificate answering 200 on each of `n` connections whose
/// handshake ends; hands back how many did.
async fn tls_listener(
    server: handoff_core::tls::ServerTls,
    n: usize,
) -> (String, tokio::task::JoinHandle<usize>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let served = tokio::spawn(async move {
        let mut served = 0;
        for _ in 0..n {
            let (tcp, _) = l.accept().await.unwrap();
            let Ok(mut s) = server.acceptor().accept(tcp).await else { continue };
            served += 1;
            let mut buf = [0u8; 4096];
            let _ = s.read(&mut buf).await;
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok").await;
            let _ = s.shutdown().await;
        }
        served
    });
    (addr, served)
}

fn public(ca: &str, identity: Option<&TestCert>, name: Option<&str>) -> PublicTls {
    let identity = identity.map(|c| (c.cert.as_bytes(), c.key.as_bytes()));
    PublicTls {
        connector: handoff_core::tls::public_client(ca.as_bytes(), identity).unwrap(),
        name: name.map(|n| handoff_core::tls::server_name(n).unwrap()),
    }
}

/// A frontend's public certificate names its Service, not the pod address asked: with
/// `--public-name` that name is checked instead.
#[tokio::test]
async fn a_public_name_is_checked_instead_of_the_host_asked() {
    let ca = TestCa::new();
    let cert = ca.issue_for(&["frontend.example"]);
    let server =
        handoff_core::tls::ServerTls::from_pem(cert.cert.as_bytes(), cert.key.as_bytes(), None)
            .unwrap();
    let (addr, served) = tls_listener(server, 3).await;
    let path = "/v1/debug/requests/1";
    let by_host = get(&addr, path, None, Some(&public(ca.pem(), None, None))).await;
    assert!(by_host.is_err(), "127.0.0.1 is not a name the certificate holds");
    let other = public(ca.pem(), None, Some("other.example"));
    assert!(get(&addr, path, None, Some(&other)).await.is_err(), "nor is other.example");
    let named = public(ca.pem(), None, Some("frontend.example"));
    assert_eq!(get(&addr, path, None, Some(&named)).await.unwrap(), (200, "ok".to_owned()));
    assert_eq!(served.await.unwrap(), 1);
}

/// A frontend that requires client certificates (`--public-tls-client-ca`) is asked with
/// `--public-cert` and `--public-key`.
#[tokio::test]
async fn a_client_certificate_is_shown_to_a_frontend_that_requires_one() {
    let (ca, clients) = (TestCa::new(), TestCa::new());
    let cert = ca.issue();
    let server = handoff_core::tls::ServerTls::from_pem(
        cert.cert.as_bytes(),
        cert.key.as_bytes(),
        Some(clients.pem().as_bytes()),
    )
    .unwrap();
    let (addr, served) = tls_listener(server, 3).await;
    let path = "/v1/debug/requests/1";
    let bare = get(&addr, path, None, Some(&public(ca.pem(), None, None))).await;
    assert!(bare.is_err(), "refused without a client certificate");
    let stranger = ca.issue();
    let foreign = get(&addr, path, None, Some(&public(ca.pem(), Some(&stranger), None))).await;
    assert!(foreign.is_err(), "refused with one another CA signed");
    let member = clients.issue();
    let shown = get(&addr, path, None, Some(&public(ca.pem(), Some(&member), None))).await;
    assert_eq!(shown.unwrap(), (200, "ok".to_owned()));
    assert_eq!(served.await.unwrap(), 1);
}

/// `ctl`'s arguments from `args` (after `handoff ctl`).
fn ctl(args: &[&str]) -> crate::args::CtlArgs {
    use clap::Parser;
    let argv = ["handoff", "ctl"].iter().chain(args).copied();
    match crate::args::Cli::try_parse_from(argv).unwrap().command {
        crate::args::Command::Ctl(a) => a,
        other => panic!("parsed as {other:?}"),
    }
}

/// The public flags pair up whichever side of the subcommand they are given on (clap checks
/// a global flag's requirements before it gathers it from both sides), and a pairing left
/// half made is refused by name.
#[test]
fn the_public_flags_pair_up_on_either_side_of_the_subcommand() {
    let ca = TestCa::new();
    let cert = ca.issue();
    let dir = std::env::temp_dir().join(format!("handoff-ctl-public-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = |name: &str, body: &str| {
        let p = dir.join(name);
        std::fs::write(&p, body).unwrap();
        p.display().to_string()
    };
    let (ca, c, k) =
        (file("ca.pem", ca.pem()), file("c.pem", &cert.cert), file("k.pem", &cert.key));
    let split = ctl(&["--public-ca", &ca, "trace", "1", "--public-cert", &c, "--public-key", &k]);
    let tls = PublicTls::from_args(&split).unwrap().expect("asked over TLS");
    assert!(tls.name.is_none());
    let named = ctl(&["trace", "1", "--public-ca", &ca, "--public-name", "frontend.example"]);
    assert!(PublicTls::from_args(&named).unwrap().unwrap().name.is_some());
    for (args, said) in [
        (&["--public-cert", &c, "trace", "1", "--public-key", &k][..], "need --public-ca"),
        (&["trace", "1", "--public-name", "x.example"][..], "need --public-ca"),
        (&["--public-ca", &ca, "trace", "1", "--public-cert", &c][..], "go together"),
        (&["--public-ca", &ca, "trace", "1", "--public-key", &k][..], "go together"),
    ] {
        let e = PublicTls::from_args(&ctl(args)).err().expect("refused");
        assert!(e.to_string().contains(said), "{args:?}: {e}");
    }
    assert!(PublicTls::from_args(&ctl(&["trace", "1"])).unwrap().is_none());
    let _ = std::fs::remove_dir_all(&dir);
}
