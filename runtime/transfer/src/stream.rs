//! [`WriteStream`]: one sender's write to one region, posted in parts as they are computed
//! (a prefill's layers), then closed by its notice. The notice's byte count and checksum cover
//! every part, so the receiver verifies the whole as it would a single write: nothing is
//! handed on before the notice binds every byte to the room.
//!
//! A backend that can keep one connection for the whole stream implements
//! [`TransferBackend::open_stream`] (tcp does: every part goes out at once over the connection
//! the region binds the sender to). One whose receivers bind a sender to its peer says
//! [`TransferBackend::posts_parts`] (mooncake, nixl, fake): each part is a write of its own, the
//! notice comes alone at the end. The others hold the parts and post them in one write at
//! the end (the same bytes, verified the same way, without the overlap).
//!
//! The notice's sums ([`NoticeSums`]) are taken by the backend's stream connection when it
//! has one: tcp's shm path hashes each piece of at most 256 KiB just before copying it into
//! the window, so the copy finds it in cache and, in a part of more than a window's half,
//! the receiver lands one half while the sender hashes the next; tcp's sockets sum each
//! part before sending it (see `tcp::stream`). Without one, [`WriteStream::post`] sums.

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use handoff_core::Room;

use xxhash_rust::xxh3::Xxh3;

use crate::inbox::placement::segment_hasher;
use crate::{AgentAddr, Notice, RegionId, SenderId, TransferBackend, TransferError, WriteRequest};

/// A connection a backend dedicates to one streamed write.
#[async_trait]
pub trait StreamConn: Send {
    /// Sends `pairs` (source bytes, destination offset; each at most [`MAX_SEGMENT`] bytes, as
    /// [`WriteStream::post`] splits them) into `region` as `sender`'s, and adds every pair to
    /// `sums` by the time it returns `Ok`. After an `Err` the sums are partial,
    /// and the connection must refuse [`StreamConn::finish`].
    async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
        sums: &mut NoticeSums,
    ) -> Result<(), TransferError>;

    /// Sends the notice and returns once the receiver has verified it (or rejected it).
    async fn finish(self: Box<Self>, region: RegionId, notice: Notice)
    -> Result<(), TransferError>;
}

/// The byte count and checksum a write's notice carries, summed segment by segment (see
/// [`Notice::checksum`]); in any order, as the receiver sums them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct NoticeSums {
    /// Bytes of the segments added.
    pub bytes: u64,
    /// The wrapping sum of their digests.
    pub checksum: u64,
}

impl NoticeSums {
    /// Adds the segment of `bytes` at `offset` (nothing, when it is empty: an empty segment
    /// is never hashed by the receiver either).
    pub fn add(&mut self, offset: u64, bytes: &[u8]) {
        let mut segment = SegmentSum::new(offset, bytes.len());
        segment.feed(bytes);
        self.add_summed(segment);
    }

    /// Adds every (bytes, offset) pair, each a segment of its own.
    pub fn add_pairs(&mut self, pairs: &[(Bytes, u64)]) {
        for (b, off) in pairs {
            self.add(*off, b);
        }
    }

    /// Adds a segment summed piece by piece as it went out (nothing, when it is empty).
    pub(crate) fn add_summed(&mut self, segment: SegmentSum) {
        if segment.len > 0 {
            self.checksum = self.checksum.wrapping_add(segment.hasher.digest());
            self.bytes += segment.len as u64;
        }
    }
}

/// One segment summed piece by piece as its bytes go out: fed every piece in order, then
/// added with [`NoticeSums::add_summed`] (its digest is `segment_digest`'s, however it was
/// fed).
pub(crate) struct SegmentSum {
    len: usize,
    hasher: Xxh3,
}

impl SegmentSum {
    /// The segment of `len` bytes at `offset`, nothing fed yet.
    pub(crate) fn new(offset: u64, len: usize) -> Self {
        SegmentSum { len, hasher: segment_hasher(offset, len as u64) }
    }

    /// Feeds the segment's next bytes.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        self.hasher.update(piece);
    }
}

/// The longest segment a write carries. A longer pair goes as consecutive segments of at
/// most this many bytes, each its own term of the notice's checksum as the receiver hashes
/// them, so every backend's length fields and frames hold one (tcp's frames take 64 MiB).
pub const MAX_SEGMENT: usize = 16 << 20;

/// `pairs` with each pair longer than [`MAX_SEGMENT`] split into consecutive segments (views
/// of its bytes, not copies); the same pairs when none is.
pub(crate) fn segments(pairs: Vec<(Bytes, u64)>) -> Vec<(Bytes, u64)> {
    if pairs.iter().all(|(b, _)| b.len() <= MAX_SEGMENT) {
        return pairs;
    }
    let mut out = Vec::with_capacity(pairs.len() + 1);
    for (b, off) in pairs {
        // One reaching past u64's end stays whole: its receiver refuses it anyway.
        if b.len() <= MAX_SEGMENT || off.checked_add(b.len() as u64).is_none() {
            out.push((b, off));
            continue;
        }
        let mut at = 0;
        while at < b.len() {
            let end = b.len().min(at + MAX_SEGMENT);
            out.push((b.slice(at..end), off + at as u64));
            at = end;
        }
    }
    out
}

/// A streamed write (see the module docs).
pub struct WriteStream {
    backend: Arc<dyn TransferBackend>,
    peer: AgentAddr,
    region: RegionId,
    sender: SenderId,
    conn: Option<Box<dyn StreamConn>>,
    /// Parts held for one write at the end (backends without [`StreamConn`]).
    held: Vec<(Bytes, u64)>,
    sums: NoticeSums,
}

impl std::fmt::Debug for WriteStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteStream")
            .field("peer", &self.peer)
            .field("region", &self.region)
            .field("streamed", &self.conn.is_some())
            .field("bytes", &self.sums.bytes)
            .finish()
    }
}

impl WriteStream {
    /// Opens `sender`'s write into `region` at `peer` over `backend`.
    pub(crate) async fn open(
        backend: Arc<dyn TransferBackend>,
        peer: &AgentAddr,
        region: RegionId,
        sender: SenderId,
    ) -> Result<Self, TransferError> {
        let conn = backend.open_stream(peer).await?;
        Ok(WriteStream {
            backend,
            peer: peer.clone(),
            region,
            sender,
            conn,
            held: Vec::new(),
            sums: NoticeSums::default(),
        })
    }

    /// Posts `pairs` (source bytes, destination offset; a pair longer than [`MAX_SEGMENT`]
    /// goes as several segments): sent at once when the backend has a stream connection
    /// (which sums them) or posts parts, else held for the end; summed here unless the
    /// connection sums them.
    pub async fn post(&mut self, pairs: Vec<(Bytes, u64)>) -> Result<(), TransferError> {
        let pairs = segments(pairs);
        if let Some(c) = &mut self.conn {
            return c.post(self.region, self.sender, &pairs, &mut self.sums).await;
        }
        self.sums.add_pairs(&pairs);
        if self.backend.posts_parts() {
            let (region, sender) = (self.region, self.sender);
            let part = WriteRequest { region, sender, pairs, notice: None };
            return self.backend.post_write(&self.peer, part).await;
        }
        self.held.extend(pairs);
        Ok(())
    }

    /// Closes the write with its notice (room, first token, token counts; bytes and checksum
    /// over every part) and returns once the receiver has verified it.
    pub async fn finish(
        self,
        room: Room,
        first_token: u32,
        tokens: u32,
        cached_tokens: u32,
    ) -> Result<(), TransferError> {
        let notice = Notice {
            room,
            sender: self.sender,
            first_token,
            tokens,
            cached_tokens,
            bytes: self.sums.bytes,
            checksum: self.sums.checksum,
        };
        match self.conn {
            Some(c) => c.finish(self.region, notice).await,
            None => {
                let req = WriteRequest {
                    region: self.region,
                    sender: self.sender,
                    pairs: self.held,
                    notice: Some(notice),
                };
                self.backend.post_write(&self.peer, req).await
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use bytes::Bytes;

    use super::{MAX_SEGMENT, segments};

    #[test]
    fn only_pairs_longer_than_a_segment_are_split_into_views_of_their_bytes() {
        // Zeroed and never touched: the pages are not made.
        let long = Bytes::from(vec![0u8; 2 * MAX_SEGMENT + 1]);
        let pairs =
            vec![(Bytes::new(), 5), (long.clone(), 100), (Bytes::from(vec![1; MAX_SEGMENT]), 7)];
        let got = segments(pairs);
        let at: Vec<(usize, u64)> = got.iter().map(|(b, off)| (b.len(), *off)).collect();
        let m = MAX_SEGMENT as u64;
        let want = [
            (0, 5),
            (MAX_SEGMENT, 100),
            (MAX_SEGMENT, 100 + m),
            (1, 100 + 2 * m),
            (MAX_SEGMENT, 7),
        ];
        assert_eq!(at, want);
        assert_eq!(got[2].0.as_ptr(), long[MAX_SEGMENT..].as_ptr(), "a view, not a copy");
        // Past u64's end: whole, for its receiver to refuse.
        let past = segments(vec![(long, u64::MAX - 10)]);
        assert_eq!(
            past.iter().map(|(b, o)| (b.len(), *o)).collect::<Vec<_>>(),
            [(2 * MAX_SEGMENT + 1, u64::MAX - 10)]
        );
    }
}
