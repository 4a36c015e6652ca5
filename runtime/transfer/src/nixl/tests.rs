//! Two handoff agents over the nixl backend: real NIXL agents (the wheel's library) in one
//! process, UCX over TCP on loopback. They fail, saying what to install, without the library.

use std::time::Duration;

use bytes::Bytes;
use handoff_core::Room;
use tokio::time::Instant;

use super::*;
use crate::{Agent, InboxConfig, KvPoll, SenderId};

struct Pair {
    tasks: Tasks,
    tx: Agent,
    rx: Agent,
    tx_backend: Arc<NixlTransfer>,
    rx_backend: Arc<NixlTransfer>,
}

async fn agent(tasks: &Tasks, token: Option<&str>) -> (Agent, Arc<NixlTransfer>) {
    let nc = NixlConfig { token: token.map(String::from), ..NixlConfig::default() };
    agent_with(tasks, nc).await
}

async fn agent_with(tasks: &Tasks, nc: NixlConfig) -> (Agent, Arc<NixlTransfer>) {
    let cfg = InboxConfig { token: nc.token.clone(), ..InboxConfig::default() };
    let inbox = Arc::new(Inbox::new(cfg));
    let control = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let t = Arc::new(NixlTransfer::serve(control, None, inbox.clone(), nc, tasks).unwrap());
    (Agent::new(t.clone(), inbox), t)
}

async fn pair(token: Option<&str>) -> Pair {
    let tasks = Tasks::new();
    let (tx, tx_backend) = agent(&tasks, token).await;
    let (rx, rx_backend) = agent(&tasks, token).await;
    Pair { tasks, tx, rx, tx_backend, rx_backend }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect::<Vec<_>>().into()
}

fn connect_request(
    p: &Pair,
    r: Room,
    id: RegionId,
    len: u64,
    token: Option<&str>,
) -> ConnectRequest {
    ConnectRequest {
        room: r,
        receiver: p.rx.addr(),
        region: id,
        region_len: len,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: token.map(String::from),
    }
}

/// Registers a region of `len` bytes for `senders` (equal parts), and shakes hands.
async fn region(
    p: &Pair,
    r: Room,
    len: u64,
    senders: &[SenderId],
    token: Option<&str>,
) -> RegionId {
    let part = len / senders.len() as u64;
    let plan = senders.iter().enumerate().map(|(i, s)| {
        let start = i as u64 * part;
        (*s, std::iter::once(start..start + part).collect())
    });
    let id = p.rx.inbox().register_region(r, len, plan).unwrap();
    p.rx.connect(&p.tx.addr(), connect_request(p, r, id, len, token)).await.unwrap();
    assert_eq!(p.tx.inbox().accept(r, 1, deadline()).await.unwrap().len(), 1);
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kv_moves_between_handoff_agents_and_is_verified() {
    let p = pair(Some("secret")).await;
    let r = Room::mint();
    let s = SenderId::new(0, 0);
    let len = 3_000_000u64;
    let id = region(&p, r, len, &[s], Some("secret")).await;
    assert_eq!(p.rx.inbox().poll(id), KvPoll::WaitingForInput);
    assert_eq!(p.rx_backend.open_staging(), 1);
    // Many pairs, out of order: each lands where its offset says.
    let chunks: Vec<(Bytes, u64)> =
        (0..30u64).rev().map(|i| (pattern(100_000, i as u8), i * 100_000)).collect();
    let w = WriteRequest::new(id, chunks.clone(), r, s, 7, 10, 0);
    p.tx.post_write(&p.rx.addr(), w).await.unwrap();
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    let mut want = vec![0u8; len as usize];
    for (b, off) in &chunks {
        want[*off as usize..*off as usize + b.len()].copy_from_slice(b);
    }
    assert!(got.buf == want, "bytes differ");
    assert_eq!(got.notices[0].first_token, 7);
    assert_eq!(p.rx_backend.open_staging(), 0, "the staging slot is given back at the notice");
    let arena = p.rx_backend.shared.staging.arena();
    assert_eq!(arena.free_bytes(), NixlConfig::default().staging_bytes, "all of it free again");
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strangers_holding_every_control_place_give_them_up_to_a_token_holder() {
    let tasks = Tasks::new();
    let nc = NixlConfig {
        token: Some("secret".into()),
        max_inbound: 2,
        // Taken back at once (the grace has tests of its own, in `listen/tests.rs`).
        unproven_grace: Duration::ZERO,
        // Strangers could hold their places for an hour, were they not taken back.
        control_timeout: Duration::from_secs(3600),
        ..NixlConfig::default()
    };
    let (tx, tx_backend) = agent_with(&tasks, nc.clone()).await;
    let (rx, rx_backend) = agent_with(&tasks, nc).await;
    let p = Pair { tasks, tx, rx, tx_backend, rx_backend };
    let mut strangers = crate::listen::tests::strangers(&p.tx.addr(), 2).await;
    let senders = [SenderId::new(0, 0)];
    let shaken = region(&p, Room::mint(), 64, &senders, Some("secret"));
    assert!(
        tokio::time::timeout(Duration::from_secs(30), shaken).await.is_ok(),
        "the token holder's handshake was kept out"
    );
    let closed = crate::listen::tests::closed(&mut strangers[0]).await;
    assert!(closed, "the oldest stranger kept its place");
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_senders_write_their_own_ranges_of_one_region() {
    let p = pair(None).await;
    let (tx2, _) = agent(&p.tasks, None).await;
    let r = Room::mint();
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let half = 200_000u64;
    let plan =
        [(a, std::iter::once(0..half).collect()), (b, std::iter::once(half..2 * half).collect())];
    let id = p.rx.inbox().register_region(r, 2 * half, plan).unwrap();
    for peer in [p.tx.addr(), tx2.addr()] {
        p.rx.connect(&peer, connect_request(&p, r, id, 2 * half, None)).await.unwrap();
    }
    let (wa, wb) = (pattern(half as usize, 1), pattern(half as usize, 2));
    let rx = p.rx.addr();
    let post_a = p.tx.post_write(&rx, WriteRequest::new(id, vec![(wa.clone(), 0)], r, a, 5, 1, 0));
    let post_b =
        tx2.post_write(&rx, WriteRequest::new(id, vec![(wb.clone(), half)], r, b, 5, 1, 0));
    let (ra, rb) = tokio::join!(post_a, post_b);
    ra.unwrap();
    rb.unwrap();
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    assert!(got.buf[..half as usize] == wa[..] && got.buf[half as usize..] == wb[..]);
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_room_a_write_outside_its_range_or_a_missing_token_is_refused() {
    let p = pair(Some("secret")).await;
    let s = SenderId::new(0, 0);
    // Right bytes, wrong room in the notice: the region fails by name.
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], Some("secret")).await;
    let w = WriteRequest::new(id, vec![(pattern(1000, 3), 0)], Room::mint(), s, 1, 1, 0);
    let e = p.tx.post_write(&p.rx.addr(), w).await.unwrap_err();
    assert!(e.to_string().contains("bootstrap_room mismatch"), "{e}");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Failed);
    // Past the region's end: refused by the sender before anything moves.
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], Some("secret")).await;
    let w = WriteRequest::new(id, vec![(pattern(100, 3), 950)], r, s, 1, 1, 0);
    assert!(matches!(p.tx.post_write(&p.rx.addr(), w).await, Err(TransferError::Malformed(_))));
    assert_eq!(p.rx_backend.open_staging(), 1, "its region is still open");
    p.rx.inbox().release(id);
    // A handshake without the token: refused, nothing pending at the sender.
    let r = Room::mint();
    let id =
        p.rx.inbox().register_region(r, 1000, [(s, std::iter::once(0..1000).collect())]).unwrap();
    let e = p.rx.connect(&p.tx.addr(), connect_request(&p, r, id, 1000, None)).await.unwrap_err();
    assert!(e.to_string().contains("unauthorized"), "{e}");
    assert_eq!(p.tx.inbox().pending_rooms(), 0);
    assert_eq!(
        p.rx_backend.open_staging(),
        0,
        "closed regions' buffers are swept, a refused one not kept"
    );
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_changed_after_the_write_fail_the_checksum() {
    // A notice whose segments do not hold what was hashed (here: a notice for other bytes
    // than the ones written) fails verification: the receiver hashes what landed.
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 4096, &[s], None).await;
    let mut w = WriteRequest::new(id, vec![(pattern(4096, 9), 0)], r, s, 1, 1, 0);
    let claimed = WriteRequest::new(id, vec![(pattern(4096, 10), 0)], r, s, 1, 1, 0);
    w.notice = claimed.notice;
    let e = p.tx.post_write(&p.rx.addr(), w).await.unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_notice_for_a_handshake_never_made_is_forbidden() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    // The notice claims to come from another sender address than the handshake went to.
    let notice = WriteRequest::new(id, vec![(pattern(1000, 1), 0)], r, s, 1, 1, 0).notice.unwrap();
    let msg =
        Control::Notice { region: id, ticket: 1, notice, segments: vec![(0, 1000)], token: None };
    let e = control::call(&p.rx.addr(), &msg, Duration::from_secs(5)).await.unwrap_err();
    assert!(e.to_string().contains("no nixl handshake"), "{e}");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::WaitingForInput, "nothing else changed");
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bytes_written_anywhere_but_where_the_notice_says_never_verify() {
    // Every sender holds the staging arena's key (UCX over TCP would not check keys anyway):
    // what keeps a sender's bytes where they belong is the inbox, which takes them from the
    // segments its notice lists, and the checksum.
    let p = pair(None).await;
    let (tx2, tx2_backend) = agent(&p.tasks, None).await;
    let r = Room::mint();
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let plan = [(a, std::iter::once(0..500).collect()), (b, std::iter::once(500..1000).collect())];
    let id = p.rx.inbox().register_region(r, 1000, plan).unwrap();
    for peer in [p.tx.addr(), tx2.addr()] {
        p.rx.connect(&peer, connect_request(&p, r, id, 1000, None)).await.unwrap();
    }
    assert_eq!(p.rx_backend.open_staging(), 1, "one slot for the region, shared");
    // The second sender's bytes for [500, 1000) land over the first one's [0, 500).
    lock(&tx2_backend.shared.remotes).get_mut(&id).unwrap().addr -= 500;
    let w = WriteRequest::new(id, vec![(pattern(500, 4), 500)], r, b, 1, 1, 0);
    let e = tx2.post_write(&p.rx.addr(), w).await.unwrap_err();
    assert!(e.to_string().contains("checksum mismatch"), "{e}");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Failed);
    // The first sender may still be writing: the slot rests instead of being lent again.
    assert_eq!(p.rx_backend.open_staging(), 0);
    assert_eq!(p.rx_backend.shared.staging.resting(), 1);
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_write_lands_part_by_part_and_one_notice_covers_every_part() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 400_000, &[s], None).await;
    let mut stream = p.tx.open_write(&p.rx.addr(), id, s).await.unwrap();
    for i in 0..4u64 {
        stream.post(vec![(pattern(100_000, i as u8), i * 100_000)]).await.unwrap();
        let written = lock(&p.tx_backend.shared.remotes)[&id].written.len();
        assert_eq!(written, i as usize + 1, "part {i} written at once, not held");
        assert_ne!(p.rx.inbox().poll(id), KvPoll::Success, "nothing verified before the notice");
    }
    stream.finish(r, 3, 1, 0).await.unwrap();
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    let want: Vec<u8> = (0..4).flat_map(|i| pattern(100_000, i).to_vec()).collect();
    assert!(got.buf == want);
    p.tasks.shutdown().await;
}

#[test]
fn the_arena_lends_whole_pages_zeroed_and_coalesces_them_back() {
    let engine = Engine::start("arena-test", Duration::from_millis(10)).unwrap();
    let arena = engine.arena(64 << 10).unwrap();
    let a = arena.take(5000).unwrap();
    let b = arena.take(4096).unwrap();
    let c = arena.take(1).unwrap();
    assert_eq!((a.offset(), b.offset(), c.offset()), (0, 8192, 12288), "whole pages, first fit");
    assert!(arena.take(60 << 10).is_none(), "not that much left");
    arena.give(b);
    arena.give(a);
    arena.give(c);
    assert_eq!(arena.free_bytes(), 64 << 10);
    let whole = arena.take(64 << 10).expect("coalesced into one range again");
    assert_eq!(whole.offset(), 0);
    // A slot given back dirty comes back zeroed.
    let addr = arena.registered().addr();
    let peer = Engine::start("arena-peer", Duration::from_millis(10)).unwrap();
    let name = peer.load(engine.introduction()).unwrap();
    peer.load(&engine.metadata_of(arena.registered()).unwrap()).unwrap();
    let src = peer.register(memory::Pinned::from_vec(vec![7u8; 4096])).unwrap();
    let seg = [Segment { src: 0, dst: addr as u64 + 4096, len: 4096 }];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    peer.write(src, &seg, &name, deadline).unwrap();
    let landed = arena.segment(&whole, 4096, 4096).unwrap();
    assert!(landed.iter().all(|&x| x == 7), "the write landed");
    assert!(arena.segment(&whole, 60 << 10, 8 << 10).is_none(), "nothing past the slot");
    arena.give(whole);
    let again = arena.take(64 << 10).unwrap();
    let all = arena.segment(&again, 0, 64 << 10).unwrap();
    assert!(all.iter().all(|&x| x == 0), "zeroed when lent again");
}

#[test]
fn a_slot_rests_when_a_failed_handshake_may_still_write_into_it() {
    let engine = Engine::start("staging-test", Duration::from_millis(10)).unwrap();
    let staging = staging::Staging::new(engine.arena(1 << 20).unwrap(), Duration::from_secs(60), 8);
    let (r, now) = (RegionId(7), Instant::now());
    let (_, first) = staging.lend(r, 4096, now, |_| true).unwrap();
    let (_, second) = staging.lend(r, 4096, now, |_| true).unwrap();
    assert_eq!(staging.regions(), 1, "one slot for the region's senders");
    // The first handshake's answer was lost: that sender may write, and never notice.
    staging.cancel(r, first, now);
    let slot = staging.redeem(r, second).unwrap();
    assert!(staging.redeem(r, first).is_err(), "a cancelled ticket is not redeemed");
    drop(slot);
    staging.settle(r, false, now);
    assert_eq!((staging.regions(), staging.resting()), (0, 1), "rests, not lent again at once");
    // Once rested, the next handshake takes it back into the arena.
    staging.lend(RegionId(8), 4096, now + Duration::from_secs(61), |_| true).unwrap();
    assert_eq!(staging.resting(), 0);
}

/// A handshake asks whether regions are still open without holding the staging table: that
/// question takes a region's lock, which a notice holds while it copies, and every other
/// handshake and notice waited on the table behind it. Here the question itself looks at
/// the table, which would never return if the table were held.
#[test]
fn a_handshake_asks_about_regions_without_holding_the_table() {
    let engine = Engine::start("staging-test", Duration::from_millis(10)).unwrap();
    let staging =
        Arc::new(staging::Staging::new(engine.arena(1 << 20).unwrap(), Duration::from_secs(60), 8));
    let now = Instant::now();
    staging.lend(RegionId(1), 4096, now, |_| true).unwrap();
    let (done, finished) = std::sync::mpsc::channel();
    let s = staging.clone();
    let asking = std::thread::spawn(move || {
        let lent = s.lend(RegionId(2), 4096, now, |id| id == RegionId(2) || s.regions() > 5);
        let _ = done.send(lent.map(|_| s.regions()));
    });
    let lent = finished.recv_timeout(Duration::from_secs(10)).expect("the handshake returned");
    assert_eq!(lent.unwrap(), 1, "the closed region's slot taken back, the new one lent");
    // The thread's clone of the staging (and its NIXL registration) goes before the engine,
    // on this thread: let go on the other while the process exits, NIXL's teardown crashed
    // it once (SIGSEGV after the test had passed).
    asking.join().unwrap();
    drop(staging);
    drop(engine);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_past_its_lifetime_is_not_written_for() {
    // The receiver may have lent its slot to another request by then.
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    let ttl = NixlConfig::default().handshake_ttl;
    let old = Instant::now().checked_sub(ttl + Duration::from_secs(1)).unwrap();
    lock(&p.tx_backend.shared.remotes).get_mut(&id).unwrap().since = old;
    let w = WriteRequest::new(id, vec![(pattern(1000, 1), 0)], r, s, 1, 1, 0);
    let e = p.tx.post_write(&p.rx.addr(), w).await.unwrap_err();
    assert!(e.to_string().contains("no nixl handshake"), "{e}");
    p.tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_nixl_dropped_is_loaded_again_after_a_failed_write() {
    // A receiver's metadata is loaded once and its later handshakes reuse it; should NIXL
    // drop the peer (it does when the connection is lost), the next write fails and the
    // next handshake loads it again.
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let write = |id, r| WriteRequest::new(id, vec![(pattern(1000, 2), 0)], r, s, 1, 1, 0);
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    p.tx.post_write(&p.rx.addr(), write(id, r)).await.unwrap();
    let name = p.rx_backend.agent_name().to_owned();
    p.tx_backend.shared.engine.forget(&name);
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    assert!(p.tx.post_write(&p.rx.addr(), write(id, r)).await.is_err(), "its metadata is gone");
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    p.tx.post_write(&p.rx.addr(), write(id, r)).await.unwrap();
    assert_eq!(lock(&p.tx_backend.shared.loaded).len(), 1);
    p.tasks.shutdown().await;
}

/// A handshake whose request ended without taking it (its room closed at the sender) does not
/// hold a place in the sender's table of remotes: when the table is full it is swept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_rooms_remote_gives_its_place_up() {
    let tasks = Tasks::new();
    // The sender's table holds two.
    let (tx, tx_backend) =
        agent_with(&tasks, NixlConfig { max_open: 2, ..Default::default() }).await;
    let (rx, rx_backend) = agent_with(&tasks, NixlConfig::default()).await;
    let p = Pair { tasks, tx, rx, tx_backend, rx_backend };
    let ended = Room::mint();
    shake(&p, ended).await.unwrap();
    p.tx.inbox().close_room(ended);
    shake(&p, Room::mint()).await.unwrap();
    // The table holds two: the ended room's is swept for the third.
    shake(&p, Room::mint()).await.expect("the closed room's remote gave its place up");
    p.tasks.shutdown().await;
}

/// A 64-byte region for `r` at the receiver, and its handshake with the sender (not taken).
async fn shake(p: &Pair, r: Room) -> Result<(), TransferError> {
    let s = SenderId::new(0, 0);
    let id = p.rx.inbox().register_region(r, 64, [(s, std::iter::once(0..64).collect())]);
    let req = connect_request(p, r, id.unwrap(), 64, None);
    p.rx.connect(&p.tx.addr(), req).await
}

/// A write with no time left is not posted; one whose deadline passes while it is in
/// progress keeps its source (UCX may still read it) until NIXL says it ended, then frees it.
#[test]
fn a_failed_write_keeps_its_source_until_nixl_ends_it() {
    let engine = Engine::start("kept-dst", Duration::from_millis(10)).unwrap();
    let len = 256 << 20;
    let arena = engine.arena(len).unwrap();
    let peer = Engine::start("kept-src", Duration::from_millis(10)).unwrap();
    let name = peer.load(engine.introduction()).unwrap();
    peer.load(&engine.metadata_of(arena.registered()).unwrap()).unwrap();
    let seg = [Segment { src: 0, dst: arena.registered().addr() as u64, len }];
    let src = peer.register(memory::Pinned::from_vec(vec![7u8; len])).unwrap();
    let e = peer.write(src, &seg, &name, std::time::Instant::now()).unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    assert_eq!(peer.kept_bytes(), 0, "not posted, nothing kept");
    // 256 MiB in 20 ms over loopback TCP (13 GB/s): still in progress at its deadline.
    let src = peer.register(memory::Pinned::from_vec(vec![7u8; len])).unwrap();
    let by = std::time::Instant::now() + Duration::from_millis(20);
    let e = peer.write(src, &seg, &name, by).unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "{e}");
    assert_eq!(peer.kept_bytes(), len, "kept while NIXL has it");
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while peer.kept_bytes() > 0 {
        assert!(std::time::Instant::now() < until, "never freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(peer.leaked_bytes(), 0, "freed once complete, not leaked");
}
