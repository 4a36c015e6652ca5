//! The tcp backend's dialed connections ([`ClientIo`]), the idle pool they return to, and the
//! ack every exchange on one ends with.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::wire::{self, Frame};
use crate::{AgentAddr, TransferError};

/// A connection this agent dialed: plain, or TLS over the socket.
pub(super) trait ClientIo:
    AsyncRead + AsyncWrite + Unpin + Send + Sync + std::fmt::Debug
{
    /// The socket under it.
    fn socket(&self) -> &TcpStream;
}

impl ClientIo for TcpStream {
    fn socket(&self) -> &TcpStream {
        self
    }
}

impl ClientIo for tokio_rustls::client::TlsStream<TcpStream> {
    fn socket(&self) -> &TcpStream {
        self.get_ref().0
    }
}

/// Idle connections by peer, at most `max` per peer.
#[derive(Debug)]
pub(super) struct Idle<C> {
    by_peer: Mutex<HashMap<AgentAddr, Vec<C>>>,
    max: usize,
}

impl<C> Idle<C> {
    pub(super) fn new(max: usize) -> Self {
        Idle { by_peer: Mutex::default(), max }
    }

    /// The connection to `peer` returned last that `alive` accepts; those it refuses on the
    /// way are dropped.
    pub(super) fn take(&self, peer: &AgentAddr, alive: impl Fn(&C) -> bool) -> Option<C> {
        loop {
            let c = self.lock().get_mut(peer).and_then(Vec::pop)?;
            if alive(&c) {
                return Some(c);
            }
        }
    }

    /// Returns `c`, a connection to `peer`, unless `max` already wait there.
    pub(super) fn put(&self, peer: &AgentAddr, c: C) {
        let mut by_peer = self.lock();
        let v = by_peer.entry(peer.clone()).or_default();
        if v.len() < self.max {
            v.push(c);
        }
    }

    /// Connections waiting, to every peer.
    #[cfg(test)]
    pub(super) fn len(&self) -> usize {
        self.lock().values().map(Vec::len).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<AgentAddr, Vec<C>>> {
        self.by_peer.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Whether the connection an exchange ended on can serve another: the exchange completed,
/// answered even if refused.
pub(super) fn reusable(res: &Result<(), TransferError>) -> bool {
    matches!(res, Ok(()) | Err(TransferError::Rejected(_)))
}

/// A stream whose connection failed an exchange before.
pub(super) fn broke_earlier(peer: &AgentAddr) -> TransferError {
    io_err(peer, "the stream's connection broke earlier")
}

/// An I/O failure with `peer`.
pub(super) fn io_err(peer: &AgentAddr, e: impl std::fmt::Display) -> TransferError {
    TransferError::Io { peer: peer.clone(), reason: e.to_string() }
}

/// Reads the peer's ack of an exchange.
pub(super) async fn read_ack<S: AsyncRead + Unpin>(
    peer: &AgentAddr,
    s: &mut S,
    max_frame: usize,
) -> Result<(), TransferError> {
    match wire::read_frame(s, max_frame).await? {
        Some(Frame::Ack(Ok(()))) => Ok(()),
        Some(Frame::Ack(Err(reason))) => Err(TransferError::Rejected(reason)),
        Some(other) => Err(TransferError::Malformed(format!("expected an ack, got {other:?}"))),
        None => Err(io_err(peer, "connection closed before the ack")),
    }
}
