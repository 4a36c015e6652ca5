use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;

/// A listener of `max` places (unproven for `grace` at least before they are taken back)
/// whose connections prove themselves with a `P`, are answered `ok`, and are then held until
/// their peer closes.
async fn listener(max: usize, grace: Duration, tasks: &Tasks) -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let places = Places { max, grace };
    serve_accepts(l, places, tasks, "test", |mut s: TcpStream, _, _, place: Place| async move {
        let mut b = [0u8; 1];
        if s.read_exact(&mut b).await.is_err() || b[0] != b'P' {
            return;
        }
        place.proven();
        if s.write_all(b"ok").await.is_ok() {
            while s.read(&mut b).await.is_ok_and(|n| n > 0) {}
        }
    });
    addr
}

/// Proves `s` and waits for its answer.
async fn prove(s: &mut TcpStream) {
    s.write_all(b"P").await.unwrap();
    let mut ok = [0u8; 2];
    let answered = tokio::time::timeout(Duration::from_secs(30), s.read_exact(&mut ok)).await;
    assert!(matches!(answered, Ok(Ok(_))), "a proven connection was not served");
    assert_eq!(&ok, b"ok");
}

/// `n` connections to `at` that say nothing, in the order they were made.
pub(crate) async fn strangers(at: &crate::AgentAddr, n: usize) -> Vec<TcpStream> {
    let mut made = Vec::new();
    for _ in 0..n {
        made.push(TcpStream::connect((at.ip.as_str(), at.port)).await.unwrap());
    }
    made
}

/// Whether the listener closed `s` (it reads its end).
pub(crate) async fn closed(s: &mut TcpStream) -> bool {
    let mut b = [0u8; 1];
    let read = tokio::time::timeout(Duration::from_secs(30), s.read(&mut b)).await;
    matches!(read, Ok(Ok(0)) | Ok(Err(_)))
}

#[tokio::test]
async fn strangers_give_their_places_to_connections_that_prove_themselves() {
    let tasks = Tasks::new();
    let addr = listener(2, Duration::ZERO, &tasks).await;
    let mut strangers = Vec::new();
    for _ in 0..2 {
        strangers.push(TcpStream::connect(addr).await.unwrap());
    }
    // Both places held by strangers who say nothing: the next connection takes the oldest's.
    let mut first = TcpStream::connect(addr).await.unwrap();
    prove(&mut first).await;
    assert!(closed(&mut strangers[0]).await, "the oldest stranger kept its place");
    // And the next stranger takes the remaining stranger's, never the proven one's.
    let mut late = TcpStream::connect(addr).await.unwrap();
    assert!(closed(&mut strangers[1]).await, "a stranger kept its place over a newer one");
    let mut second = TcpStream::connect(addr).await.unwrap();
    prove(&mut second).await;
    assert!(closed(&mut late).await);

    // Every place proven: a new connection waits for one, then is served.
    let mut third = TcpStream::connect(addr).await.unwrap();
    third.write_all(b"P").await.unwrap();
    let mut ok = [0u8; 2];
    let early = tokio::time::timeout(Duration::from_millis(200), third.read_exact(&mut ok)).await;
    assert!(early.is_err(), "served past the places");
    drop(first);
    let answered = tokio::time::timeout(Duration::from_secs(30), third.read_exact(&mut ok)).await;
    assert!(matches!(answered, Ok(Ok(_))), "a freed place was not given to the waiting one");
    drop((second, third));
    tasks.shutdown().await;
}

#[tokio::test]
async fn within_its_grace_an_unproven_connection_keeps_its_place() {
    let tasks = Tasks::new();
    let addr = listener(1, Duration::from_secs(3600), &tasks).await;
    let mut first = TcpStream::connect(addr).await.unwrap();
    let mut second = TcpStream::connect(addr).await.unwrap();
    second.write_all(b"P").await.unwrap();
    let mut ok = [0u8; 2];
    let early = tokio::time::timeout(Duration::from_millis(200), second.read_exact(&mut ok)).await;
    assert!(early.is_err(), "the young unproven connection gave its place up");
    // Proven, the first keeps it; gone, the second takes it.
    prove(&mut first).await;
    drop(first);
    let answered = tokio::time::timeout(Duration::from_secs(30), second.read_exact(&mut ok)).await;
    assert!(matches!(answered, Ok(Ok(_))), "the waiting connection was not served");
    tasks.shutdown().await;
}

#[test]
fn the_oldest_unproven_connection_ends_once_past_its_grace() {
    let table = Arc::new(Unproven::default());
    let (t0, grace) = (Instant::now(), Duration::from_secs(1));
    assert_eq!(table.end_oldest(t0, grace), Oldest::None);
    let (first, first_end) = table.add(1, t0);
    let (second, second_end) = table.add(2, t0 + grace / 2);
    assert_eq!(table.end_oldest(t0 + grace / 4, grace), Oldest::Young(t0 + grace));
    assert_eq!(table.end_oldest(t0 + grace, grace), Oldest::Ended);
    assert!(first_end.is_cancelled() && !second_end.is_cancelled());
    drop(first);
    // The next is judged by its own age; proven, it is no longer anyone's to take.
    assert_eq!(table.end_oldest(t0 + grace, grace), Oldest::Young(t0 + grace * 3 / 2));
    second.proven();
    assert_eq!(table.end_oldest(t0 + grace * 10, grace), Oldest::None);
    assert!(!second_end.is_cancelled());
}

#[tokio::test]
async fn a_waiting_connection_takes_a_strangers_place_once_its_grace_is_over() {
    let tasks = Tasks::new();
    let addr = listener(1, Duration::from_millis(300), &tasks).await;
    let mut stranger = TcpStream::connect(addr).await.unwrap();
    // Arrives while the stranger is young: waits, and nothing else arrives to wake it.
    let mut holder = TcpStream::connect(addr).await.unwrap();
    prove(&mut holder).await;
    assert!(closed(&mut stranger).await, "the stranger kept its place past its grace");
    tasks.shutdown().await;
}
