use std::time::Duration;

use bytes::Bytes;
use handoff_core::Room;
use tokio::io::AsyncWriteExt;
use tokio::time::Instant;

use super::wire::Frame;
use super::*;
use crate::{Agent, Fault, FaultSwitch, FaultyTransfer, InboxConfig, KvPoll, SenderId};
use handoff_core::tls::test_certs::TestCa;

mod tls;

struct Pair {
    tasks: Tasks,
    tx: Agent,
    rx: Agent,
}

/// Two agents writing over the tcp wire itself (the same-host shared memory off: it has
/// tests of its own, in `shm/tests.rs`).
async fn pair(cfg: TcpConfig) -> Pair {
    let cfg = TcpConfig { shared_memory: false, ..cfg };
    let tasks = Tasks::new();
    let mk = |cfg: TcpConfig| {
        let tasks = tasks.clone();
        async move {
            let inbox = Arc::new(Inbox::new(InboxConfig::default()));
            let t = TcpTransfer::bind("127.0.0.1:0".parse().unwrap(), inbox.clone(), cfg, &tasks)
                .await
                .unwrap();
            Agent::new(Arc::new(t), inbox)
        }
    };
    Pair { tx: mk(cfg.clone()).await, rx: mk(cfg).await, tasks }
}

/// One byte range, as a sender's ranges.
fn span(r: std::ops::Range<u64>) -> Vec<std::ops::Range<u64>> {
    std::iter::once(r).collect()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn room() -> Room {
    Room::mint()
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>().into()
}

#[tokio::test]
async fn bytes_arrive_exact_across_split_frames_and_senders() {
    // A tiny max frame forces writes to be split over many frames.
    let p = pair(TcpConfig { max_frame: 4096, ..Default::default() }).await;
    let r = room();
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let half = 50_000u64;
    let id =
        p.rx.inbox()
            .register_region(r, 2 * half, [(a, span(0..half)), (b, span(half..2 * half))])
            .unwrap();
    let chunks = |seed: u8, base: u64| -> Vec<(Bytes, u64)> {
        (0..50).map(|i| (pattern(1000, seed + i as u8), base + i * 1000)).collect()
    };
    for (s, base, seed) in [(a, 0, 1u8), (b, half, 100u8)] {
        let w = WriteRequest::new(id, chunks(seed, base), r, s, 42, 10, 3);
        p.tx.post_write(&p.rx.addr(), w).await.unwrap();
    }
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    let want: Vec<u8> =
        chunks(1, 0).into_iter().chain(chunks(100, half)).flat_map(|(b, _)| b.to_vec()).collect();
    assert_eq!(got.buf, want);
    assert!(got.notices.iter().all(|n| n.first_token == 42 && n.room == r));
    p.tasks.shutdown().await;
}

/// A one-rank handshake for 8 bytes of region `id`, from `receiver`.
fn handshake(r: Room, receiver: AgentAddr, id: crate::RegionId) -> ConnectRequest {
    ConnectRequest {
        room: r,
        receiver,
        region: id,
        region_len: 8,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: None,
    }
}

#[tokio::test]
async fn handshake_reaches_the_sender_and_marks_the_region_connected() {
    let p = pair(TcpConfig::default()).await;
    let r = room();
    let id = p.rx.inbox().register_region(r, 8, [(SenderId::new(0, 0), span(0..8))]).unwrap();
    let req = handshake(r, p.rx.addr(), id);
    p.rx.connect(&p.tx.addr(), req.clone()).await.unwrap();
    assert_eq!(p.rx.inbox().poll(id), KvPoll::WaitingForInput);
    assert_eq!(p.tx.inbox().accept(r, 1, deadline()).await.unwrap(), vec![req]);
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn injected_faults_fail_the_region_at_verify() {
    let p = pair(TcpConfig::default()).await;
    let tasks = Tasks::new();
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let inner =
        TcpTransfer::bind("127.0.0.1:0".parse().unwrap(), inbox, TcpConfig::default(), &tasks)
            .await
            .unwrap();
    let switch = FaultSwitch::new();
    let faulty = FaultyTransfer::new(Arc::new(inner), switch.clone());
    let s = SenderId::new(0, 0);
    for (fault, want) in [
        (Fault::WrongRoom, "bootstrap_room mismatch"),
        (Fault::FlipByte, "checksum mismatch"),
        (Fault::Truncate, "short transfer"),
        (Fault::SenderGone, "timed out"),
    ] {
        let r = room();
        let id = p.rx.inbox().register_region(r, 4000, [(s, span(0..4000))]).unwrap();
        let pairs = (0..4).map(|i| (pattern(1000, i), u64::from(i) * 1000)).collect();
        switch.arm(fault, 1);
        let sent =
            faulty.post_write(&p.rx.addr(), WriteRequest::new(id, pairs, r, s, 1, 1, 0)).await;
        assert!(sent.is_err(), "{fault:?} must fail the sender's post too");
        let end = Instant::now() + Duration::from_millis(300);
        let err = p.rx.inbox().wait(id, end).await.unwrap_err().to_string();
        assert!(err.contains(want), "{fault:?}: {err}");
    }
    tasks.shutdown().await;
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn truncated_and_garbage_frames_close_only_their_connection() {
    let p = pair(TcpConfig::default()).await;
    let r = room();
    let s = SenderId::new(0, 0);
    let id = p.rx.inbox().register_region(r, 100, [(s, span(0..100))]).unwrap();
    let addr = p.rx.addr();

    // A write frame that promises 100 payload bytes, then the sender dies after 10: what
    // landed can never be completed (the sender is bound to the dead connection), so the
    // region fails at once rather than at its deadline.
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    let mut frame = Vec::new();
    frame.extend_from_slice(&(1u32 + 16 + 12 + 100).to_le_bytes());
    frame.push(2);
    frame.extend_from_slice(&id.0.to_le_bytes());
    frame.extend_from_slice(&s.0.to_le_bytes());
    frame.extend_from_slice(&1u32.to_le_bytes());
    frame.extend_from_slice(&0u64.to_le_bytes());
    frame.extend_from_slice(&100u32.to_le_bytes());
    frame.extend_from_slice(&[7u8; 10]);
    raw.write_all(&frame).await.unwrap();
    drop(raw);
    let err = p.rx.inbox().wait(id, deadline()).await.unwrap_err();
    assert!(
        matches!(&err, TransferError::Failed(m) if m.contains("broke mid-transfer")),
        "a truncated frame fails its region: {err}"
    );

    // Half a region written, then the connection closes with no notice: failed, fast.
    let id = p.rx.inbox().register_region(r, 100, [(s, span(0..100))]).unwrap();
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    let mut w = Vec::new();
    wire::write_pairs(&mut w, id, s, &[(Bytes::from_static(&[1; 50]), 0)], 1 << 20).await.unwrap();
    raw.write_all(&w).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(raw);
    let err = p.rx.inbox().wait(id, deadline()).await.unwrap_err().to_string();
    assert!(err.contains("closed mid-transfer"), "{err}");

    // Garbage: an absurd frame length.
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    raw.write_all(&u32::MAX.to_le_bytes()).await.unwrap();
    let ack = wire::read_frame(&mut raw, 1 << 20).await.unwrap();
    assert!(matches!(ack, Some(Frame::Ack(Err(m))) if m.contains("frame length")));

    // The agent still serves well-formed peers.
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    p.tx.post_write(&addr, w).await.unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    p.tasks.shutdown().await;
}

/// A forged write frame: `len` bytes at offset 0 of `region`, from sender 0.
fn forged(region: u64, len: usize) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&(1u32 + 16 + 12 + len as u32).to_le_bytes());
    f.push(2);
    f.extend_from_slice(&region.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&0u64.to_le_bytes());
    f.extend_from_slice(&(len as u32).to_le_bytes());
    f.extend(std::iter::repeat_n(9u8, len));
    f
}

/// Whether the peer closed `raw` (an ack first, maybe).
async fn closed(raw: &mut TcpStream) -> bool {
    let read = async {
        loop {
            match wire::read_frame(raw, 1 << 20).await {
                Ok(Some(Frame::Ack(_))) => continue,
                Ok(None) | Err(_) => return true,
                Ok(Some(_)) => return false,
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(2), read).await.unwrap_or(false)
}

#[tokio::test]
async fn with_a_token_nothing_is_read_before_the_hello() {
    let cfg = TcpConfig { token: Some("s3cret".into()), ..Default::default() };
    let p = pair(cfg).await;
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let addr = p.rx.addr();
    // A write without a hello, with the region's real id: refused, connection closed.
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    raw.write_all(&forged(id.0, 1)).await.unwrap();
    assert!(closed(&mut raw).await, "unauthenticated writer closed");
    // A wrong token, and a hello claiming more than a hello may hold: closed too.
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    wire::write_hello(&mut raw, "guess").await.unwrap();
    assert!(closed(&mut raw).await, "wrong token closed");
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    raw.write_all(&(64u32 << 20).to_le_bytes()).await.unwrap();
    assert!(closed(&mut raw).await, "no 64 MiB read before the hello");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Bootstrapping, "the region was not touched");
    // The agents with the token still talk.
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    p.tx.post_write(&addr, w).await.unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    // One without it cannot: its hello-less connection is refused.
    let stranger = pair(TcpConfig::default()).await;
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"nope"), 0)], r, s, 1, 1, 0);
    assert!(stranger.tx.post_write(&addr, w).await.is_err());
    p.tasks.shutdown().await;
    stranger.tasks.shutdown().await;
}

/// A handshake refused for another token fails as `Unauthorized` (another cluster token, no
/// fault of the peer), not as a refusal the frontend blamed the prefill for.
#[tokio::test]
async fn a_handshake_with_another_token_is_unauthorized() {
    let p = pair(TcpConfig { token: Some("s3cret".into()), ..Default::default() }).await;
    let other = pair(TcpConfig { token: Some("other".into()), ..Default::default() }).await;
    let r = room();
    let id = other.rx.inbox().register_region(r, 8, [(SenderId::new(0, 0), span(0..8))]).unwrap();
    let e = other.rx.connect(&p.tx.addr(), handshake(r, other.rx.addr(), id)).await.unwrap_err();
    assert!(matches!(e, TransferError::Unauthorized), "{e:?}");
    p.tasks.shutdown().await;
    other.tasks.shutdown().await;
}

#[tokio::test]
async fn forged_writes_never_touch_a_region_and_the_forger_loses_its_connection() {
    let p = pair(TcpConfig { max_unknown_writes: 16, ..Default::default() }).await;
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let addr = p.rx.addr();
    // A sprayer at small ids, as a peer knowing only the frame layout would.
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    let spray: Vec<u8> = (0..64u64).flat_map(|g| forged(g, 1)).collect();
    let _ = raw.write_all(&spray).await;
    assert!(closed(&mut raw).await, "the sprayer is cut off");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Bootstrapping, "the region was not touched");
    // The real sender's write goes through; then a second connection naming the same region
    // and sender is refused without touching it.
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    let mut first = WriteRequest { notice: None, ..w.clone() };
    first.pairs = vec![(Bytes::from_static(b"ok"), 0)];
    p.tx.post_write(&addr, first).await.unwrap();
    tokio::time::sleep(Duration::from_millis(50)).await;
    let mut raw = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    raw.write_all(&forged(id.0, 1)).await.unwrap();
    assert!(closed(&mut raw).await, "a second connection for a bound sender is cut off");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Transferring, "the region goes on");
    p.tasks.shutdown().await;
}

/// Resident memory of this process, in bytes.
fn rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kb * 1024
}

#[tokio::test]
async fn idle_and_trickling_peers_are_cut_off_and_excess_connections_wait() {
    let cfg = TcpConfig {
        max_inbound: 2,
        idle_timeout: Duration::from_millis(300),
        frame_timeout: Duration::from_millis(300),
        ..Default::default()
    };
    let p = pair(cfg).await;
    let addr = p.rx.addr();
    let dial = || TcpStream::connect((addr.ip.as_str(), addr.port));
    // One says nothing; one declares a frame and trickles: both hold the only two places.
    let mut idle = dial().await.unwrap();
    let mut trickler = dial().await.unwrap();
    // A hello of 1000 bytes (its length, then its kind), trickled.
    trickler.write_all(&[232, 3, 0, 0, 5]).await.unwrap();
    let started = Instant::now();
    // A real write meanwhile waits for a place instead of being refused.
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    let post = p.tx.post_write(&addr, w);
    let trickle = async {
        for _ in 0..20 {
            if trickler.write_all(&[0u8]).await.is_err() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let (posted, ()) = tokio::join!(post, trickle);
    posted.unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    let waited = started.elapsed();
    assert!(closed(&mut idle).await && closed(&mut trickler).await, "both cut off");
    assert!(waited >= Duration::from_millis(250), "the write waited for a place: {waited:?}");
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn a_thousand_peers_declaring_huge_frames_hold_little_memory() {
    let p = pair(TcpConfig { max_inbound: 2048, ..Default::default() }).await;
    let addr = p.rx.addr();
    let before = rss();
    let mut held = Vec::new();
    for _ in 0..1000 {
        let mut c = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
        // A 60 MiB write frame declared, 32 bytes of it sent.
        c.write_all(&(60u32 << 20).to_le_bytes()).await.unwrap();
        c.write_all(&[2u8; 32]).await.unwrap();
        held.push(c);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let grew = rss().saturating_sub(before);
    eprintln!(
        "1000 connections each declaring a 60 MiB frame: resident memory grew {} KiB",
        grew / 1024
    );
    assert!(grew < 256 << 20, "grew {grew} bytes");
    drop(held);
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn with_a_token_a_silent_connection_is_dropped_at_the_hello_deadline() {
    let cfg = TcpConfig {
        token: Some("s3cret".into()),
        hello_timeout: Duration::from_millis(200),
        ..Default::default()
    };
    let p = pair(cfg).await;
    let addr = p.rx.addr();
    let started = Instant::now();
    let mut silent = TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap();
    assert!(closed(&mut silent).await);
    let took = started.elapsed();
    assert!(took < Duration::from_secs(1), "held its place {took:?}, not the idle timeout");
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn with_a_token_strangers_holding_every_place_give_them_up_to_the_token_holders() {
    let cfg = TcpConfig {
        token: Some("s3cret".into()),
        max_inbound: 2,
        // Taken back at once (the grace has tests of its own, in `listen/tests.rs`).
        unproven_grace: Duration::ZERO,
        // Strangers could hold their places for an hour, were they not taken back.
        hello_timeout: Duration::from_secs(3600),
        ..Default::default()
    };
    let p = pair(cfg).await;
    let addr = p.rx.addr();
    let mut strangers = Vec::new();
    for _ in 0..2 {
        strangers.push(TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap());
    }
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    let posted = tokio::time::timeout(Duration::from_secs(30), p.tx.post_write(&addr, w)).await;
    assert!(matches!(posted, Ok(Ok(_))), "the token holder was kept out: {posted:?}");
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    assert!(closed(&mut strangers[0]).await, "the oldest stranger gave its place up");
    // The token holder's connection, proven at its hello, keeps its place: the next two
    // strangers take the other stranger's place, then each other's.
    for _ in 0..2 {
        strangers.push(TcpStream::connect((addr.ip.as_str(), addr.port)).await.unwrap());
    }
    assert!(closed(&mut strangers[1]).await && closed(&mut strangers[2]).await);
    p.tasks.shutdown().await;
}
