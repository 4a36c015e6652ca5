//! The sender's shm connection: a Unix socket to the receiver and the window shared over it.
//! [`ShmConn`] copies a write's bytes into a free half and names them in a frame; the ack of
//! that frame frees the half. [`ShmStream`] holds one connection for a streamed write.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::AsyncWriteExt;
use tokio::net::UnixStream;

use super::super::pool::{broke_earlier, io_err, read_ack, reusable};
use super::super::receive::SharedPiece;
use super::super::wire;
use super::ShmPool;
use super::window::{HALF, Window};
use crate::inbox::PIECE;
use crate::stream::SegmentSum;
use crate::{
    AgentAddr, Notice, NoticeSums, RegionId, SenderId, StreamConn, TransferError, WriteRequest,
};

/// A sender's connection to one receiver's shm listener (see the module docs).
#[derive(Debug)]
pub(crate) struct ShmConn {
    pub(super) peer: AgentAddr,
    pub(super) stream: UnixStream,
    pub(super) window: Window,
    /// Halves named in frames not yet acked, oldest first.
    in_flight: VecDeque<u32>,
    /// The half the next bytes go into.
    next: u32,
    max_frame: usize,
}

impl ShmConn {
    pub(super) fn new(
        peer: &AgentAddr,
        stream: UnixStream,
        window: Window,
        max_frame: usize,
    ) -> Self {
        ShmConn {
            peer: peer.clone(),
            stream,
            window,
            in_flight: VecDeque::new(),
            next: 0,
            max_frame,
        }
    }

    /// Copies `pairs` into the window half by half, each half sent as a shared write once
    /// full, and the last at the end. Returns with up to two halves still being landed. With
    /// `sums`, adds each pair to them, hashed a piece at a time just before the piece is
    /// copied.
    pub(crate) async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
        mut sums: Option<&mut NoticeSums>,
    ) -> Result<(), TransferError> {
        let mut pieces: Vec<SharedPiece> = Vec::new();
        let mut used = 0usize;
        for (b, off) in pairs {
            let len = u32::try_from(b.len()).map_err(|_| {
                TransferError::Malformed(format!("a pair of {} bytes (at most 4 GiB)", b.len()))
            })?;
            let mut sum = sums.is_some().then(|| SegmentSum::new(*off, b.len()));
            let mut at = 0usize;
            while at < b.len() {
                if used == HALF {
                    self.send(region, sender, &mut pieces).await?;
                    used = 0;
                }
                if used == 0 {
                    self.claim().await?;
                }
                let n = (b.len() - at).min(HALF - used);
                self.fill_summed(used, &b[at..at + n], sum.as_mut())?;
                pieces.push(SharedPiece { off: *off, len, at: at as u32, n: n as u32 });
                used += n;
                at += n;
            }
            if let (Some(sums), Some(sum)) = (sums.as_deref_mut(), sum) {
                sums.add_summed(sum);
            }
        }
        if used > 0 {
            self.send(region, sender, &mut pieces).await?;
        }
        Ok(())
    }

    /// Copies `bytes` into the next half from `at`, a piece at a time, each fed to `sum` (if
    /// any) just before it is copied: the copy finds it in cache.
    fn fill_summed(
        &mut self,
        at: usize,
        bytes: &[u8],
        mut sum: Option<&mut SegmentSum>,
    ) -> Result<(), TransferError> {
        for (k, piece) in bytes.chunks(PIECE).enumerate() {
            if let Some(sum) = sum.as_deref_mut() {
                sum.feed(piece);
            }
            self.window.fill(self.next, at + k * PIECE, piece)?;
        }
        Ok(())
    }

    /// Waits until the next half is landed (its ack read), if it is out.
    async fn claim(&mut self) -> Result<(), TransferError> {
        while self.in_flight.contains(&self.next) {
            self.take_ack().await?;
        }
        Ok(())
    }

    /// Names the next half's `pieces` in a frame and moves on to the other half.
    async fn send(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pieces: &mut Vec<SharedPiece>,
    ) -> Result<(), TransferError> {
        wire::write_shared(&mut self.stream, region, sender, self.next, pieces)
            .await
            .map_err(|e| io_err(&self.peer, e))?;
        self.in_flight.push_back(self.next);
        self.next ^= 1;
        pieces.clear();
        Ok(())
    }

    /// Reads the ack of the oldest shared write. What it says does not matter here: a write
    /// the receiver refused fails its region, which the notice reports.
    async fn take_ack(&mut self) -> Result<(), TransferError> {
        match read_ack(&self.peer, &mut self.stream, self.max_frame).await {
            Ok(()) | Err(TransferError::Rejected(_)) => {
                self.in_flight.pop_front();
                Ok(())
            }
            Err(e) => Err(e),
        }
    }

    /// Sends the notice right behind the shared writes (the receiver lands a connection's
    /// frames in order, so every half is landed before it reads the notice), then reads the
    /// halves' acks and the notice's, together when they came together.
    pub(crate) async fn finish(
        &mut self,
        region: RegionId,
        notice: &Notice,
    ) -> Result<(), TransferError> {
        let peer = &self.peer;
        wire::write_notice(&mut self.stream, region, notice).await.map_err(|e| io_err(peer, e))?;
        self.stream.flush().await.map_err(|e| io_err(peer, e))?;
        let due = self.in_flight.len() + 1;
        let mut verdicts = wire::read_acks(&mut self.stream, peer, due, self.max_frame).await?;
        // What the halves' acks say does not matter (see `take_ack`); the notice's does.
        let said = verdicts.pop().filter(|_| verdicts.len() + 1 == due);
        self.in_flight.clear();
        match said {
            Some(Ok(())) => Ok(()),
            Some(Err(reason)) => Err(TransferError::Rejected(reason)),
            None => Err(io_err(peer, "connection closed before the ack")),
        }
    }

    /// A whole write: its bytes, then its notice (if any) and the notice's ack. Without a
    /// notice it returns once the bytes are handed over, as a tcp write does, with up to two
    /// halves still being landed: their acks are read by whoever uses the connection next.
    pub(crate) async fn write(&mut self, req: &WriteRequest) -> Result<(), TransferError> {
        self.post(req.region, req.sender, &req.pairs, None).await?;
        match &req.notice {
            Some(n) => self.finish(req.region, n).await,
            None => Ok(()),
        }
    }

    /// Whether the connection still looks usable from the pool: with nothing to be answered,
    /// nothing may be readable (data or end of stream means the receiver is gone).
    pub(super) fn looks_alive(&self) -> bool {
        if !self.in_flight.is_empty() {
            return true;
        }
        let mut probe = [0u8; 1];
        matches!(self.stream.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }
}

/// A streamed write over one shm connection: back to the pool after a completed exchange,
/// dropped (and the stream with it) after one that broke or timed out.
#[derive(Debug)]
pub(crate) struct ShmStream {
    peer: AgentAddr,
    conn: Option<ShmConn>,
    pool: Arc<ShmPool>,
    io_timeout: Duration,
}

impl ShmStream {
    pub(crate) fn new(conn: ShmConn, pool: Arc<ShmPool>, io_timeout: Duration) -> Self {
        ShmStream { peer: conn.peer.clone(), conn: Some(conn), pool, io_timeout }
    }
}

#[async_trait]
impl StreamConn for ShmStream {
    async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
        sums: &mut NoticeSums,
    ) -> Result<(), TransferError> {
        let Some(mut c) = self.conn.take() else { return Err(broke_earlier(&self.peer)) };
        let res =
            match tokio::time::timeout(self.io_timeout, c.post(region, sender, pairs, Some(sums)))
                .await
            {
                Ok(r) => r,
                Err(_) => Err(TransferError::Timeout(format!("streamed write to {}", self.peer))),
            };
        if res.is_ok() {
            self.conn = Some(c);
        }
        res
    }

    async fn finish(
        self: Box<Self>,
        region: RegionId,
        notice: Notice,
    ) -> Result<(), TransferError> {
        let me = *self;
        let Some(mut c) = me.conn else { return Err(broke_earlier(&me.peer)) };
        let res = tokio::time::timeout(me.io_timeout, c.finish(region, &notice))
            .await
            .map_err(|_| TransferError::Timeout(format!("notice to {}", me.peer)))?;
        if reusable(&res) {
            me.pool.checkin(c);
        }
        res
    }
}
