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

use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use handoff_core::Room;

use crate::inbox::placement::segment_digest;
use crate::{AgentAddr, Notice, RegionId, SenderId, TransferBackend, TransferError, WriteRequest};

/// A connection a backend dedicates to one streamed write.
#[async_trait]
pub trait StreamConn: Send {
    /// Sends `pairs` (source bytes, destination offset) into `region` as `sender`'s.
    async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
    ) -> Result<(), TransferError>;

    /// Sends the notice and returns once the receiver has verified it (or rejected it).
    async fn finish(self: Box<Self>, region: RegionId, notice: Notice)
    -> Result<(), TransferError>;
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
    bytes: u64,
    checksum: u64,
}

impl std::fmt::Debug for WriteStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WriteStream")
            .field("peer", &self.peer)
            .field("region", &self.region)
            .field("streamed", &self.conn.is_some())
            .field("bytes", &self.bytes)
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
            bytes: 0,
            checksum: 0,
        })
    }

    /// Posts `pairs` (source bytes, destination offset): sent at once when the backend
    /// streams, else held for the end.
    pub async fn post(&mut self, pairs: Vec<(Bytes, u64)>) -> Result<(), TransferError> {
        for (b, off) in pairs.iter().filter(|(b, _)| !b.is_empty()) {
            self.checksum = self.checksum.wrapping_add(segment_digest(*off, b));
            self.bytes += b.len() as u64;
        }
        match &mut self.conn {
            Some(c) => c.post(self.region, self.sender, &pairs).await,
            None if self.backend.posts_parts() => {
                let (region, sender) = (self.region, self.sender);
                let part = WriteRequest { region, sender, pairs, notice: None };
                self.backend.post_write(&self.peer, part).await
            }
            None => {
                self.held.extend(pairs);
                Ok(())
            }
        }
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
            bytes: self.bytes,
            checksum: self.checksum,
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
