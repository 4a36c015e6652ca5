use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::*;
use crate::WriteRequest;

/// One byte range, as a sender's ranges.
fn span(r: std::ops::Range<u64>) -> Vec<std::ops::Range<u64>> {
    std::iter::once(r).collect()
}

fn room(n: u64) -> Room {
    Room::try_from(n).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(2)
}

fn write(inbox: &Inbox, region: RegionId, w: &WriteRequest) -> Result<(), TransferError> {
    let segs: Vec<(u64, &[u8])> = w.pairs.iter().map(|(b, o)| (*o, &b[..])).collect();
    // Each sender over its own connection.
    let conn = ConnId(u64::from(w.sender.0));
    inbox.on_write(region, w.sender, conn, &segs)?;
    inbox.on_notice(region, conn, w.notice.unwrap())
}

fn req(region: RegionId, r: Room, sender: u16, off: u64, data: &[u8]) -> WriteRequest {
    let pairs = vec![(Bytes::copy_from_slice(data), off)];
    WriteRequest::new(region, pairs, r, SenderId::new(sender, 0), 7, 4, 0)
}

#[tokio::test]
async fn region_succeeds_once_every_sender_verified() {
    let inbox = Inbox::new(InboxConfig::default());
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let id = inbox.register_region(room(9), 8, [(a, span(0..4)), (b, span(4..8))]).unwrap();
    assert_eq!(inbox.poll(id), KvPoll::Bootstrapping);
    inbox.mark_connected(id);
    write(&inbox, id, &req(id, room(9), 1, 4, b"5678")).unwrap();
    assert_eq!(inbox.poll(id), KvPoll::Transferring);
    write(&inbox, id, &req(id, room(9), 0, 0, b"1234")).unwrap();
    assert_eq!(inbox.poll(id), KvPoll::Success);
    let got = inbox.wait(id, soon()).await.unwrap();
    assert_eq!(got.buf, b"12345678");
    assert_eq!(got.notices.len(), 2);
    assert_eq!(inbox.regions(), 0, "taken regions are removed");
}

#[tokio::test]
async fn each_verification_failure_is_terminal_with_its_reason() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    type MakeWrite = Box<dyn Fn(RegionId) -> WriteRequest>;
    let cases: Vec<(MakeWrite, &str)> = vec![
        (Box::new(|id| req(id, room(8), 0, 0, b"abcd")), "bootstrap_room mismatch"),
        (
            Box::new(|id| {
                let mut w = req(id, room(9), 0, 0, b"abcd");
                w.pairs[0].0 = Bytes::from_static(b"abce");
                w
            }),
            "checksum mismatch",
        ),
        (
            Box::new(|id| {
                let mut w = req(id, room(9), 0, 0, b"abcd");
                w.pairs[0].0 = Bytes::from_static(b"ab");
                w
            }),
            "short transfer",
        ),
        (Box::new(|id| req(id, room(9), 0, 2, b"abcd")), "outside its"),
        (Box::new(|id| req(id, room(9), 3, 0, b"abcd")), "unexpected sender"),
    ];
    for (make, want) in cases {
        let id = inbox.register_region(room(9), 4, [(s, span(0..4))]).unwrap();
        assert!(write(&inbox, id, &make(id)).is_err());
        assert_eq!(inbox.poll(id), KvPoll::Failed);
        // Failed is terminal: a correct write afterwards does not revive it.
        assert!(write(&inbox, id, &req(id, room(9), 0, 0, b"abcd")).is_err());
        let err = inbox.wait(id, soon()).await.unwrap_err().to_string();
        assert!(err.contains(want), "{err} should say {want}");
    }
}

#[tokio::test]
async fn wait_times_out_and_removes_the_region() {
    let inbox = Inbox::new(InboxConfig::default());
    let id = inbox.register_region(room(1), 4, [(SenderId::new(0, 0), span(0..4))]).unwrap();
    let err = inbox.wait(id, Instant::now() + Duration::from_millis(20)).await.unwrap_err();
    assert!(matches!(err, TransferError::Timeout(_)));
    assert_eq!(inbox.regions(), 0);
    assert_eq!(inbox.poll(id), KvPoll::Failed);
}

fn connect(r: Room, token: Option<&str>) -> ConnectRequest {
    ConnectRequest {
        room: r,
        receiver: crate::AgentAddr { ip: "127.0.0.1".into(), port: 1 },
        region: RegionId(1),
        region_len: 4,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: token.map(str::to_owned),
    }
}

#[tokio::test]
async fn accept_waits_for_every_handshake_of_its_room() {
    let inbox = std::sync::Arc::new(Inbox::new(InboxConfig::default()));
    let i2 = inbox.clone();
    let waiter = tokio::spawn(async move { i2.accept(room(5), 2, soon()).await });
    inbox.on_connect(connect(room(5), None)).unwrap();
    inbox.on_connect(connect(room(6), None)).unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    assert!(!waiter.is_finished());
    inbox.on_connect(connect(room(5), None)).unwrap();
    assert_eq!(waiter.await.unwrap().unwrap().len(), 2);
    assert_eq!(inbox.pending_rooms(), 1);
    let err = inbox.accept(room(7), 1, Instant::now() + Duration::from_millis(10)).await;
    assert!(matches!(err, Err(TransferError::Timeout(_))));
}

/// A receiver host past its bound is refused; the token checked is not kept.
#[tokio::test]
async fn a_handshake_is_bounded_and_keeps_no_token() {
    let inbox = Inbox::new(InboxConfig { token: Some("k".into()), ..Default::default() });
    let mut long = connect(room(7), Some("k"));
    long.receiver.ip = "h".repeat(super::handshakes::MAX_HOST_LEN + 1);
    assert!(matches!(inbox.on_connect(long), Err(TransferError::Malformed(_))));
    assert_eq!(inbox.pending_rooms(), 0);
    inbox.on_connect(connect(room(5), Some("k"))).unwrap();
    let got = inbox.accept(room(5), 1, soon()).await.unwrap();
    assert_eq!(got[0].token, None, "the token is not kept");
}

#[test]
fn handshakes_need_the_token_and_tables_are_bounded() {
    let cfg = InboxConfig {
        token: Some("k".into()),
        max_pending_rooms: 3,
        max_regions: 2,
        ..Default::default()
    };
    let inbox = Inbox::new(cfg);
    assert_eq!(inbox.on_connect(connect(room(1), None)), Err(TransferError::Unauthorized));
    assert_eq!(inbox.on_connect(connect(room(1), Some("x"))), Err(TransferError::Unauthorized));
    for r in 1..=3 {
        inbox.on_connect(connect(room(r), Some("k"))).unwrap();
    }
    assert_eq!(
        inbox.on_connect(connect(room(4), Some("k"))),
        Err(TransferError::Full("pending handshake"))
    );
    inbox.register_region(room(1), 1, []).unwrap();
    inbox.register_region(room(1), 1, []).unwrap();
    assert_eq!(inbox.register_region(room(1), 1, []), Err(TransferError::Full("region")));
}

/// A closed room's handshakes are dropped, and later ones answered and dropped; the rooms
/// closed last are remembered up to the pending bound, the oldest forgotten first.
#[test]
fn a_closed_rooms_handshakes_are_dropped_now_and_later() {
    let inbox = Inbox::new(InboxConfig { max_pending_rooms: 3, ..Default::default() });
    inbox.on_connect(connect(room(1), None)).unwrap();
    inbox.close_room(room(1));
    assert_eq!(inbox.pending_rooms(), 0, "dropped at the close");
    inbox.close_room(room(2));
    inbox.on_connect(connect(room(2), None)).unwrap();
    assert_eq!(inbox.pending_rooms(), 0, "answered, and dropped");
    // Requests refused before their handshakes came never fill the table.
    for r in 10..100 {
        inbox.close_room(room(r));
        inbox.on_connect(connect(room(r), None)).unwrap();
    }
    assert_eq!(inbox.pending_rooms(), 0);
    assert!(inbox.room_closed(room(99)) && !inbox.room_closed(room(96)), "three remembered");
    inbox.on_connect(connect(room(96), None)).unwrap();
    assert_eq!(inbox.pending_rooms(), 1, "a room forgotten is taken again");
}

#[tokio::test]
async fn a_sender_is_bound_to_its_connection_and_others_change_nothing() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    let id = inbox.register_region(room(5), 8, [(s, span(0..8))]).unwrap();
    let other = inbox.register_region(room(5), 8, [(s, span(0..8))]).unwrap();
    assert_ne!(id, other);
    assert!(id.0 > 1 << 20 || other.0 > 1 << 20, "ids are not a small counter: {id:?} {other:?}");
    let w = req(id, room(5), 0, 0, b"abcdefgh");
    let segs: Vec<(u64, &[u8])> = w.pairs.iter().map(|(b, o)| (*o, &b[..])).collect();
    let (mine, theirs) = (ConnId(1), ConnId(2));
    inbox.on_write(id, s, mine, &segs[..]).unwrap();
    // The same sender's bytes or notice over another connection: refused, region untouched.
    assert!(matches!(inbox.on_write(id, s, theirs, &segs), Err(TransferError::Forbidden(_))));
    assert!(matches!(
        inbox.on_notice(id, theirs, w.notice.unwrap()),
        Err(TransferError::Forbidden(_))
    ));
    assert_eq!(inbox.poll(id), KvPoll::Transferring);
    inbox.on_notice(id, mine, w.notice.unwrap()).unwrap();
    assert_eq!(inbox.wait(id, soon()).await.unwrap().buf, b"abcdefgh");
    // A region nobody named: unknown, whatever the connection.
    let guess = RegionId(other.0 ^ 1);
    assert_eq!(inbox.on_write(guess, s, theirs, &segs), Err(TransferError::UnknownRegion(guess)));
    assert_eq!(inbox.poll(other), KvPoll::Bootstrapping);
}

/// A write of `pairs` from `sender` whose notice was computed over `claimed` instead.
fn claimed(
    id: RegionId,
    sender: u16,
    pairs: &[(&'static [u8], u64)],
    claimed: &[(&'static [u8], u64)],
) -> WriteRequest {
    let to = |p: &[(&'static [u8], u64)]| -> Vec<(Bytes, u64)> {
        p.iter().map(|(b, o)| (Bytes::from_static(b), *o)).collect()
    };
    let mut w = WriteRequest::new(id, to(claimed), room(9), SenderId::new(sender, 0), 7, 4, 0);
    w.pairs = to(pairs);
    w
}

#[tokio::test]
async fn placement_is_verified_and_each_violation_named() {
    let inbox = Inbox::new(InboxConfig::default());
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let two = || [(a, span(0..8)), (b, span(8..16))];
    let cases: Vec<(WriteRequest, &str)> = vec![
        // Its bytes in the other sender's range.
        (claimed(RegionId(0), 0, &[(b"abcdefgh", 8)], &[(b"abcdefgh", 8)]), "outside its"),
        // The right bytes in the right order, at each other's offsets: the checksum binds
        // where they landed.
        (
            claimed(RegionId(0), 0, &[(b"1234", 4), (b"5678", 0)], &[(b"1234", 0), (b"5678", 4)]),
            "checksum mismatch",
        ),
        // Bytes written twice.
        (
            claimed(RegionId(0), 0, &[(b"1234", 0), (b"3456", 2)], &[(b"1234", 0)]),
            "already written",
        ),
        // A gap left unwritten.
        (
            claimed(RegionId(0), 0, &[(b"12", 0), (b"5678", 4)], &[(b"12345678", 0)]),
            "gap, bytes [2, 4)",
        ),
    ];
    for (mut w, want) in cases {
        let id = inbox.register_region(room(9), 16, two()).unwrap();
        w.region = id;
        let _ = write(&inbox, id, &w);
        let err = inbox.wait(id, soon()).await.unwrap_err().to_string();
        assert!(err.contains(want), "{err} should say {want}");
    }
    // Senders whose ranges overlap, or run past the region, are refused at registration.
    for bad in [[(a, span(0..8)), (b, span(7..16))], [(a, span(0..8)), (b, span(8..17))]] {
        let e = inbox.register_region(room(9), 16, bad).unwrap_err().to_string();
        assert!(e.contains("overlap or run past"), "{e}");
    }
    // And the right write succeeds.
    let id = inbox.register_region(room(9), 16, two()).unwrap();
    write(
        &inbox,
        id,
        &claimed(id, 0, &[(b"1234", 0), (b"5678", 4)], &[(b"1234", 0), (b"5678", 4)]),
    )
    .unwrap();
    write(&inbox, id, &claimed(id, 1, &[(b"abcdefgh", 8)], &[(b"abcdefgh", 8)])).unwrap();
    assert_eq!(inbox.wait(id, soon()).await.unwrap().buf, b"12345678abcdefgh");
}

/// Each written interval apart from the others costs the written map about 40 bytes: a
/// sender writing every other byte is refused once it has more than its ranges allow (1,024,
/// one per range, one per 64 bytes), while one writing 256-byte pages out of order is not.
#[tokio::test]
async fn written_pieces_apart_are_bounded_by_the_bytes_they_track() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    let len = 64 * 1024u64;
    let bytes = Bytes::from(vec![7u8; len as usize]);
    let pairs = |offsets: Vec<u64>, size: u64| -> Vec<(Bytes, u64)> {
        offsets.into_iter().map(|o| (bytes.slice(o as usize..(o + size) as usize), o)).collect()
    };
    // Odd pages first, then even ones: at most 128 pieces apart at once.
    let pages: Vec<u64> = (0..len / 256)
        .filter(|p| p % 2 == 1)
        .chain((0..len / 256).filter(|p| p % 2 == 0))
        .collect();
    let id = inbox.register_region(room(9), len, [(s, span(0..len))]).unwrap();
    let w = WriteRequest::new(
        id,
        pairs(pages.iter().map(|p| p * 256).collect(), 256),
        room(9),
        s,
        7,
        4,
        0,
    );
    write(&inbox, id, &w).unwrap();
    assert_eq!(inbox.wait(id, soon()).await.unwrap().buf, bytes);
    // Every other byte: refused at the 1,024 + 1 + 1,024th piece apart.
    let id = inbox.register_region(room(9), len, [(s, span(0..len))]).unwrap();
    let w = WriteRequest::new(id, pairs((0..len).step_by(2).collect(), 1), room(9), s, 7, 4, 0);
    assert!(write(&inbox, id, &w).is_err());
    let err = inbox.wait(id, soon()).await.unwrap_err().to_string();
    assert!(err.contains("apart from 2049 others (at most 2049 for its 65536 bytes)"), "{err}");
}

#[tokio::test]
async fn region_memory_has_a_total_budget() {
    let inbox = Inbox::new(InboxConfig { max_total_bytes: 10, ..Default::default() });
    let s = SenderId::new(0, 0);
    let a = inbox.register_region(room(1), 6, [(s, span(0..6))]).unwrap();
    assert_eq!(
        inbox.register_region(room(2), 6, [(s, span(0..6))]),
        Err(TransferError::Full("region memory"))
    );
    assert_eq!(inbox.held_bytes(), 6);
    inbox.release(a);
    let b = inbox.register_region(room(2), 6, [(s, span(0..6))]).unwrap();
    let _ = inbox.wait(b, Instant::now()).await;
    assert_eq!(inbox.held_bytes(), 0, "a region given up on gives its memory back");
}

/// A sender named twice would keep only its last ranges: the first's bytes would be neither
/// written nor zeroed, and handed on (another request's, from the allocator).
#[test]
fn a_sender_named_twice_is_refused() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    for twice in [vec![(s, span(0..4)), (s, span(4..8))], vec![(s, span(0..8)), (s, vec![])]] {
        let err = inbox.register_region(room(1), 8, twice).unwrap_err();
        assert_eq!(err, TransferError::Malformed("a sender is named twice".into()));
    }
    assert_eq!(inbox.held_bytes(), 0);
}

/// Found by fuzzing: an empty segment far past the region's end was "inside" (nothing to
/// place) and then sliced the buffer out of bounds.
#[tokio::test]
async fn an_empty_segment_far_past_the_end_lands_nowhere() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    let id = inbox.register_region(room(9), 4, [(s, span(0..4))]).unwrap();
    let far = claimed(id, 0, &[(b"", 1 << 34), (b"abcd", 0)], &[(b"", 1 << 34), (b"abcd", 0)]);
    write(&inbox, id, &far).unwrap();
    assert_eq!(inbox.wait(id, soon()).await.unwrap().buf, b"abcd");
}

/// Whether a region is open is answered without waiting for its lock (held while a notice
/// copies a whole region): a held one counts as open; a failed or unknown one is not.
#[test]
fn whether_a_region_is_open_is_answered_without_waiting_for_it() {
    let inbox = Inbox::new(InboxConfig::default());
    let s = SenderId::new(0, 0);
    let id = inbox.register_region(room(1), 64, [(s, span(0..64))]).unwrap();
    assert!(inbox.open_now(id));
    let region = inbox.region(id).unwrap();
    let held = region.lock().unwrap();
    assert!(inbox.open_now(id), "held, so at work: open");
    drop(held);
    inbox.fail(id, "gone");
    assert!(!inbox.open_now(id));
    assert!(!inbox.open_now(RegionId(u64::MAX)));
}

/// A wait past its deadline with the KV still arriving is late (the link or this receiver
/// slow, the senders sending), not a timeout (a sender silent): bytes that stopped arriving
/// more than [`ARRIVING`] before it, never came, came at a trickle, or came from one sender
/// while another said nothing, are a timeout.
#[tokio::test]
async fn a_wait_past_its_deadline_is_late_only_while_every_sender_sends() {
    const MIB: u64 = 1 << 20;
    let inbox = Inbox::new(InboxConfig::default());
    let (a, b) = (SenderId::new(0, 0), SenderId::new(1, 0));
    let one = |r: u64| inbox.register_region(room(r), 2 * MIB, [(a, span(0..2 * MIB))]).unwrap();
    let (moving, stopped, silent, trickle) = (one(1), one(2), one(3), one(4));
    let halves = [(a, span(0..MIB)), (b, span(MIB..2 * MIB))];
    let one_quiet = inbox.register_region(room(5), 2 * MIB, halves).unwrap();
    let mib = vec![7u8; MIB as usize];
    let send = |id, s, off: u64, n: usize| inbox.on_write(id, s, ConnId(0), &[(off, &mib[..n])]);
    send(stopped, a, 0, MIB as usize).unwrap();
    tokio::time::sleep(ARRIVING * 3 / 2).await;
    send(moving, a, 0, MIB as usize).unwrap();
    send(trickle, a, 0, 4).unwrap();
    send(one_quiet, a, 0, MIB as usize).unwrap();
    let deadline = Instant::now() + ARRIVING / 2;
    let late = inbox.wait(moving, deadline).await.unwrap_err();
    assert!(matches!(late, TransferError::Late(_)), "{late}");
    for (id, what) in [(stopped, "stopped"), (silent, "silent"), (trickle, "trickle")] {
        let e = inbox.wait(id, deadline).await.unwrap_err();
        assert!(matches!(e, TransferError::Timeout(_)), "{what}: {e}");
    }
    // Its first sender done, its second silent: the silent one speaks for the region.
    let e = inbox.wait(one_quiet, deadline).await.unwrap_err();
    assert!(matches!(e, TransferError::Timeout(_)), "one sender quiet: {e}");
}
