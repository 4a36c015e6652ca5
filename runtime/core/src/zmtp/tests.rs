use tokio::io::AsyncReadExt;
use tokio::net::TcpListener;
use zeromq::{PullSocket, Socket, SocketRecv};

use super::*;

/// Our PUSH reaches a ZMQ PULL socket of another implementation: short and long frames, in
/// order.
#[tokio::test]
async fn our_push_reaches_a_zmq_pull_socket() {
    let mut pull = PullSocket::new();
    let zeromq::Endpoint::Tcp(_, port) = pull.bind("tcp://127.0.0.1:0").await.unwrap() else {
        panic!("a tcp endpoint")
    };
    let mut push =
        Connection::connect(&format!("127.0.0.1:{port}"), b"PUSH", b"PULL").await.unwrap();
    let long = Bytes::from(vec![3u8; 300]);
    push.send(&[Bytes::from_static(b"a"), long.clone()]).await.unwrap();
    push.send(&[Bytes::from_static(b"b")]).await.unwrap();
    let got = |m: zeromq::ZmqMessage| m.into_vec();
    assert_eq!(got(pull.recv().await.unwrap()), vec![Bytes::from_static(b"a"), long]);
    assert_eq!(got(pull.recv().await.unwrap()), vec![Bytes::from_static(b"b")]);
}

/// A peer that is not a PULL (another socket type, or a stranger)
/// is refused at connect; one that sends a huge frame after its READY changes nothing (a
/// PUSH never reads after its handshake).
#[tokio::test]
async fn our_push_connects_only_to_a_pull_and_keeps_nothing_it_sends() {
    async fn peer(answer: Vec<u8>) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let _ = s.write_all(&answer).await;
            let mut sink = Vec::new();
            let _ = s.read_to_end(&mut sink).await;
        });
        addr
    }
    let greeted = |kind: &[u8]| [&greeting()[..], &ready(kind)].concat();
    for (answer, why) in [
        (greeted(b"PUB"), "another socket type"),
        (b"HTTP/1.1 400 Bad Request\r\n\r\n".repeat(4), "no ZMTP signature"),
    ] {
        let e = Connection::connect(&peer(answer).await, b"PUSH", b"PULL")
            .await
            .err()
            .expect("refused");
        assert!(e.to_string().contains(why), "{e}");
    }
    let mut hostile = greeted(b"PULL");
    hostile.extend_from_slice(&[LONG]);
    hostile.extend_from_slice(&0x7fff_ffff_fff0_0000u64.to_be_bytes());
    let mut push = Connection::connect(&peer(hostile).await, b"PUSH", b"PULL").await.unwrap();
    push.send(&[Bytes::from_static(b"still here")]).await.unwrap();
}

/// A ROUTER that answers a REQ with a frame declaring 2^63 bytes: the receive fails with the
/// reason, nothing allocated for it, where the `zeromq` crate aborted the process.
#[tokio::test]
async fn a_huge_frame_in_an_answer_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        handshake(&mut s, b"ROUTER", b"REQ").await.unwrap();
        let _ = read_message(&mut s, Limits::default()).await.unwrap();
        let mut answer = vec![MORE, 0, LONG];
        answer.extend_from_slice(&0x7fff_ffff_fff0_0000u64.to_be_bytes());
        s.write_all(&answer).await.unwrap();
        let mut sink = Vec::new();
        let _ = s.read_to_end(&mut sink).await;
    });
    let mut req = Connection::connect(&addr, b"REQ", b"ROUTER").await.unwrap();
    req.send(&[Bytes::new(), Bytes::from_static(b"get_meta_msg")]).await.unwrap();
    assert!(matches!(req.recv().await, Err(ZmtpError::Oversized(0x7fff_ffff_fff0_0000))));
}

/// A PUSH learns that its peer closed (a restarted rank) before it writes into the void.
#[tokio::test]
async fn a_push_sees_its_peer_close() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (close, closing) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        handshake(&mut s, b"PULL", b"PUSH").await.unwrap();
        s.write_all(&command(b"\x04PING\x00\x00")).await.unwrap();
        let _ = closing.await;
    });
    let push = Connection::connect(&addr, b"PUSH", b"PULL").await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    assert!(!push.peer_closed(), "open, whatever it sent");
    drop(close);
    let mut closed = false;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        closed = push.peer_closed();
        if closed {
            break;
        }
    }
    assert!(closed, "its close is seen");
}

/// A peer that begins a message and stalls loses its connection after `within` (before, it
/// held it, and what it had sent, for as long as it liked); one idle between messages for
/// longer than that keeps it, and its next message is read.
#[tokio::test]
async fn a_message_begun_must_end_in_time_but_a_connection_may_idle() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let within = Duration::from_millis(300);
    let limits = Limits { within, ..Limits::default() };
    let pulling = async {
        let mut conns = Vec::new();
        for _ in 0..2 {
            let (s, _) = listener.accept().await.unwrap();
            let c = Connection::accept(s, b"PULL", b"PUSH").await.unwrap();
            conns.push(c.with_limits(limits));
        }
        let guard = Duration::from_secs(10);
        let [stalling, idling] = &mut conns[..] else { unreachable!() };
        let (stalled, idle) = tokio::join!(
            tokio::time::timeout(guard, stalling.recv()),
            tokio::time::timeout(guard, idling.recv()),
        );
        (stalled.expect("gave up"), idle.expect("read"))
    };
    let pushing = async {
        let mut stalling = Connection::connect(&addr, b"PUSH", b"PULL").await.unwrap();
        let mut idling = Connection::connect(&addr, b"PUSH", b"PULL").await.unwrap();
        // The first frame of two, then nothing.
        stalling.stream.write_all(&[MORE, 3, b'a', b'b', b'c']).await.unwrap();
        tokio::time::sleep(within * 4).await;
        idling
            .send(&[Bytes::from_static(b"late"), Bytes::from_static(b"but whole")])
            .await
            .unwrap();
        (stalling, idling)
    };
    let ((stalled, idle), _held) = tokio::join!(pulling, pushing);
    assert!(matches!(stalled, Err(ZmtpError::Stalled(_))), "{stalled:?}");
    assert_eq!(idle.unwrap(), [Bytes::from_static(b"late"), Bytes::from_static(b"but whole")]);
}
