//! A write frame's payload, landed as it arrives: read from the connection in pieces of at
//! most [`PIECE`] bytes into one buffer the connection reuses, each piece copied into its
//! region while it is still in cache and hashed on the way. A frame is never held whole:
//! before, a 12 MB frame was read into a fresh 12 MB buffer and copied out of it from memory.

use tokio::io::{AsyncRead, AsyncReadExt};

use crate::inbox::placement::segment_hasher;
use crate::{ConnId, Inbox, RegionId, SenderId, TransferError};

/// The most bytes read before they are landed: well inside a core's L2.
pub(super) const PIECE: usize = 256 << 10;

/// Who wrote a frame, and where to.
#[derive(Debug, Clone, Copy)]
pub(super) struct Writer {
    pub(super) region: RegionId,
    pub(super) sender: SenderId,
    pub(super) conn: ConnId,
}

/// Reads the payload of a write frame whose head listed `segments` into `inbox`, as `w`.
///
/// The outer error: the connection broke or ended inside the payload (it must close). The
/// inner result: whether the inbox took the write. A refused write's remaining bytes are
/// still read, and dropped, so the connection stays in step with its frames.
pub(super) async fn land<R: AsyncRead + Unpin>(
    r: &mut R,
    piece: &mut Vec<u8>,
    inbox: &Inbox,
    w: Writer,
    segments: &[(u64, u32)],
) -> Result<Result<(), TransferError>, TransferError> {
    // The write as a whole first (region open, sender expected and bound to this
    // connection), as an empty write: a frame of no bytes is checked like any other.
    let mut verdict = inbox.on_write(w.region, w.sender, w.conn, &[]);
    let total: u64 = segments.iter().map(|s| u64::from(s.1)).sum();
    let size = PIECE.min(usize::try_from(total).unwrap_or(PIECE));
    if piece.len() < size {
        piece.resize(size, 0);
    }
    for &(off, len) in segments {
        let len = u64::from(len);
        let mut hasher = segment_hasher(off, len);
        let mut at = 0u64;
        while at < len {
            let n = (len - at).min(PIECE as u64) as usize;
            let buf = &mut piece[..n];
            r.read_exact(buf)
                .await
                .map_err(|e| TransferError::Malformed(format!("reading a write's payload: {e}")))?;
            if verdict.is_ok() {
                verdict = inbox.on_piece(w.region, w.sender, w.conn, off.saturating_add(at), buf);
                hasher.update(buf);
            }
            at += n as u64;
        }
        if verdict.is_ok() && len > 0 {
            inbox.on_segment_end(w.region, w.sender, w.conn, hasher.digest());
        }
    }
    Ok(verdict)
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
        let landed = land(&mut wire.as_slice(), &mut piece, &inbox, w, &segments).await.unwrap();
        landed.unwrap();
        assert_eq!(piece.len(), PIECE, "one piece-sized buffer, not the frame");
        let pairs = vec![(Bytes::from(a.clone()), 100), (Bytes::from(b.clone()), 0)];
        let notice = WriteRequest::new(w.region, pairs, room, w.sender, 1, 1, 0).notice.unwrap();
        inbox.on_notice(w.region, w.conn, notice).unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
        let got = inbox.wait(w.region, deadline).await.unwrap();
        assert_eq!(got.buf, b.iter().chain(&a).copied().collect::<Vec<u8>>());
    }

    #[tokio::test]
    async fn a_refused_write_is_read_to_its_end_and_fails_its_region() {
        let (inbox, _, w) = region(2 * PIECE as u64);
        // The second segment runs past the sender's bytes.
        let segments = [(0u64, PIECE as u32 + 1), (2 * PIECE as u64 - 10, 20)];
        let mut wire = pattern(PIECE + 21, 3);
        wire.extend_from_slice(b"next frame");
        let mut r = wire.as_slice();
        let landed = land(&mut r, &mut Vec::new(), &inbox, w, &segments).await.unwrap();
        assert!(matches!(landed, Err(TransferError::Failed(m)) if m.contains("outside")));
        assert_eq!(r, b"next frame", "the connection stays in step");
        assert_eq!(inbox.poll(w.region), crate::KvPoll::Failed);
    }

    #[tokio::test]
    async fn a_payload_cut_short_breaks_the_connection() {
        let (inbox, _, w) = region(1000);
        let wire = pattern(999, 4);
        let landed = land(&mut wire.as_slice(), &mut Vec::new(), &inbox, w, &[(0, 1000)]).await;
        assert!(matches!(landed, Err(TransferError::Malformed(_))));
    }
}
