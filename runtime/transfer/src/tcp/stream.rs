//! The tcp backend's streamed writes ([`crate::WriteStream`]): one pooled connection held for
//! the whole stream, each part sent as it is posted, the notice's ack read at the end. The
//! connection goes back to the pool only after a completed exchange; one that broke or timed
//! out mid-stream is dropped, and so is the stream.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use tokio::io::{AsyncWriteExt, BufWriter};

use super::pool::{ClientIo, broke_earlier, io_err, read_ack, reusable};
use super::{TcpTransfer, wire};
use crate::idle::Idle;
use crate::{AgentAddr, Notice, NoticeSums, RegionId, SenderId, StreamConn, TransferError};

/// One streamed write's connection.
pub(super) struct TcpStreamConn {
    peer: AgentAddr,
    /// `None` once an exchange on it failed.
    conn: Option<Box<dyn ClientIo>>,
    idle: Arc<Idle<Box<dyn ClientIo>>>,
    max_frame: usize,
    io_timeout: Duration,
}

impl TcpStreamConn {
    pub(super) fn new(peer: &AgentAddr, conn: Box<dyn ClientIo>, t: &TcpTransfer) -> Self {
        TcpStreamConn {
            peer: peer.clone(),
            conn: Some(conn),
            idle: t.idle.clone(),
            max_frame: t.cfg.max_frame,
            io_timeout: t.cfg.io_timeout,
        }
    }
}

#[async_trait]
impl StreamConn for TcpStreamConn {
    async fn post(
        &mut self,
        region: RegionId,
        sender: SenderId,
        pairs: &[(Bytes, u64)],
        sums: &mut NoticeSums,
    ) -> Result<(), TransferError> {
        let (peer, max_frame, within) = (self.peer.clone(), self.max_frame, self.io_timeout);
        // Out while it is written: a post abandoned midway leaves no connection behind with
        // half a frame on it. A post that fails ends the stream (no finish after it).
        let Some(mut s) = self.conn.take() else { return Err(broke_earlier(&self.peer)) };
        wire::check_fits(pairs, max_frame)?;
        // Summed before any byte goes. Summed piece by piece between the writes instead (as
        // shm does), a loopback receiver ran dry between pieces and slept: a transfer at a time
        // measured slower, with a third more context switches.
        sums.add_pairs(pairs);
        let send = async {
            let mut w = BufWriter::with_capacity(wire::BUFFERED, &mut s);
            wire::write_pairs(&mut w, region, sender, pairs, max_frame).await?;
            w.flush().await
        };
        let res = match tokio::time::timeout(within, send).await {
            Ok(r) => r.map_err(|e| io_err(&peer, e)),
            Err(_) => Err(TransferError::Timeout(format!("streamed write to {peer}"))),
        };
        if res.is_ok() {
            self.conn = Some(s);
        }
        res
    }

    async fn finish(
        self: Box<Self>,
        region: RegionId,
        notice: Notice,
    ) -> Result<(), TransferError> {
        let me = *self;
        let Some(mut s) = me.conn else { return Err(broke_earlier(&me.peer)) };
        let peer = &me.peer;
        let exchange = async {
            wire::write_notice(&mut s, region, &notice).await.map_err(|e| io_err(peer, e))?;
            s.flush().await.map_err(|e| io_err(peer, e))?;
            read_ack(peer, &mut s, me.max_frame).await
        };
        let res = tokio::time::timeout(me.io_timeout, exchange)
            .await
            .map_err(|_| TransferError::Timeout(format!("notice to {peer}")))?;
        if reusable(&res) {
            me.idle.put(peer, s);
        }
        res
    }
}

#[cfg(test)]
mod tests;
