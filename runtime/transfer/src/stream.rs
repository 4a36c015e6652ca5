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
//! The notice's sums ([`Tally`]) are taken by the backend's stream connection when it has
//! one: tcp's shm path hashes each piece just before copying it into the window, so the
//! receiver lands the first half while the sender hashes the next, and the copy finds the
//! piece in cache; tcp's sockets sum each part before sending it (see `tcp::stream`).

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use handoff_core::Room;

use xxhash_rust::xxh3::Xxh3;

use crate::inbox::placement::segment_digest;
use crate::{AgentAddr, Notice, RegionId, SenderId, TransferBackend, TransferError, WriteRequest};

/// A connection a backend dedicates to one streamed write.
#[async_trait]
pub trait StreamConn: Send {
    /// Sends `pairs` (source bytes, destination offset) into `region` as `sender`'s, adding
    /// each pair to `tally` no later than its bytes go out.
    async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
        tally: &mut Tally,
    ) -> Result<(), TransferError>;

    /// Sends the notice and returns once the receiver has verified it (or rejected it).
    async fn finish(self: Box<Self>, region: RegionId, notice: Notice)
    -> Result<(), TransferError>;
}

/// The byte count and checksum a write's notice carries, summed segment by segment (see
/// [`Notice::checksum`]); in any order, as the receiver sums them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Tally {
    /// Bytes of the segments added.
    pub bytes: u64,
    /// The wrapping sum of their digests.
    pub checksum: u64,
}

impl Tally {
    /// Adds the segment of `bytes` at `offset` (nothing, when it is empty: an empty segment
    /// is never hashed by the receiver either).
    pub fn add(&mut self, offset: u64, bytes: &[u8]) {
        if !bytes.is_empty() {
            self.checksum = self.checksum.wrapping_add(segment_digest(offset, bytes));
            self.bytes += bytes.len() as u64;
        }
    }

    /// Adds a segment of `len` bytes hashed in chunks as it went out: `hasher` began as
    /// [`crate::inbox::placement::segment_hasher`] of its offset and `len`, and was fed every
    /// byte in order.
    pub(crate) fn add_hashed(&mut self, len: usize, hasher: Xxh3) {
        if len > 0 {
            self.checksum = self.checksum.wrapping_add(hasher.digest());
            self.bytes += len as u64;
        }
    }
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
    tally: Tally,
}

impl std::fmt::Debug for WriteStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteStream")
            .field("peer", &self.peer)
            .field("region", &self.region)
            .field("streamed", &self.conn.is_some())
            .field("bytes", &self.tally.bytes)
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
            tally: Tally::default(),
        })
    }

    /// Posts `pairs` (source bytes, destination offset): sent at once when the backend
    /// streams (and summed as they go), else summed now and held for the end.
    pub async fn post(&mut self, pairs: Vec<(Bytes, u64)>) -> Result<(), TransferError> {
        if let Some(c) = &mut self.conn {
            return c.post(self.region, self.sender, &pairs, &mut self.tally).await;
        }
        for (b, off) in &pairs {
            self.tally.add(*off, b);
        }
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
            bytes: self.tally.bytes,
            checksum: self.tally.checksum,
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
