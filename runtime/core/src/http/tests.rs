use std::time::Duration;

use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use super::*;

const GET: &[u8] = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n";

/// Serves a router answering `GET /` on an ephemeral port until the token is cancelled.
async fn server(
    limits: HttpLimits,
) -> (std::net::SocketAddr, CancellationToken, tokio::task::JoinHandle<std::io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let router = Router::new()
        .route("/", get(|| async { "hello" }))
        .route("/echo", axum::routing::post(|b: bytes::Bytes| async move { b.len().to_string() }));
    let done = stop.clone();
    let served = tokio::spawn(serve(listener, router, done.cancelled_owned(), limits));
    (addr, stop, served)
}

/// Reads until the peer closes (`true`) or `within` passes (`false`).
async fn closes(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
        }
    };
    tokio::time::timeout(within, read_all).await.is_ok()
}

/// Reads one response's first bytes.
async fn answered(s: &mut TcpStream) -> String {
    let mut buf = [0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut buf))
        .await
        .expect("answered")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A client that connects and says nothing, one that trickles a head, and one that leaves
/// its kept-alive connection idle after a request are all cut off at the head timeout.
#[tokio::test]
async fn silent_trickling_and_idle_connections_are_cut_off() {
    let limits = HttpLimits { head_timeout: Duration::from_millis(300), ..HttpLimits::default() };
    let (addr, stop, served) = server(limits).await;
    let mut silent = TcpStream::connect(addr).await.unwrap();
    let mut trickling = TcpStream::connect(addr).await.unwrap();
    let mut kept = TcpStream::connect(addr).await.unwrap();
    kept.write_all(GET).await.unwrap();
    assert!(answered(&mut kept).await.contains("hello"));
    let trickle = async {
        for b in b"GET / HTTP/1.1\r\nhost: x" {
            if trickling.write_all(&[*b]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        closes(&mut trickling, Duration::from_secs(10)).await
    };
    let within = Duration::from_secs(10);
    let (a, b, c) = tokio::join!(closes(&mut silent, within), trickle, closes(&mut kept, within));
    assert!(a && b && c, "silent {a}, trickling {b}, idle after a request {c}");
    stop.cancel();
    served.await.unwrap().unwrap();
}

/// Past `max_connections`, a connection waits for one to close before it is served.
#[tokio::test]
async fn a_connection_past_the_bound_waits_for_a_place() {
    let limits = HttpLimits { max_connections: 2, ..HttpLimits::default() };
    let (addr, stop, served) = server(limits).await;
    let first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(GET).await.unwrap();
    assert!(answered(&mut second).await.contains("hello"), "within the bound: served");
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(GET).await.unwrap();
    let mut buf = [0u8; 64];
    let early = tokio::time::timeout(Duration::from_millis(300), third.read(&mut buf)).await;
    assert!(early.is_err(), "served past the bound: {early:?}");
    drop(first);
    assert!(answered(&mut third).await.contains("hello"), "served once a place freed");
    stop.cancel();
    drop((second, third));
    served.await.unwrap().unwrap();
}

/// Shutdown lets a request being served finish, closes idle connections, and returns.
#[tokio::test]
async fn shutdown_finishes_the_requests_in_flight_and_returns() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let started = Arc::new(tokio::sync::Notify::new());
    let begun = started.clone();
    let slow = Router::new().route(
        "/",
        get(move || async move {
            begun.notify_one();
            tokio::time::sleep(Duration::from_millis(300)).await;
            "slow"
        }),
    );
    let served =
        tokio::spawn(serve(listener, slow, stop.clone().cancelled_owned(), HttpLimits::default()));
    let mut idle = TcpStream::connect(addr).await.unwrap();
    let mut busy = TcpStream::connect(addr).await.unwrap();
    busy.write_all(GET).await.unwrap();
    started.notified().await;
    stop.cancel();
    assert!(answered(&mut busy).await.contains("slow"), "the request in flight finished");
    assert!(closes(&mut idle, Duration::from_secs(10)).await, "the idle connection closed");
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("returned")
        .unwrap()
        .unwrap();
}

/// A connection still busy when the server stops (here a request whose body never comes;
/// as well a response its client no longer reads) is cut after the shutdown grace: the
/// server returned only once the client left.
#[tokio::test]
async fn shutdown_cuts_what_is_not_finished_within_its_grace() {
    let limits = HttpLimits { shutdown_grace: Duration::from_millis(200), ..HttpLimits::default() };
    let (addr, stop, served) = server(limits).await;
    let mut stuck = TcpStream::connect(addr).await.unwrap();
    stuck
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(5), served)
        .await
        .expect("returned after the grace")
        .unwrap()
        .unwrap();
    assert!(closes(&mut stuck, Duration::from_secs(1)).await, "the busy connection was cut");
}

/// A body declared and trickled is cut off at the body timeout (the head came in time);
/// one that comes whole is read.
#[tokio::test]
async fn a_trickled_body_is_cut_off() {
    let limits = HttpLimits { body_timeout: Duration::from_millis(300), ..HttpLimits::default() };
    let (addr, stop, served) = server(limits).await;
    let mut whole = TcpStream::connect(addr).await.unwrap();
    whole
        .write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello")
        .await
        .unwrap();
    let said = answered(&mut whole).await;
    assert!(said.starts_with("HTTP/1.1 200") && said.ends_with('5'), "{said}");
    let mut slow = TcpStream::connect(addr).await.unwrap();
    slow.write_all(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1000\r\n\r\nhello")
        .await
        .unwrap();
    let said = answered(&mut slow).await;
    assert!(said.starts_with("HTTP/1.1 400"), "refused once its time was up: {said}");
    stop.cancel();
    drop((whole, slow));
    served.await.unwrap().unwrap();
}

/// HTTP/2 with prior knowledge (an h2 proxy in front) is served, as `axum::serve` did: the
/// server answers the preface with its SETTINGS.
#[tokio::test]
async fn http2_with_prior_knowledge_is_served() {
    let (addr, stop, served) = server(HttpLimits::default()).await;
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n").await.unwrap();
    s.write_all(&[0, 0, 0, 4, 0, 0, 0, 0, 0]).await.unwrap(); // an empty SETTINGS frame
    let mut head = [0u8; 9];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut head))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(head[3], 4, "a SETTINGS frame first: {head:?}");
    stop.cancel();
    drop(s);
    served.await.unwrap().unwrap();
}

/// A client that asks for an endless response and never reads it is cut off once the
/// server's writes have gone nowhere for the write timeout: the response (and what it holds)
/// is dropped. Before, it stayed as long as the client's kernel kept the window shut.
#[tokio::test]
async fn a_client_that_stops_reading_is_cut_off_at_the_write_timeout() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    struct Flag(Arc<AtomicBool>);
    impl Drop for Flag {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }
    let dropped = Arc::new(AtomicBool::new(false));
    let d = dropped.clone();
    let endless = get(move || {
        let flag = Flag(d.clone());
        async move {
            let chunks = futures::stream::repeat_with(move || {
                let _held = &flag;
                Ok::<_, std::io::Error>(bytes::Bytes::from(vec![b'x'; 64 << 10]))
            });
            axum::body::Body::from_stream(chunks)
        }
    });
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let limits = HttpLimits { write_timeout: Duration::from_millis(300), ..HttpLimits::default() };
    let stop = CancellationToken::new();
    let served = tokio::spawn(serve(
        listener,
        Router::new().route("/", endless),
        stop.clone().cancelled_owned(),
        limits,
    ));
    let mut unread = TcpStream::connect(addr).await.unwrap();
    unread.write_all(GET).await.unwrap();
    let since = std::time::Instant::now();
    while !dropped.load(Ordering::SeqCst) {
        assert!(
            since.elapsed() < Duration::from_secs(10),
            "the response outlived the write timeout"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // A reader that keeps up is not cut.
    let mut reading = TcpStream::connect(addr).await.unwrap();
    reading.write_all(GET).await.unwrap();
    let mut buf = vec![0u8; 1 << 20];
    let mut got = 0usize;
    let began = std::time::Instant::now();
    while began.elapsed() < Duration::from_secs(1) {
        got += reading.read(&mut buf).await.expect("not cut");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(got > 1 << 20, "{got} bytes read");
    stop.cancel();
    drop((unread, reading));
    let _ = served.await;
}
