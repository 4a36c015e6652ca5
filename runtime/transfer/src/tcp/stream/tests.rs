//! Streamed writes over tcp, its sockets and its same-host shm path alike (`shm::tests`
//! checks that its streams do go through the window): parts land as they are posted, one
//! notice verifies the whole, and a stream that leaves bytes out is refused at its notice.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use handoff_core::{Room, Tasks};
use tokio::time::Instant;

use super::super::TcpConfig;
use crate::{
    Agent, FaultSwitch, FaultyTransfer, Inbox, InboxConfig, KvPoll, SenderId, TcpTransfer,
    TransferBackend, TransferError,
};

/// A tcp agent on loopback; with `shared_memory`, writes to its peers here go through shm.
async fn agent(tasks: &Tasks, shared_memory: bool) -> (Agent, Arc<dyn TransferBackend>) {
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let addr = "127.0.0.1:0".parse().unwrap();
    let cfg = TcpConfig { shared_memory, ..Default::default() };
    let t: Arc<dyn TransferBackend> =
        Arc::new(TcpTransfer::bind(addr, inbox.clone(), cfg, tasks).await.unwrap());
    (Agent::new(t.clone(), inbox), t)
}

fn part(i: u8) -> Bytes {
    (0..1000).map(|j| (j as u8).wrapping_mul(7).wrapping_add(i)).collect::<Vec<_>>().into()
}

/// A region of `len` bytes at `rx`, all of it one sender's, and that sender's write to it
/// opened at `tx`.
async fn open(
    tx: &Agent,
    rx: &Agent,
    len: u64,
) -> (Room, crate::RegionId, SenderId, crate::WriteStream) {
    let (room, s) = (Room::mint(), SenderId::new(0, 0));
    let id = rx.inbox().register_region(room, len, [(s, std::iter::once(0..len).collect())]);
    let id = id.unwrap();
    (room, id, s, tx.open_write(&rx.addr(), id, s).await.unwrap())
}

/// Waits until region `id` of `rx` is in `state` (5 s at most).
async fn until(rx: &Agent, id: crate::RegionId, state: KvPoll) {
    let end = Instant::now() + Duration::from_secs(5);
    while rx.inbox().poll(id) != state {
        assert!(Instant::now() < end, "region never reached {state:?}: {:?}", rx.inbox().poll(id));
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

#[tokio::test]
async fn parts_land_as_they_are_posted_and_one_notice_verifies_them_all() {
    for shm in [false, true] {
        let tasks = Tasks::new();
        let ((tx, _), (rx, _)) = (agent(&tasks, shm).await, agent(&tasks, shm).await);
        let (room, id, _, mut w) = open(&tx, &rx, 3000).await;
        w.post(vec![(part(1), 0)]).await.unwrap();
        // The first part is in the region before the others exist: nothing handed on yet.
        until(&rx, id, KvPoll::Transferring).await;
        w.post(vec![(part(3), 2000)]).await.unwrap();
        w.post(vec![(part(2), 1000)]).await.unwrap();
        w.finish(room, 42, 3, 1).await.unwrap();
        let got = rx.inbox().wait(id, Instant::now() + Duration::from_secs(5)).await.unwrap();
        let want: Vec<u8> = [part(1), part(2), part(3)].iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(got.buf, want, "shm: {shm}");
        assert_eq!((got.notices[0].bytes, got.notices[0].first_token), (3000, 42));
        tasks.shutdown().await;
    }
}

/// A part of several pieces, an empty one and a small one, over the sockets and over shm:
/// the connection's sums (each part before it goes over the sockets, piece by piece as it is
/// copied over shm) are those a whole write computes first, and the receiver verifies them.
#[tokio::test]
async fn a_streams_parts_are_summed_as_a_whole_write_sums_them() {
    for shm in [false, true] {
        let tasks = Tasks::new();
        let (tx, rx) = (agent(&tasks, shm).await.0, agent(&tasks, shm).await.0);
        let long = 3 * crate::inbox::PIECE + 5;
        let big: Vec<u8> = (0..long).map(|j| (j as u8).wrapping_mul(31)).collect();
        let pairs = vec![(Bytes::from(big), 1000), (Bytes::new(), 0), (part(9), 0)];
        let len = 1000 + long as u64;
        let (room, id, s, mut w) = open(&tx, &rx, len).await;
        w.post(pairs[..2].to_vec()).await.unwrap();
        w.post(pairs[2..].to_vec()).await.unwrap();
        w.finish(room, 42, 3, 1).await.unwrap();
        let got = rx.inbox().wait(id, Instant::now() + Duration::from_secs(5)).await.unwrap();
        let whole = crate::WriteRequest::new(id, pairs, room, s, 42, 3, 1).notice.unwrap();
        assert_eq!(got.notices[0], whole, "shm: {shm}");
        tasks.shutdown().await;
    }
}

#[tokio::test]
async fn a_stream_that_leaves_bytes_out_is_refused_at_its_notice() {
    for shm in [false, true] {
        let tasks = Tasks::new();
        let ((tx, _), (rx, _)) = (agent(&tasks, shm).await, agent(&tasks, shm).await);
        let (room, id, _, mut w) = open(&tx, &rx, 2000).await;
        w.post(vec![(part(1), 0)]).await.unwrap();
        let refused = w.finish(room, 42, 2, 0).await;
        assert!(matches!(refused, Err(TransferError::Rejected(_))), "shm {shm}: {refused:?}");
        assert_eq!(rx.inbox().poll(id), KvPoll::Failed);
        tasks.shutdown().await;
    }
}

/// A backend without streams (here the fault injector over tcp) holds the parts: nothing
/// lands before the end, then everything, verified the same way.
#[tokio::test]
async fn without_a_stream_the_parts_travel_whole_at_the_end() {
    let tasks = Tasks::new();
    let ((_, tcp), (rx, _)) = (agent(&tasks, false).await, agent(&tasks, false).await);
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let tx = Agent::new(Arc::new(FaultyTransfer::new(tcp, FaultSwitch::new())), inbox);
    let (room, id, _, mut w) = open(&tx, &rx, 2000).await;
    w.post(vec![(part(1), 0)]).await.unwrap();
    w.post(vec![(part(2), 1000)]).await.unwrap();
    w.finish(room, 7, 2, 0).await.unwrap();
    let got = rx.inbox().wait(id, Instant::now() + Duration::from_secs(5)).await.unwrap();
    assert_eq!(got.buf.len(), 2000);
    tasks.shutdown().await;
}

/// A pair longer than the largest frame (a layer's run of a long prompt), streamed and
/// written whole, over the sockets and over shm: it goes as segments that each fit a frame,
/// and the receiver verifies the notice the write computed.
#[tokio::test]
async fn a_pair_longer_than_a_frame_lands_and_verifies() {
    let long = TcpConfig::default().max_frame + 1000;
    let big: Bytes = (0..long).map(|j| (j as u8).wrapping_mul(31) ^ (j >> 20) as u8).collect();
    for shm in [false, true] {
        let tasks = Tasks::new();
        let (tx, rx) = (agent(&tasks, shm).await.0, agent(&tasks, shm).await.0);
        let (room, id, s, mut w) = open(&tx, &rx, long as u64).await;
        w.post(vec![(big.clone(), 0)]).await.unwrap();
        w.finish(room, 42, 3, 1).await.unwrap();
        let got = rx.inbox().wait(id, Instant::now() + Duration::from_secs(20)).await.unwrap();
        assert!(got.buf == big, "streamed, shm: {shm}");
        let whole = crate::WriteRequest::new(id, vec![(big.clone(), 0)], room, s, 42, 3, 1);
        assert_eq!(got.notices[0], whole.notice.unwrap(), "shm: {shm}");

        let room = Room::mint();
        let id = rx.inbox().register_region(
            room,
            long as u64,
            [(s, std::iter::once(0..long as u64).collect())],
        );
        let id = id.unwrap();
        let req = crate::WriteRequest::new(id, vec![(big.clone(), 0)], room, s, 42, 3, 1);
        tx.post_write(&rx.addr(), req).await.unwrap();
        let got = rx.inbox().wait(id, Instant::now() + Duration::from_secs(20)).await.unwrap();
        assert!(got.buf == big, "whole, shm: {shm}");
        if !shm {
            // Made without `WriteRequest::new`: the sockets refuse it before sending a byte.
            let id = rx
                .inbox()
                .register_region(room, 10, [(s, std::iter::once(0..10).collect())])
                .unwrap();
            let req = crate::WriteRequest { pairs: vec![(big.clone(), 0)], ..whole };
            let refused =
                tx.post_write(&rx.addr(), crate::WriteRequest { region: id, ..req }).await;
            let fits = |m: &str| m.contains("does not fit a frame");
            assert!(matches!(&refused, Err(TransferError::Malformed(m)) if fits(m)), "{refused:?}");
            // Nothing was sent: the region is still waiting for its bytes.
            assert_eq!(rx.inbox().poll(id), KvPoll::Bootstrapping);
        }
        tasks.shutdown().await;
    }
}
