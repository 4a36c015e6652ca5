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

/// Idle connections by peer.
pub(super) type Idle = Mutex<HashMap<AgentAddr, Vec<Box<dyn ClientIo>>>>;

/// Returns `s` to the idle pool, unless `max` connections to `peer` already wait there.
pub(super) fn checkin(idle: &Idle, peer: &AgentAddr, s: Box<dyn ClientIo>, max: usize) {
    let mut idle = idle.lock().unwrap_or_else(|e| e.into_inner());
    let v = idle.entry(peer.clone()).or_default();
    if v.len() < max {
        v.push(s);
    }
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
