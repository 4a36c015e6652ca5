//! A write frame's payload, landed as it arrives.
//!
//! - [`land`]: from the connection, in reads of at most [`PIECE`] bytes into their place in
//!   the region, each hashed there while still in cache. A read of 64 KiB or more with the
//!   connection's read buffer empty goes from the socket straight into the region; what that
//!   buffer already holds (a payload's start behind its frame's head, small segments) is
//!   copied from it, and TLS decrypts through its own buffer. A refused write's bytes are
//!   drained through a buffer the connection reuses. A frame is never held whole.
//! - [`land_shared`]: from a window of memory the sender shares (the shm fast path), each
//!   piece copied straight from the window into its region; a pair (one segment of the
//!   checksum) may span several writes.
//!
//! Either way a piece is hashed from the region's copy, not from its source: what is
//! verified is what was kept.

use std::pin::Pin;
use std::task::Poll;

use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use crate::inbox::placement::segment_hasher;
use crate::inbox::{PIECE, PieceBytes};
use crate::{ConnId, Inbox, RegionId, SenderId, TransferError};

/// Who wrote a frame, and where to.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Writer {
    pub(crate) region: RegionId,
    pub(crate) sender: SenderId,
    pub(crate) conn: ConnId,
}

/// Reads the payload of a write frame whose head listed `segments` into `inbox`, as `w`.
///
/// The outer error: the connection broke or ended inside the payload (it must close). The
/// inner result: whether the inbox took the write. A refused write's remaining bytes are
/// still read, and dropped, so the connection stays in step with its frames.
pub(crate) async fn land<R: AsyncRead + Unpin>(
    r: &mut R,
    piece: &mut Vec<u8>,
    inbox: &Inbox,
    w: Writer,
    segments: &[(u64, u32)],
    admitted: Result<(), TransferError>,
) -> Result<Result<(), TransferError>, TransferError> {
    let mut landing = Landing::new(inbox, w, admitted);
    for &(off, len) in segments {
        landing.begin(off, len);
        let mut at = 0u64;
        while at < u64::from(len) {
            let n = (u64::from(len) - at).min(PIECE as u64) as usize;
            let got = match landing.recv(r, off.saturating_add(at), n).await? {
                Some(got) => got,
                None => landing.drain(r, piece, n).await?,
            };
            at += got as u64;
        }
        landing.end(len);
    }
    Ok(landing.verdict)
}

fn payload_err(e: std::io::Error) -> TransferError {
    TransferError::Malformed(format!("reading a write's payload: {e}"))
}

/// A piece of a pair in a shared write: `n` bytes from `at` into the pair of `len` bytes at
/// `off`. A pair is one segment of the notice's checksum, however many frames it spans.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SharedPiece {
    pub(crate) off: u64,
    pub(crate) len: u32,
    pub(crate) at: u32,
    pub(crate) n: u32,
}

/// A pair begun in one shared write and not yet ended: the next piece must continue it.
pub(crate) struct OpenPair {
    w: Writer,
    off: u64,
    len: u32,
    done: u32,
    hasher: xxhash_rust::xxh3::Xxh3,
}

impl std::fmt::Debug for OpenPair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let OpenPair { w, off, len, done, .. } = self;
        f.debug_struct("OpenPair")
            .field("w", w)
            .field("off", off)
            .field("len", len)
            .field("done", done)
            .finish_non_exhaustive()
    }
}

/// [`land`] from `window`, which holds the `pieces`' bytes one after another. `open` is
/// the connection's pair left open by its last shared write, if any. `Err` (the connection
/// must close) when the pieces need more bytes than the window has, or one does not fit its
/// pair or continue the open one; nothing of this write is landed then.
pub(crate) fn land_shared(
    window: impl PieceBytes,
    inbox: &Inbox,
    w: Writer,
    pieces: &[SharedPiece],
    open: &mut Option<OpenPair>,
    admitted: Result<(), TransferError>,
) -> Result<Result<(), TransferError>, TransferError> {
    check_pieces(window.byte_len(), w, pieces, open.as_ref())?;
    let mut verdict = admitted;
    let mut from = 0usize;
    for p in pieces {
        if p.at == 0 {
            let hasher = segment_hasher(p.off, u64::from(p.len));
            *open = Some(OpenPair { w, off: p.off, len: p.len, done: 0, hasher });
        }
        let Some(pair) = open.as_mut() else {
            return Err(TransferError::Malformed("a piece continuing no pair".into()));
        };
        let Some(bytes) = window.range(from, p.n as usize) else {
            return Err(TransferError::Malformed("a piece past its window".into()));
        };
        if verdict.is_ok() && p.n > 0 {
            let piece = (p.off.saturating_add(u64::from(p.at)), bytes);
            verdict = inbox.on_piece(w.region, w.sender, w.conn, piece, &mut pair.hasher);
        }
        pair.done += p.n;
        from += p.n as usize;
        if pair.done == pair.len {
            if verdict.is_ok() && pair.len > 0 {
                inbox.on_segment_end(w.region, w.sender, w.conn, pair.hasher.digest());
            }
            *open = None;
        }
    }
    Ok(verdict)
}

/// Checks a shared write before anything of it lands: its pieces fit the window, each fits
/// its pair, and each continues the pair open before it (the connection's `open` first).
fn check_pieces(
    window: usize,
    w: Writer,
    pieces: &[SharedPiece],
    open: Option<&OpenPair>,
) -> Result<(), TransferError> {
    let malformed = |m: String| Err(TransferError::Malformed(m));
    let total: u64 = pieces.iter().map(|p| u64::from(p.n)).sum();
    if total > window as u64 {
        return malformed(format!("a shared write of {total} bytes in a window of {window}"));
    }
    let mut pair = open.map(|o| (o.w.region, o.w.sender, o.off, o.len, o.done));
    for p in pieces {
        if p.n == 0 || u64::from(p.at) + u64::from(p.n) > u64::from(p.len) {
            return malformed(format!("an empty piece, or one past its pair: {p:?}"));
        }
        if p.at == 0 {
            // A pair is finished before the next begins: bytes of an abandoned one would
            // count as written and never be hashed.
            if pair.is_some() {
                return malformed(format!("a pair begun with another unfinished: {p:?}"));
            }
            pair = Some((w.region, w.sender, p.off, p.len, 0));
        }
        match &mut pair {
            Some(o) if *o == (w.region, w.sender, p.off, p.len, p.at) => {
                o.4 += p.n;
                if o.4 == o.3 {
                    pair = None;
                }
            }
            _ => return malformed(format!("a piece continuing no pair: {p:?}")),
        }
    }
    Ok(())
}

/// Admits a write before its bytes (region open, sender expected and bound to this
/// connection), as an empty write: a frame of no bytes is checked like any other. An admitted
/// region joins `open`, the regions its connection fails if it breaks.
pub(crate) fn admit(
    inbox: &Inbox,
    w: Writer,
    open: &mut std::collections::HashSet<RegionId>,
) -> Result<(), TransferError> {
    let admitted = inbox.on_write(w.region, w.sender, w.conn, &[]);
    if admitted.is_ok() {
        open.insert(w.region);
    }
    admitted
}

/// One write's landing: the inbox's verdict so far and the segment being hashed.
struct Landing<'a> {
    inbox: &'a Inbox,
    w: Writer,
    verdict: Result<(), TransferError>,
    hasher: xxhash_rust::xxh3::Xxh3,
}

impl<'a> Landing<'a> {
    fn new(inbox: &'a Inbox, w: Writer, admitted: Result<(), TransferError>) -> Self {
        Landing { inbox, w, verdict: admitted, hasher: segment_hasher(0, 0) }
    }

    fn begin(&mut self, off: u64, len: u32) {
        self.hasher = segment_hasher(off, u64::from(len));
    }

    /// Reads `n` (at most [`PIECE`]) bytes of a refused write's payload into `piece`, to be
    /// dropped: the connection stays in step with its frames.
    async fn drain<R: AsyncRead + Unpin>(
        &self,
        r: &mut R,
        piece: &mut Vec<u8>,
        n: usize,
    ) -> Result<usize, TransferError> {
        if piece.len() < n {
            piece.resize(n, 0);
        }
        r.read_exact(&mut piece[..n]).await.map_err(payload_err)?;
        Ok(n)
    }

    /// Reads at most `n` bytes of the payload from `r` straight into the region at `off`:
    /// how many (at least one), or `None` when the write is refused (now or before), with
    /// nothing read. `Err`: the connection broke or ended.
    async fn recv<R: AsyncRead + Unpin>(
        &mut self,
        r: &mut R,
        off: u64,
        n: usize,
    ) -> Result<Option<usize>, TransferError> {
        let (inbox, w) = (self.inbox, self.w);
        let read = std::future::poll_fn(|cx| {
            if self.verdict.is_err() {
                return Poll::Ready(Ok(None));
            }
            let fill = |place: &mut ReadBuf<'_>| Pin::new(&mut *r).poll_read(cx, place);
            match inbox.on_recv((w.region, w.sender, w.conn), (off, n), &mut self.hasher, fill) {
                Ok(Poll::Ready(Ok(0))) => {
                    Poll::Ready(Err(std::io::ErrorKind::UnexpectedEof.into()))
                }
                Ok(read) => read.map_ok(Some),
                Err(e) => {
                    self.verdict = Err(e);
                    Poll::Ready(Ok(None))
                }
            }
        });
        read.await.map_err(payload_err)
    }

    fn end(&mut self, len: u32) {
        if self.verdict.is_ok() && len > 0 {
            let w = self.w;
            self.inbox.on_segment_end(w.region, w.sender, w.conn, self.hasher.digest());
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use bytes::Bytes;
    use handoff_core::Room;

    use super::*;
    use crate::{InboxConfig, WriteRequest};

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed)).collect()
    }

    /// The write admitted, as a served connection admits it.
    fn ok(inbox: &Inbox, w: Writer) -> Result<(), TransferError> {
        admit(inbox, w, &mut Default::default())
    }

    /// An inbox with one region of `len` bytes, all of it sender 0's.
    fn region(len: u64) -> (Inbox, Room, Writer) {
        let inbox = Inbox::new(InboxConfig::default());
        let (room, sender) = (Room::mint(), SenderId::new(0, 0));
        let region = inbox
            .register_region(room, len, [(sender, std::iter::once(0..len).collect())])
            .unwrap();
        (inbox, room, Writer { region, sender, conn: ConnId(7) })
    }

    #[tokio::test]
    async fn segments_longer_than_a_piece_land_exact_and_verify() {
        let long = 3 * PIECE + 7;
        let (inbox, room, w) = region(long as u64 + 100);
        let (a, b) = (pattern(long, 1), pattern(100, 2));
        // The second segment first in the region: pieces land at their own offsets.
        let segments = [(100u64, long as u32), (0, 100)];
        let wire: Vec<u8> = a.iter().chain(&b).copied().collect();
        let mut piece = Vec::new();
        let landed = land(&mut wire.as_slice(), &mut piece, &inbox, w, &segments, ok(&inbox, w))
            .await
            .unwrap();
        landed.unwrap();
        assert!(piece.is_empty(), "an admitted write's bytes pass through no buffer");
        let pairs = vec![(Bytes::from(a.clone()), 100), (Bytes::from(b.clone()), 0)];
        let notice = WriteRequest::new(w.region, pairs, room, w.sender, 1, 1, 0).notice.unwrap();
        inbox.on_notice(w.region, w.conn, notice).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let got = inbox.wait(w.region, deadline).await.unwrap();
        assert_eq!(got.buf, b.iter().chain(&a).copied().collect::<Vec<u8>>());
    }

    /// A payload arriving a few bytes at a time, with the reader waiting in between: each
    /// read lands where it belongs, and the whole verifies as one segment.
    #[tokio::test]
    async fn a_payload_dribbling_in_lands_and_verifies() {
        let (inbox, room, w) = region(5000);
        let data = pattern(5000, 8);
        let (mut tx, mut rx) = tokio::io::duplex(333);
        let send = async {
            for chunk in data.chunks(700) {
                tokio::io::AsyncWriteExt::write_all(&mut tx, chunk).await.unwrap();
                tokio::task::yield_now().await;
            }
        };
        let mut piece = Vec::new();
        let landing = land(&mut rx, &mut piece, &inbox, w, &[(0, 5000)], ok(&inbox, w));
        let ((), landed) = tokio::join!(send, landing);
        landed.unwrap().unwrap();
        let pairs = vec![(Bytes::from(data.clone()), 0)];
        let notice = WriteRequest::new(w.region, pairs, room, w.sender, 1, 1, 0).notice.unwrap();
        inbox.on_notice(w.region, w.conn, notice).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        assert_eq!(inbox.wait(w.region, deadline).await.unwrap().buf, data);
    }

    /// A region failed while its payload is still arriving: the rest is read and dropped,
    /// and the connection stays in step with its frames.
    #[tokio::test]
    async fn a_region_failed_mid_payload_is_drained_to_its_end() {
        let (inbox, _, w) = region(5000);
        let data = pattern(5000, 9);
        let (mut tx, mut rx) = tokio::io::duplex(333);
        let send = async {
            use tokio::io::AsyncWriteExt;
            tx.write_all(&data[..1000]).await.unwrap();
            tokio::task::yield_now().await;
            inbox.fail(w.region, "its decode gave up");
            tx.write_all(&data[1000..]).await.unwrap();
            tx.write_all(b"next frame").await.unwrap();
            drop(tx);
        };
        let mut piece = Vec::new();
        let landing = land(&mut rx, &mut piece, &inbox, w, &[(0, 5000)], ok(&inbox, w));
        // A guard, not a measure: a drain that stopped reading would leave the sender stuck.
        let both =
            tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(send, landing) });
        let ((), landed) = both.await.expect("the payload was not read to its end");
        assert!(matches!(landed.unwrap(), Err(TransferError::Failed(_))));
        let mut rest = Vec::new();
        rx.read_to_end(&mut rest).await.unwrap();
        assert_eq!(rest, b"next frame", "the connection stays in step");
    }

    #[tokio::test]
    async fn a_refused_write_is_read_to_its_end_and_fails_its_region() {
        let (inbox, _, w) = region(2 * PIECE as u64);
        // The second segment runs past the sender's bytes.
        let segments = [(0u64, PIECE as u32 + 1), (2 * PIECE as u64 - 10, 20)];
        let mut wire = pattern(PIECE + 21, 3);
        wire.extend_from_slice(b"next frame");
        let mut r = wire.as_slice();
        let landed =
            land(&mut r, &mut Vec::new(), &inbox, w, &segments, ok(&inbox, w)).await.unwrap();
        assert!(matches!(landed, Err(TransferError::Failed(m)) if m.contains("outside")));
        assert_eq!(r, b"next frame", "the connection stays in step");
        assert_eq!(inbox.poll(w.region), crate::KvPoll::Failed);
    }

    #[tokio::test]
    async fn a_payload_cut_short_breaks_the_connection() {
        let (inbox, _, w) = region(1000);
        let wire = pattern(999, 4);
        let landed =
            land(&mut wire.as_slice(), &mut Vec::new(), &inbox, w, &[(0, 1000)], ok(&inbox, w))
                .await;
        assert!(matches!(landed, Err(TransferError::Malformed(_))));
    }

    #[tokio::test]
    async fn a_pair_spanning_two_shared_writes_verifies_as_one_segment() {
        let (inbox, room, w) = region(1000);
        let data = pattern(1000, 5);
        let piece = |at: u32, n: u32| SharedPiece { off: 0, len: 1000, at, n };
        let mut open = None;
        let first =
            land_shared(&data[..600], &inbox, w, &[piece(0, 600)], &mut open, ok(&inbox, w));
        first.unwrap().unwrap();
        assert!(open.is_some(), "the pair stays open between the writes");
        let second =
            land_shared(&data[600..], &inbox, w, &[piece(600, 400)], &mut open, ok(&inbox, w));
        second.unwrap().unwrap();
        assert!(open.is_none());
        let pairs = vec![(Bytes::from(data.clone()), 0)];
        let notice = WriteRequest::new(w.region, pairs, room, w.sender, 1, 1, 0).notice.unwrap();
        inbox.on_notice(w.region, w.conn, notice).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        assert_eq!(inbox.wait(w.region, deadline).await.unwrap().buf, data);
    }

    #[test]
    fn shared_pieces_that_continue_no_pair_or_overrun_are_malformed() {
        let (inbox, _, w) = region(1000);
        let window = pattern(1000, 6);
        let bad = [
            SharedPiece { off: 0, len: 1000, at: 600, n: 400 },
            SharedPiece { off: 0, len: 100, at: 50, n: 60 },
            SharedPiece { off: 0, len: 2000, at: 0, n: 2000 },
        ];
        for p in bad {
            let landed = land_shared(window.as_slice(), &inbox, w, &[p], &mut None, Ok(()));
            assert!(matches!(landed, Err(TransferError::Malformed(_))), "{p:?}");
        }
        assert_eq!(inbox.poll(w.region), crate::KvPoll::Bootstrapping, "nothing landed");
        // With a pair open, a piece must take it up exactly where it stopped.
        let mut open = None;
        let begun = SharedPiece { off: 0, len: 1000, at: 0, n: 600 };
        land_shared(window.as_slice(), &inbox, w, &[begun], &mut open, ok(&inbox, w))
            .unwrap()
            .unwrap();
        for at in [500, 700] {
            let p = SharedPiece { off: 0, len: 1000, at, n: 100 };
            let landed = land_shared(window.as_slice(), &inbox, w, &[p], &mut open, ok(&inbox, w));
            assert!(matches!(landed, Err(TransferError::Malformed(_))), "{p:?}");
        }
    }
}
