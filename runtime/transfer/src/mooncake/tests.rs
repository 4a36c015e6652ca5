//! Two handoff agents over the mooncake backend (the wheel's side is in
//! `runtime/cli/tests/interop`).

use std::time::Duration;

use bytes::Bytes;
use handoff_core::Room;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

use super::*;
use crate::{Agent, InboxConfig, KvPoll, SenderId};

struct Pair {
    tasks: Tasks,
    tx: Agent,
    rx: Agent,
    /// The receiver's backend, for its data port and exposure.
    rx_backend: Arc<MooncakeTransfer>,
}

async fn agent(tasks: &Tasks, token: Option<&str>) -> (Agent, Arc<MooncakeTransfer>) {
    let mc = MooncakeConfig { token: token.map(String::from), ..MooncakeConfig::default() };
    agent_with(tasks, mc).await
}

async fn agent_with(tasks: &Tasks, mc: MooncakeConfig) -> (Agent, Arc<MooncakeTransfer>) {
    agent_on(tasks, mc, "127.0.0.1").await
}

/// An agent listening (and advertised) on `ip`.
async fn agent_on(tasks: &Tasks, mc: MooncakeConfig, ip: &str) -> (Agent, Arc<MooncakeTransfer>) {
    let cfg = InboxConfig { token: mc.token.clone(), ..InboxConfig::default() };
    let inbox = Arc::new(Inbox::new(cfg));
    let rpc = TcpListener::bind((ip, 0)).await.unwrap();
    let data = TcpListener::bind((ip, 0)).await.unwrap();
    let t = Arc::new(MooncakeTransfer::serve(rpc, data, None, inbox.clone(), mc, tasks).unwrap());
    (Agent::new(t.clone(), inbox), t)
}

async fn pair(token: Option<&str>) -> Pair {
    let tasks = Tasks::new();
    let (tx, _) = agent(&tasks, token).await;
    let (rx, rx_backend) = agent(&tasks, token).await;
    Pair { tasks, tx, rx, rx_backend }
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(5)
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect::<Vec<_>>().into()
}

/// Registers a region of `len` bytes for `senders` (equal halves), and shakes hands.
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
    let req = ConnectRequest {
        room: r,
        receiver: p.rx.addr(),
        region: id,
        region_len: len,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: token.map(String::from),
    };
    p.rx.connect(&p.tx.addr(), req).await.unwrap();
    assert_eq!(p.tx.inbox().accept(r, 1, deadline()).await.unwrap().len(), 1);
    id
}

#[tokio::test]
async fn kv_moves_between_handoff_agents_and_is_verified() {
    let p = pair(Some("secret")).await;
    let r = Room::mint();
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let half = 300_000u64;
    let id = region(&p, r, 2 * half, &[a, b], Some("secret")).await;
    assert_eq!(p.rx.inbox().poll(id), KvPoll::WaitingForInput);
    // Many pairs, spread over lanes: arrival order does not matter to the checksum.
    let chunks = |seed: u8, base: u64| -> Vec<(Bytes, u64)> {
        (0..30).map(|i| (pattern(10_000, seed + i as u8), base + i * 10_000)).collect()
    };
    for (s, base, seed) in [(a, 0, 1u8), (b, half, 90u8)] {
        let w = WriteRequest::new(id, chunks(seed, base), r, s, 7, 10, 0);
        p.tx.post_write(&p.rx.addr(), w).await.unwrap();
    }
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    let want: Vec<u8> =
        chunks(1, 0).into_iter().chain(chunks(90, half)).flat_map(|(b, _)| b.to_vec()).collect();
    assert_eq!(got.buf, want);
    assert_eq!(got.notices.len(), 2);
    p.tasks.shutdown().await;
}

/// Only this host's own addresses are sent from: one that merely binds (`ip_nonlocal_bind`,
/// a NAT's public address) is not.
#[test]
fn only_this_hosts_addresses_are_sent_from() {
    assert!(on_this_host("127.0.0.1".parse().unwrap()) && on_this_host("::1".parse().unwrap()));
    assert!(!on_this_host("192.0.2.7".parse().unwrap()), "a documentation address");
    let own = nix::ifaddrs::getifaddrs()
        .unwrap()
        .filter_map(|i| i.address?.as_sockaddr_in().map(|a| a.ip()));
    for ip in own {
        assert!(on_this_host(IpAddr::V4(ip)), "{ip}");
    }
}

/// A sender on a host with several addresses (here 127.0.0.2 beside 127.0.0.1) reaches a
/// receiver that takes data only from the address its handshake named: its connections leave
/// from its advertised address, not the one the kernel would pick (127.0.0.1, the route's).
#[tokio::test]
async fn a_sender_with_several_addresses_sends_from_the_one_it_advertised() {
    let tasks = Tasks::new();
    let (tx, _) = agent_on(&tasks, MooncakeConfig::default(), "127.0.0.2").await;
    let (rx, rx_backend) = agent(&tasks, None).await;
    let p = Pair { tasks, tx, rx, rx_backend };
    assert_eq!(p.tx.addr().ip, "127.0.0.2");
    let (r, s) = (Room::mint(), SenderId::new(0, 0));
    let id = region(&p, r, 20_000, &[s], None).await;
    let w = WriteRequest::new(id, vec![(pattern(20_000, 3), 0)], r, s, 7, 10, 0);
    p.tx.post_write(&p.rx.addr(), w).await.unwrap();
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    assert_eq!(got.buf, pattern(20_000, 3).to_vec());
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn a_wrong_room_or_a_wrong_offset_fails_the_region_by_name() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    // Right bytes, wrong room in the notice.
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    let w = WriteRequest::new(id, vec![(pattern(1000, 3), 0)], Room::mint(), s, 1, 1, 0);
    let e = p.tx.post_write(&p.rx.addr(), w).await.unwrap_err();
    assert!(e.to_string().contains("bootstrap_room mismatch"), "{e}");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Failed);
    // A write past the region's end is refused by the target, before its bytes land.
    let r = Room::mint();
    let id = region(&p, r, 1000, &[s], None).await;
    let w = WriteRequest::new(id, vec![(pattern(100, 3), 950)], r, s, 1, 1, 0);
    assert!(p.tx.post_write(&p.rx.addr(), w).await.is_err());
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn a_notice_without_the_token_is_refused() {
    let p = pair(Some("secret")).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 64, &[s], Some("secret")).await;
    let pairs = vec![(pattern(64, 1), 0)];
    let base = p.tx_base(id);
    p.tx_backend_write(base, &pairs).await;
    let notice = WriteRequest::new(id, pairs, r, s, 1, 1, 0).notice.unwrap();
    let forged = Control::Notice { region: id, notice, token: Some("guess".into()) };
    let e = p.rx_backend.initiator().notify(&p.rx.addr(), &forged).await.unwrap_err();
    assert!(matches!(e, TransferError::Rejected(_)), "{e}");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Transferring, "nothing verified");
    p.tasks.shutdown().await;
}

/// A handshake without the token is refused before its base is kept: strangers cannot
/// push the real handshakes' bases out of the table.
#[tokio::test]
async fn a_handshake_without_the_token_leaves_nothing_behind() {
    let p = pair(Some("secret")).await;
    let req = ConnectRequest {
        room: Room::mint(),
        receiver: p.tx.addr(),
        region: RegionId(7777),
        region_len: 64,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: Some("guess".into()),
    };
    let forged = Control::Connect { req, base: 4096 };
    let e = p.rx_backend.initiator().notify(&p.rx.addr(), &forged).await.unwrap_err();
    assert!(matches!(e, TransferError::Rejected(_)), "{e}");
    assert_eq!(p.rx_backend.shared.remotes.base(RegionId(7777)), None, "no base kept");
    p.tasks.shutdown().await;
}

impl Pair {
    /// The base the receiver exposed `id` at.
    fn tx_base(&self, id: RegionId) -> u64 {
        self.rx_backend.shared.exposed.expose(self.rx.inbox(), id).unwrap()
    }

    /// Writes `pairs` at `base` on the receiver, as its sender would.
    async fn tx_backend_write(&self, base: u64, pairs: &[(Bytes, u64)]) {
        self.rx_backend.initiator().write(&self.rx.addr(), base, pairs).await.unwrap();
    }
}

#[tokio::test]
async fn strangers_holding_every_handshake_place_give_them_up_to_a_token_holder() {
    let tasks = Tasks::new();
    let mc = MooncakeConfig {
        token: Some("secret".into()),
        max_inbound: 2,
        // Taken back at once (the grace has tests of its own, in `listen/tests.rs`).
        unproven_grace: Duration::ZERO,
        // Strangers could hold their places for an hour, were they not taken back.
        handshake_timeout: Duration::from_secs(3600),
        ..MooncakeConfig::default()
    };
    let (tx, _) = agent_with(&tasks, mc.clone()).await;
    let (rx, rx_backend) = agent_with(&tasks, mc).await;
    let p = Pair { tasks, tx, rx, rx_backend };
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

#[tokio::test]
async fn the_target_answers_probes_lists_no_regions_and_refuses_strangers() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let client = p.rx_backend.initiator();
    client.probe(&p.rx.addr()).await.unwrap();
    let r = Room::mint();
    let id = region(&p, r, 4096, &[s], None).await;
    // Nobody learns a live region's address by asking.
    let d = client.descriptor(&p.rx.addr(), true).await.unwrap();
    assert!(d.buffers.is_empty() && d.tcp_proto_version == 2);
    let base = p.tx_base(id);

    // A host no handshake named (127.0.0.2; the sender is 127.0.0.1) is cut off at once.
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let data: SocketAddr = ([127, 0, 0, 1], d.tcp_data_port).into();
    let mut stranger = sock.connect(data).await.unwrap();
    let h = wire::Header { size: 8, addr: base, opcode: wire::OP_WRITE | wire::OP_V2 };
    let _ = stranger.write_all(&h.encode()).await;
    let _ = stranger.write_all(&[9u8; 8]).await;
    let mut buf = [0u8; 8];
    assert!(matches!(stranger.read(&mut buf).await, Ok(0) | Err(_)), "closed without an ack");
    assert_eq!(p.rx.inbox().poll(id), KvPoll::WaitingForInput, "region untouched");

    // READ is refused; so is a write into a region that is gone.
    let mut conn = tokio::net::TcpStream::connect(data).await.unwrap();
    let read = wire::Header { size: 8, addr: base, opcode: wire::OP_READ | wire::OP_V2 };
    conn.write_all(&read.encode()).await.unwrap();
    assert_eq!(conn.read_u64_le().await.unwrap(), wire::STATUS_REJECTED);
    p.rx.inbox().release(id);
    let e = client.write(&p.rx.addr(), base, &[(pattern(8, 1), 0)]).await.unwrap_err();
    assert!(matches!(e, TransferError::Rejected(_) | TransferError::Io { .. }), "{e}");
    p.tasks.shutdown().await;
}

/// A region given up before its writes came (an SGLang request its client left) takes them
/// and drops their bytes while it is retired: a Mooncake sender marks its whole session
/// failed on one refused write, and every later room over it. Once its retirement is over,
/// they are refused again.
#[tokio::test]
async fn a_retired_regions_late_writes_are_taken_and_dropped() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let client = p.rx_backend.initiator();
    let resting = region(&p, Room::mint(), 4096, &[s], None).await;
    let ended = region(&p, Room::mint(), 4096, &[s], None).await;
    let (base, ended_base) = (p.tx_base(resting), p.tx_base(ended));
    p.rx_backend.retire(resting, Instant::now() + Duration::from_secs(30));
    p.rx_backend.retire(ended, Instant::now());
    for id in [resting, ended] {
        p.rx.inbox().release(id);
    }
    client.write(&p.rx.addr(), base, &[(pattern(4096, 1), 0)]).await.expect("taken");
    client.write(&p.rx.addr(), base + 100, &[(pattern(8, 2), 0)]).await.expect("taken again");
    let e = client.write(&p.rx.addr(), ended_base, &[(pattern(8, 1), 0)]).await.unwrap_err();
    assert!(matches!(e, TransferError::Rejected(_) | TransferError::Io { .. }), "{e}");
    p.tasks.shutdown().await;
}

/// Waits (10 s at most) until `n` bodies are landing in the region.
async fn bodies_landing(inbox: &Inbox, id: RegionId, n: usize) {
    let reached = async {
        while inbox.bodies_landing(id) != n {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), reached).await.unwrap();
}

#[tokio::test]
async fn overflowing_headers_and_a_peer_gone_mid_write_touch_nothing() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 4096, &[s], None).await;
    let client = p.rx_backend.initiator();
    let d = client.descriptor(&p.rx.addr(), true).await.unwrap();
    let (base, data) = (p.tx_base(id), SocketAddr::from(([127, 0, 0, 1], d.tcp_data_port)));
    // addr + size overflows u64: refused with a status, connection closed.
    let mut conn = tokio::net::TcpStream::connect(data).await.unwrap();
    let h = wire::Header { size: 16, addr: u64::MAX - 4, opcode: wire::OP_WRITE | wire::OP_V2 };
    conn.write_all(&h.encode()).await.unwrap();
    assert_eq!(conn.read_u64_le().await.unwrap(), wire::STATUS_REJECTED);
    // Half a body, then gone: nothing counts as written once the target has let go of it,
    // and the region stays open.
    let mut conn = tokio::net::TcpStream::connect(data).await.unwrap();
    let h = wire::Header { size: 4096, addr: base, opcode: wire::OP_WRITE | wire::OP_V2 };
    conn.write_all(&h.encode()).await.unwrap();
    conn.write_all(&[1u8; 1000]).await.unwrap();
    bodies_landing(p.rx.inbox(), id, 1).await;
    drop(conn);
    bodies_landing(p.rx.inbox(), id, 0).await;
    assert_ne!(p.rx.inbox().poll(id), KvPoll::Failed);
    // The real sender's write still goes through, whole.
    let pairs = vec![(pattern(4096, 5), 0)];
    p.tx.post_write(&p.rx.addr(), WriteRequest::new(id, pairs.clone(), r, s, 1, 1, 0))
        .await
        .unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, pairs[0].0.to_vec());
    p.tasks.shutdown().await;
}

#[tokio::test]
async fn an_empty_pair_does_not_upset_the_checksum() {
    let p = pair(None).await;
    let s = SenderId::new(0, 0);
    let r = Room::mint();
    let id = region(&p, r, 64, &[s], None).await;
    // The initiator drops the empty pair; sender and receiver both leave it out of the sum.
    let pairs = vec![(Bytes::new(), 10), (pattern(64, 2), 0)];
    p.tx.post_write(&p.rx.addr(), WriteRequest::new(id, pairs, r, s, 1, 1, 0)).await.unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, pattern(64, 2).to_vec());
    p.tasks.shutdown().await;
}

/// A streamed write over mooncake: each part is a write of its own and lands at once; the
/// notice alone at the end verifies them all.
#[tokio::test]
async fn a_streamed_write_lands_part_by_part() {
    let p = pair(Some("secret")).await;
    let (r, s) = (Room::mint(), SenderId::new(0, 0));
    let id = region(&p, r, 30_000, &[s], Some("secret")).await;
    let mut w = p.tx.open_write(&p.rx.addr(), id, s).await.unwrap();
    w.post(vec![(pattern(10_000, 1), 0)]).await.unwrap();
    // Acked by the target, so already in the region: nothing handed on before the notice.
    assert_eq!(p.rx.inbox().poll(id), KvPoll::Transferring);
    w.post(vec![(pattern(10_000, 3), 20_000), (pattern(10_000, 2), 10_000)]).await.unwrap();
    w.finish(r, 5, 3, 0).await.unwrap();
    let got = p.rx.inbox().wait(id, deadline()).await.unwrap();
    let want: Vec<u8> = (1..=3).flat_map(|i| pattern(10_000, i).to_vec()).collect();
    assert_eq!(got.buf, want);
    p.tasks.shutdown().await;
}
