use std::task::Poll;

use handoff_core::Room;
use tokio::io::ReadBuf;

use crate::inbox::placement::segment_digest;
use crate::{ConnId, Inbox, InboxConfig, KvPoll, Notice, RegionId, SenderId, TransferError};

const CONN: ConnId = ConnId(7);

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// An inbox with one region whose senders hold `ranges` (start, end) in turn.
fn region(len: u64, ranges: &[(u64, u64)]) -> (Inbox, Room, RegionId) {
    let inbox = Inbox::new(InboxConfig::default());
    let room = Room::mint();
    let senders =
        ranges.iter().enumerate().map(|(i, &(a, b))| (sender(i), std::iter::once(a..b).collect()));
    let id = inbox.register_region(room, len, senders).unwrap();
    (inbox, room, id)
}

fn sender(i: usize) -> SenderId {
    SenderId::new(i as u16, 0)
}

/// A fill that copies at most `most` bytes of `src` from `*at`, as a short socket read would.
fn from<'a>(
    src: &'a [u8],
    at: &'a mut usize,
    most: usize,
) -> impl FnOnce(&mut ReadBuf<'_>) -> Poll<std::io::Result<()>> + 'a {
    move |place: &mut ReadBuf<'_>| {
        let n = place.remaining().min(most).min(src.len() - *at);
        place.put_slice(&src[*at..*at + n]);
        *at += n;
        Poll::Ready(Ok(()))
    }
}

/// How many bytes a read landed.
fn got(read: Poll<std::io::Result<usize>>) -> usize {
    match read {
        Poll::Ready(Ok(n)) => n,
        other => panic!("expected bytes, got {other:?}"),
    }
}

/// A fill that must not be called.
fn never(_: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
    panic!("a refused body read bytes")
}

/// `sender`'s notice for `bytes` written at `off`, in one segment.
fn notice(room: Room, s: SenderId, off: u64, bytes: &[u8]) -> Notice {
    let (len, checksum) = (bytes.len() as u64, segment_digest(off, bytes));
    Notice { room, sender: s, first_token: 0, tokens: 0, cached_tokens: 0, bytes: len, checksum }
}

async fn failure(inbox: &Inbox, id: RegionId) -> String {
    assert_eq!(inbox.poll(id), KvPoll::Failed);
    match inbox.wait(id, tokio::time::Instant::now()).await {
        Err(TransferError::Failed(reason)) => reason,
        other => panic!("expected a failed region, got {other:?}"),
    }
}

/// Short reads of uneven sizes land where they belong, and the body counts once, whole,
/// with the digest of its bytes at its offset: the notice verifies.
#[tokio::test]
async fn a_body_lands_in_pieces_and_counts_whole() {
    let (inbox, room, id) = region(3000, &[(0, 1000), (1000, 3000)]);
    let bytes = pattern(2000, 3);
    let mut body = inbox.begin_body(id, CONN, 1000, 2000).unwrap();
    let mut at = 0;
    for most in [1, 7, 500, 64].into_iter().cycle() {
        if body.remaining() == 0 {
            break;
        }
        let expected = most.min(300).min(body.remaining() as usize);
        assert_eq!(got(body.recv(300, from(&bytes, &mut at, most)).unwrap()), expected);
    }
    assert_eq!(at, 2000);
    body.finish().unwrap();
    assert_eq!(inbox.bodies_landing(id), 0);
    inbox.on_notice(id, CONN, notice(room, sender(1), 1000, &bytes)).unwrap();
    let first = pattern(1000, 9);
    inbox.on_write(id, sender(0), ConnId(8), &[(0, &first)]).unwrap();
    inbox.on_notice(id, ConnId(8), notice(room, sender(0), 0, &first)).unwrap();
    let got = inbox.wait(id, tokio::time::Instant::now()).await.unwrap();
    assert_eq!(got.buf, [first, bytes].concat());
}

/// A reader may swap the `ReadBuf` it was given for one of its own: what it put there never
/// reached the region, so it is refused (and the region fails) instead of counted as landed.
#[test]
fn a_read_that_put_its_bytes_elsewhere_is_refused() {
    let (inbox, _room, id) = region(1000, &[(0, 1000)]);
    let mut body = inbox.begin_body(id, CONN, 0, 1000).unwrap();
    let elsewhere = |place: &mut ReadBuf<'_>| {
        *place = ReadBuf::new(Box::leak(vec![0u8; 1000].into_boxed_slice()));
        place.put_slice(&[7; 600]);
        Poll::Ready(Ok(()))
    };
    let err = body.recv(1000, elsewhere).unwrap_err();
    assert!(err.to_string().contains("put its bytes elsewhere"), "{err}");
    assert_eq!(inbox.poll(id), KvPoll::Failed);
}

/// A body dropped before its last byte counts for nothing: the region stays open, its
/// bytes are not written (a notice now would find the gap), and the whole write sent again
/// lands and verifies.
#[tokio::test]
async fn a_body_dropped_unfinished_counts_for_nothing_and_may_come_again() {
    let (inbox, room, id) = region(1000, &[(0, 1000)]);
    let mut body = inbox.begin_body(id, CONN, 0, 1000).unwrap();
    let garbage = pattern(1000, 200);
    let mut at = 0;
    got(body.recv(1000, from(&garbage, &mut at, 600)).unwrap());
    assert_eq!(inbox.bodies_landing(id), 1);
    drop(body);
    assert_eq!(inbox.bodies_landing(id), 0);
    assert_eq!(inbox.poll(id), KvPoll::Transferring);

    let bytes = pattern(1000, 1);
    let mut again = inbox.begin_body(id, CONN, 0, 1000).unwrap();
    let mut at = 0;
    while again.remaining() > 0 {
        got(again.recv(256, from(&bytes, &mut at, usize::MAX)).unwrap());
    }
    again.finish().unwrap();
    inbox.on_notice(id, CONN, notice(room, sender(0), 0, &bytes)).unwrap();
    let got = inbox.wait(id, tokio::time::Instant::now()).await.unwrap();
    assert_eq!(got.buf, bytes);
}

/// A body finished short is refused and counts for nothing, as a dropped one.
#[tokio::test]
async fn a_body_finished_short_counts_for_nothing() {
    let (inbox, room, id) = region(100, &[(0, 100)]);
    let mut body = inbox.begin_body(id, CONN, 0, 100).unwrap();
    let bytes = pattern(100, 4);
    let mut at = 0;
    got(body.recv(100, from(&bytes, &mut at, 99)).unwrap());
    let short = body.finish().unwrap_err();
    assert!(short.to_string().contains("1 short"), "{short}");
    assert_eq!(inbox.bodies_landing(id), 0, "let go of");
    let e = inbox.on_notice(id, CONN, notice(room, sender(0), 0, &bytes)).unwrap_err();
    assert!(e.to_string().contains("gap, bytes [0, 100)"), "{e}");
}

/// An empty body counts for nothing, as an empty segment does: the notice's checksum, which
/// leaves empty pairs out, still verifies.
#[tokio::test]
async fn an_empty_body_counts_for_nothing() {
    let (inbox, room, id) = region(100, &[(0, 100)]);
    inbox.begin_body(id, CONN, 10, 0).unwrap().finish().unwrap();
    let bytes = pattern(100, 8);
    inbox.on_write(id, sender(0), CONN, &[(0, &bytes)]).unwrap();
    inbox.on_notice(id, CONN, notice(room, sender(0), 0, &bytes)).unwrap();
    assert_eq!(inbox.poll(id), KvPoll::Success);
}

/// The same write sent again while its first body still lands (that try's connection left
/// half-open) takes the first body's place: the first lands nothing more and does not count
/// even when finished, the second lands and verifies.
#[tokio::test]
async fn a_write_sent_again_takes_the_place_of_its_earlier_body() {
    let (inbox, room, id) = region(100, &[(0, 100)]);
    let mut first = inbox.begin_body(id, CONN, 0, 100).unwrap();
    let garbage = pattern(100, 90);
    let mut at = 0;
    got(first.recv(100, from(&garbage, &mut at, 100)).unwrap());
    // Every byte of the first try is in, but it has not finished.
    let mut again = inbox.begin_body(id, CONN, 0, 100).unwrap();
    assert!(first.recv(100, never).is_err());
    let bytes = pattern(100, 10);
    let mut at = 0;
    got(again.recv(100, from(&bytes, &mut at, 100)).unwrap());
    again.finish().unwrap();
    assert!(first.finish().is_err());
    inbox.on_notice(id, CONN, notice(room, sender(0), 0, &bytes)).unwrap();
    assert_eq!(inbox.wait(id, tokio::time::Instant::now()).await.unwrap().buf, bytes);
}

/// While a body lands, any other write over its bytes (another body, a plain write) fails
/// the region by name, and the landing body reads nothing more.
#[tokio::test]
async fn a_write_over_a_landing_body_fails_the_region() {
    for plain in [false, true] {
        let (inbox, _, id) = region(1000, &[(0, 1000)]);
        let mut body = inbox.begin_body(id, CONN, 0, 500).unwrap();
        let over = if plain {
            inbox.on_write(id, sender(0), CONN, &[(400, &[1u8; 200][..])]).map(drop)
        } else {
            inbox.begin_body(id, CONN, 499, 2).map(drop)
        };
        assert!(over.is_err(), "plain {plain}");
        assert!(body.recv(10, never).is_err());
        let reason = failure(&inbox, id).await;
        assert!(reason.contains("another write is landing"), "{reason}");
    }
}

/// Bodies that may not land are refused before a byte is read: one running past its
/// sender's ranges or over bytes already written fails the region; one at an offset no
/// sender holds, or over a connection its sender is not bound to, changes nothing.
#[tokio::test]
async fn a_body_that_may_not_land_reads_nothing() {
    let (inbox, _, id) = region(1000, &[(0, 500), (500, 1000)]);
    let e = inbox.begin_body(id, CONN, 0, 1001).map(drop).unwrap_err();
    assert!(e.to_string().contains("outside its"), "{e}");
    assert_eq!(inbox.poll(id), KvPoll::Failed);

    let (inbox, _, id) = region(1000, &[(0, 400), (500, 1000)]);
    assert!(inbox.begin_body(id, CONN, 450, 10).is_err(), "no sender holds 450");
    inbox.on_write(id, sender(0), CONN, &[(0, &[5u8; 100][..])]).unwrap();
    assert!(matches!(
        inbox.begin_body(id, ConnId(9), 100, 10).map(drop),
        Err(TransferError::Forbidden(_))
    ));
    assert_eq!(inbox.poll(id), KvPoll::Transferring, "neither touched the region");
    let e = inbox.begin_body(id, CONN, 50, 100).map(drop).unwrap_err();
    assert!(e.to_string().contains("already written"), "{e}");
    assert_eq!(inbox.poll(id), KvPoll::Failed);
}

/// A region that fails while a body lands (its notice came, a sender vanished) takes no more
/// of it, and the body does not count when finished.
#[tokio::test]
async fn a_body_stops_when_its_region_fails() {
    let (inbox, _, id) = region(100, &[(0, 100)]);
    let mut body = inbox.begin_body(id, CONN, 0, 100).unwrap();
    let bytes = pattern(100, 6);
    let mut at = 0;
    got(body.recv(100, from(&bytes, &mut at, 60)).unwrap());
    inbox.fail(id, "the sender vanished");
    assert!(body.recv(100, never).is_err());
    assert!(body.finish().is_err());
    assert_eq!(failure(&inbox, id).await, "the sender vanished");
}

/// A region its waiter took (it gave up) while a body lands takes no more of it.
#[tokio::test]
async fn a_body_stops_when_its_region_is_taken() {
    let (inbox, _, id) = region(100, &[(0, 100)]);
    let mut body = inbox.begin_body(id, CONN, 0, 100).unwrap();
    let timed_out = inbox.wait(id, tokio::time::Instant::now()).await;
    assert!(matches!(timed_out, Err(TransferError::Timeout(_))), "{timed_out:?}");
    assert!(matches!(body.recv(100, never), Err(TransferError::UnknownRegion(_))));
    assert!(body.finish().is_err());
    assert_eq!(inbox.regions(), 0);
}
