use std::os::fd::AsFd;
use std::time::Duration;

use bytes::Bytes;
use handoff_core::{Room, Tasks};
use nix::sys::memfd::{MFdFlags, memfd_create};
use tokio::time::Instant;

use super::super::TcpConfig;
use super::*;
use crate::{
    InboxConfig, KvPoll, Notice, NoticeSums, SenderId, TcpTransfer, TransferBackend, WriteRequest,
};

struct Ends {
    tasks: Tasks,
    tx: TcpTransfer,
    rx: TcpTransfer,
    rx_inbox: Arc<Inbox>,
}

async fn ends(rx_shared: bool, token: Option<&str>) -> Ends {
    let tasks = Tasks::new();
    let mk = |shared_memory: bool| {
        let tasks = tasks.clone();
        let token = token.map(String::from);
        async move {
            let inbox =
                Arc::new(Inbox::new(InboxConfig { token: token.clone(), ..Default::default() }));
            let cfg = TcpConfig { shared_memory, token, ..Default::default() };
            let t = TcpTransfer::bind("127.0.0.1:0".parse().unwrap(), inbox.clone(), cfg, &tasks);
            (t.await.unwrap(), inbox)
        }
    };
    let (tx, _) = mk(true).await;
    let (rx, rx_inbox) = mk(rx_shared).await;
    Ends { tasks, tx, rx, rx_inbox }
}

fn pattern(len: usize, seed: u8) -> Bytes {
    (0..len).map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed)).collect::<Vec<_>>().into()
}

/// All of a region's `len` bytes, as one sender's ranges.
fn whole(len: u64) -> Vec<std::ops::Range<u64>> {
    std::iter::once(0..len).collect()
}

fn deadline() -> Instant {
    Instant::now() + Duration::from_secs(10)
}

/// Pairs of `sizes` bytes laid end to end from 0, and their total.
fn laid(sizes: &[usize]) -> (Vec<(Bytes, u64)>, u64) {
    let mut at = 0u64;
    let pairs = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| {
            let p = (pattern(n, i as u8), at);
            at += n as u64;
            p
        })
        .collect();
    (pairs, at)
}

fn idle_shm(t: &TcpTransfer) -> usize {
    let pool = t.shm.as_ref().expect("shared memory on");
    pool.idle.len()
}

#[tokio::test]
async fn a_write_on_one_host_goes_through_the_window_and_verifies() {
    let e = ends(true, Some("secret")).await;
    // More than two halves, in pairs that straddle them, and an empty one.
    let (pairs, len) = laid(&[3 << 20, 7, 0, (2 << 20) + 5, 100_000]);
    let (room, s) = (Room::mint(), SenderId::new(0, 0));
    let id = e.rx_inbox.register_region(room, len, [(s, whole(len))]).unwrap();
    let want: Vec<u8> = pairs.iter().flat_map(|(b, _)| b.to_vec()).collect();
    e.tx.post_write(&e.rx.local_addr(), WriteRequest::new(id, pairs, room, s, 5, 1, 0))
        .await
        .unwrap();
    let got = e.rx_inbox.wait(id, deadline()).await.unwrap();
    assert_eq!(got.buf, want);
    assert_eq!(idle_shm(&e.tx), 1, "the write went over a shm connection, now idle");
    e.tasks.shutdown().await;
}

#[tokio::test]
async fn a_streamed_write_lands_its_parts_as_posted() {
    let e = ends(true, None).await;
    let (pairs, len) = laid(&[1 << 20, 3 << 20, 10]);
    let (room, s) = (Room::mint(), SenderId::new(0, 0));
    let id = e.rx_inbox.register_region(room, len, [(s, whole(len))]).unwrap();
    let mut stream = e.tx.open_stream(&e.rx.local_addr()).await.unwrap().expect("a stream");
    let mut sums = NoticeSums::default();
    stream.post(id, s, &pairs[..1], &mut sums).await.unwrap();
    // The first part is landed before the rest is posted.
    let first = tokio::time::timeout(Duration::from_secs(5), async {
        while e.rx_inbox.poll(id) != KvPoll::Transferring {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    first.await.expect("the first part lands on its own");
    stream.post(id, s, &pairs[1..], &mut sums).await.unwrap();
    // Summed piece by piece as the parts went out (one spans both halves), as summed whole.
    let notice = WriteRequest::new(id, pairs.clone(), room, s, 5, 1, 0).notice.unwrap();
    assert_eq!((sums.bytes, sums.checksum), (notice.bytes, notice.checksum));
    let summed = Notice { bytes: sums.bytes, checksum: sums.checksum, ..notice };
    stream.finish(id, summed).await.unwrap();
    let got = e.rx_inbox.wait(id, deadline()).await.unwrap();
    assert_eq!(got.buf, pairs.iter().flat_map(|(b, _)| b.to_vec()).collect::<Vec<u8>>());
    assert_eq!(idle_shm(&e.tx), 1, "the stream went over a shm connection, now idle");
    e.tasks.shutdown().await;
}

/// The notice follows the shared writes at once, not a round trip later: a receiver that
/// reads both before it acks either gets them, and the sender then takes every ack.
#[tokio::test]
async fn the_notice_follows_the_shared_writes_without_waiting_for_their_acks() {
    let (near, mut far) = UnixStream::pair().unwrap();
    let window = window::Window::create().unwrap();
    let peer = AgentAddr { ip: "127.0.0.1".into(), port: 1 };
    let mut conn = ShmConn::new(&peer, near, window, 1 << 20);
    let (pairs, len) = laid(&[1000, (2 << 20) + 10]);
    let (region, s) = (crate::RegionId(7), SenderId::new(0, 0));
    let notice = WriteRequest::new(region, pairs.clone(), Room::mint(), s, 5, 1, 0).notice.unwrap();
    let receiver = async {
        let within = Duration::from_secs(10);
        let mut frames = Vec::new();
        while !matches!(frames.last(), Some(Frame::Notice { .. })) {
            let f = tokio::time::timeout(within, wire::read_frame(&mut far, 1 << 20)).await;
            frames.push(f.expect("the notice came without an ack").unwrap().unwrap());
        }
        for _ in &frames {
            wire::write_ack(&mut far, &Ok(())).await.unwrap();
        }
        frames.len()
    };
    let sender = async {
        conn.post(region, s, &pairs, None).await?;
        conn.finish(region, &notice).await
    };
    let (frames, sent) = tokio::join!(receiver, sender);
    sent.unwrap();
    assert_eq!(frames, 3, "two halves' shared writes, then the notice ({len} bytes)");
    assert!(conn.looks_alive(), "every ack taken: nothing left to read");
}

#[tokio::test]
async fn without_a_listener_on_this_host_the_write_goes_over_tcp() {
    let e = ends(false, None).await;
    let (pairs, len) = laid(&[300_000]);
    let (room, s) = (Room::mint(), SenderId::new(0, 0));
    let id = e.rx_inbox.register_region(room, len, [(s, whole(len))]).unwrap();
    e.tx.post_write(&e.rx.local_addr(), WriteRequest::new(id, pairs, room, s, 5, 1, 0))
        .await
        .unwrap();
    e.rx_inbox.wait(id, deadline()).await.unwrap();
    assert_eq!(idle_shm(&e.tx), 0);
    e.tasks.shutdown().await;
}

/// A raw connection to `t`'s shm listener whose hello passes `fd`: its answer.
async fn hello_with(t: &TcpTransfer, token: &str, fd: std::os::fd::BorrowedFd<'_>) -> Frame {
    raw_hello(t, token, fd).await.0
}

/// [`hello_with`], keeping the connection.
async fn raw_hello(
    t: &TcpTransfer,
    token: &str,
    fd: std::os::fd::BorrowedFd<'_>,
) -> (Frame, UnixStream) {
    let addr = nix::sys::socket::UnixAddr::new_abstract(name(&t.local_addr()).as_bytes()).unwrap();
    let sock = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    connect(sock.as_raw_fd(), &addr).unwrap();
    let std = std::os::unix::net::UnixStream::from(sock);
    std.set_nonblocking(true).unwrap();
    let mut s = UnixStream::from_std(std).unwrap();
    fd::send_with_fd(&mut s, &wire::hello(token), fd).await.unwrap();
    (wire::read_frame(&mut s, 1 << 20).await.unwrap().expect("an answer"), s)
}

#[tokio::test]
async fn handshakes_are_refused_over_shared_memory() {
    let e = ends(true, None).await;
    let window = window::Window::create().unwrap();
    let (hello, mut s) = raw_hello(&e.rx, "", window.fd()).await;
    assert!(matches!(hello, Frame::Ack(Ok(()))), "{hello:?}");
    let req = crate::ConnectRequest {
        room: Room::mint(),
        receiver: e.tx.local_addr(),
        region: crate::RegionId(1),
        region_len: 8,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: None,
    };
    wire::write_connect(&mut s, &req).await.unwrap();
    let answer = wire::read_frame(&mut s, 1 << 20).await.unwrap();
    assert!(matches!(&answer, Some(Frame::Ack(Err(m))) if m.contains("over tcp")), "{answer:?}");
    assert!(wire::read_frame(&mut s, 1 << 20).await.unwrap().is_none(), "then closed");
    assert_eq!(e.rx_inbox.pending_rooms(), 0);
    e.tasks.shutdown().await;
}

#[tokio::test]
async fn with_tls_every_byte_goes_over_tls() {
    let tasks = Tasks::new();
    let tls = handoff_core::tls::test_certs::TestCa::new().issue().cluster();
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let cfg = TcpConfig { tls: Some(tls), ..Default::default() };
    let t = TcpTransfer::bind("127.0.0.1:0".parse().unwrap(), inbox, cfg, &tasks).await.unwrap();
    assert!(t.shm.is_none(), "no shared-memory sender");
    let at = UnixAddr::new_abstract(name(&t.local_addr()).as_bytes()).unwrap();
    let sock = socket(AddressFamily::Unix, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    assert!(connect(sock.as_raw_fd(), &at).is_err(), "no shared-memory listener");
    tasks.shutdown().await;
}

#[tokio::test]
async fn windows_that_could_shrink_and_wrong_tokens_are_refused() {
    let e = ends(true, Some("secret")).await;
    // Not sealed: its sender could shrink it under the receiver's reads.
    let loose = memfd_create("loose", MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING).unwrap();
    std::fs::File::from(loose.try_clone().unwrap()).set_len(8 << 20).unwrap();
    let refused = hello_with(&e.rx, "secret", loose.as_fd()).await;
    assert!(matches!(&refused, Frame::Ack(Err(m)) if m.contains("not sealed")), "{refused:?}");
    let sealed = window::Window::create().unwrap();
    let refused = hello_with(&e.rx, "wrong", sealed.fd()).await;
    assert!(matches!(&refused, Frame::Ack(Err(m)) if m.contains("wrong token")), "{refused:?}");
    let accepted = hello_with(&e.rx, "secret", sealed.fd()).await;
    assert!(matches!(accepted, Frame::Ack(Ok(()))), "{accepted:?}");
    e.tasks.shutdown().await;
}

/// Where the kernel has `MFD_NOEXEC_SEAL` (6.3 on), a window is made with it, so hosts that
/// refuse executable memfds (`vm.memfd_noexec=2`) still get the shm path; before, it is
/// made without.
#[test]
fn a_window_is_sealed_against_exec_where_the_kernel_can() {
    let window = window::Window::create().unwrap();
    let seals = nix::fcntl::fcntl(window.fd(), nix::fcntl::FcntlArg::F_GET_SEALS).unwrap();
    let noexec = MFdFlags::MFD_CLOEXEC | MFdFlags::from_bits_retain(nix::libc::MFD_NOEXEC_SEAL);
    match memfd_create("probe", noexec) {
        Ok(_) => assert_ne!(seals & nix::libc::F_SEAL_EXEC, 0, "seals {seals:#x}"),
        Err(e) => assert_eq!(e, nix::errno::Errno::EINVAL, "an older kernel: {e}"),
    }
}

#[test]
fn bytes_cross_the_window_only_within_its_halves() {
    use crate::inbox::PieceBytes;
    let mut sender = window::Window::create().unwrap();
    let fd = sender.fd().try_clone_to_owned().unwrap();
    let receiver = SharedWindow::adopt(fd).unwrap();
    let data = pattern(4096, 3);
    // Into the second half, up to its very end.
    let end = window::HALF - data.len();
    sender.fill(1, end, &data).unwrap();
    let half = receiver.half(1).unwrap();
    let mut got = vec![std::mem::MaybeUninit::uninit(); data.len()];
    let mut place = tokio::io::ReadBuf::uninit(&mut got);
    assert!(half.range(end, data.len()).unwrap().copy_to(&mut place));
    assert_eq!(place.filled(), data, "copied, and marked filled");
    // Nothing runs past a half, on either side, nor lands in a buffer of another length.
    assert!(sender.fill(0, end + 1, &data).is_err());
    assert!(sender.fill(0, usize::MAX, &data).is_err());
    assert!(half.range(end + 1, data.len()).is_none());
    assert!(half.range(usize::MAX, 2).is_none());
    assert!(receiver.half(2).is_none());
    let mut short = [0u8; 7];
    let mut short = tokio::io::ReadBuf::new(&mut short);
    assert!(!half.range(0, 8).unwrap().copy_to(&mut short));
    assert!(short.filled().is_empty());
}
