use std::sync::Mutex;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use zeromq::{PushSocket, Socket, SocketSend, ZmqMessage};

use super::*;
use handoff_core::zmtp::{LONG, MAX_MESSAGE_FRAMES, MORE, greeting, ready};

use super::MAX_PER_PEER;

/// A PULL server on a port of its own; the messages it hands on come out of the receiver.
async fn pull() -> (u16, mpsc::UnboundedReceiver<Vec<Bytes>>, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let (tx, rx) = mpsc::unbounded_channel();
    let tx = Mutex::new(tx);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve(
        listener,
        move |frames: &[Bytes]| {
            // A handler that fails: its connection's task panics (see the test below).
            assert_ne!(frames, [Bytes::from_static(b"panic")], "the handler fails");
            let _ = tx.lock().unwrap().send(frames.to_vec());
        },
        async move {
            let _ = stopped.await;
        },
    ));
    (port, rx, stop)
}

async fn push(port: u16) -> PushSocket {
    let mut push = PushSocket::new();
    push.connect(&format!("tcp://127.0.0.1:{port}")).await.unwrap();
    push
}

fn message(frames: &[&[u8]]) -> ZmqMessage {
    let frames: Vec<Bytes> = frames.iter().map(|f| Bytes::copy_from_slice(f)).collect();
    ZmqMessage::try_from(frames).unwrap()
}

async fn next(rx: &mut mpsc::UnboundedReceiver<Vec<Bytes>>) -> Vec<Bytes> {
    tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.unwrap().unwrap()
}

/// A ZMQ PUSH socket (another implementation's) gets its multipart messages through, short
/// and long frames alike, in order.
#[tokio::test]
async fn a_push_socket_delivers_multipart_messages() {
    let (port, mut rx, _stop) = pull().await;
    let mut p = push(port).await;
    let long = vec![7u8; 70_000];
    p.send(message(&[b"7", b"0", b"3"])).await.unwrap();
    p.send(message(&[b"AUX_DATA", &long])).await.unwrap();
    assert_eq!(next(&mut rx).await, vec![&b"7"[..], b"0", b"3"]);
    assert_eq!(next(&mut rx).await, vec![Bytes::from_static(b"AUX_DATA"), Bytes::from(long)]);
}

/// What a raw peer sends after a good greeting and READY.
async fn greeted(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(&greeting()).await.unwrap();
    s.write_all(&ready(b"PUSH")).await.unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).await.unwrap();
    s
}

/// Whether the server closed `s` (reads end).
async fn closed(s: &mut TcpStream) -> bool {
    let mut sink = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut sink)).await.is_ok()
}

/// A frame header declaring 2^63 bytes, a message of too many frames, a stranger's greeting,
/// a PULL pretending to push: each loses its own connection, and the server goes on taking
/// good messages.
#[tokio::test]
async fn hostile_peers_lose_their_connection_and_nobody_else_notices() {
    let (port, mut rx, _stop) = pull().await;
    let mut huge = greeted(port).await;
    huge.write_all(&[LONG]).await.unwrap();
    huge.write_all(&0x7fff_ffff_fff0_0000u64.to_be_bytes()).await.unwrap();
    assert!(closed(&mut huge).await, "a 2^63-byte frame closes the connection");

    let mut many = greeted(port).await;
    for _ in 0..=MAX_MESSAGE_FRAMES {
        many.write_all(&[MORE, 1, b'x']).await.unwrap();
    }
    assert!(closed(&mut many).await, "too many frames close the connection");

    let mut stranger = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    stranger.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    stranger.write_all(&[0u8; 64]).await.unwrap();
    assert!(closed(&mut stranger).await, "not ZMTP");

    let mut puller = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    puller.write_all(&greeting()).await.unwrap();
    puller.write_all(&ready(b"PULL")).await.unwrap();
    assert!(closed(&mut puller).await, "a PULL is no PUSH");

    let mut p = push(port).await;
    p.send(message(&[b"7", b"0", b"3"])).await.unwrap();
    assert_eq!(next(&mut rx).await, vec![&b"7"[..], b"0", b"3"]);
    assert!(rx.try_recv().is_err(), "nothing from the hostile peers");
}

/// One address may hold at most `MAX_PER_PEER` connections: one more is closed at once,
/// and another address is still served.
#[tokio::test]
async fn one_address_cannot_take_every_place() {
    let (port, mut rx, _stop) = pull().await;
    let mut held = Vec::new();
    for _ in 0..MAX_PER_PEER {
        held.push(greeted(port).await);
    }
    let mut extra = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    assert!(closed(&mut extra).await, "the one too many is closed");
    // Another address (all of 127/8 is loopback) is served, its messages handed on.
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut s = other.connect(format!("127.0.0.1:{port}").parse().unwrap()).await.unwrap();
    s.write_all(&greeting()).await.unwrap();
    s.write_all(&ready(b"PUSH")).await.unwrap();
    let mut theirs = [0u8; 64];
    s.read_exact(&mut theirs).await.unwrap();
    s.write_all(&[0, 2, b'o', b'k']).await.unwrap();
    assert_eq!(next(&mut rx).await, vec![Bytes::from_static(b"ok")]);
    drop(held);
}

/// A message's frames may add up to `MAX_MESSAGE_BYTES` at most.
#[tokio::test]
async fn a_message_past_its_byte_bound_closes_the_connection() {
    let (port, _rx, _stop) = pull().await;
    let mut s = greeted(port).await;
    let frame = vec![0u8; 1 << 20];
    for _ in 0..3 {
        s.write_all(&[MORE | LONG]).await.unwrap();
        s.write_all(&(frame.len() as u64).to_be_bytes()).await.unwrap();
        if s.write_all(&frame).await.is_err() {
            break;
        }
    }
    assert!(closed(&mut s).await);
}

/// A connection whose task ended in a panic gives its address's place back too: after
/// `MAX_PER_PEER` of them, one more from the same address is still served.
#[tokio::test]
async fn connections_that_failed_give_their_place_back() {
    let (port, mut rx, _stop) = pull().await;
    for _ in 0..MAX_PER_PEER {
        let mut s = greeted(port).await;
        s.write_all(&[0, 5]).await.unwrap();
        s.write_all(b"panic").await.unwrap();
        assert!(closed(&mut s).await, "its task ended");
    }
    let mut s = greeted(port).await;
    s.write_all(&[0, 2, b'o', b'k']).await.unwrap();
    assert_eq!(next(&mut rx).await, vec![Bytes::from_static(b"ok")]);
}
