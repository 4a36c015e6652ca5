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
