//! The accept loop of every transfer listener: a place first (over the limit, connections
//! wait in the listen backlog: backpressure, not drops), then one task per connection, each
//! ended by shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use handoff_core::Tasks;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tracing::warn;

use crate::ConnId;

/// A listener [`serve_accepts`] serves.
pub(crate) trait Accept: Send + 'static {
    /// An accepted connection.
    type Stream: Send + 'static;
    /// Who is on the other end.
    type Peer: Send + 'static;
    /// The next connection.
    fn next(&self) -> impl Future<Output = std::io::Result<(Self::Stream, Self::Peer)>> + Send;
}

impl Accept for TcpListener {
    type Stream = TcpStream;
    type Peer = SocketAddr;
    async fn next(&self) -> std::io::Result<(TcpStream, SocketAddr)> {
        let (s, peer) = self.accept().await?;
        let _ = s.set_nodelay(true);
        Ok((s, peer))
    }
}

impl Accept for UnixListener {
    type Stream = UnixStream;
    type Peer = tokio::net::unix::SocketAddr;
    async fn next(&self) -> std::io::Result<(UnixStream, Self::Peer)> {
        self.accept().await
    }
}

/// Serves `listener` on `tasks` until they shut down: at most `max_inbound` connections at
/// once, each handed to `handle` with its peer and a fresh [`ConnId`].
pub(crate) fn serve_accepts<L, F, Fut>(
    listener: L,
    max_inbound: usize,
    tasks: &Tasks,
    what: &'static str,
    handle: F,
) where
    L: Accept + Sync,
    F: Fn(L::Stream, L::Peer, ConnId) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let t = tasks.clone();
    let limit = Arc::new(Semaphore::new(max_inbound.max(1)));
    tasks.spawn(async move {
        let mut next_conn = 0u64;
        loop {
            let permit = tokio::select! {
                _ = t.shutdown_requested() => break,
                p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
            };
            let accepted = tokio::select! {
                _ = t.shutdown_requested() => break,
                a = listener.next() => a,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, listener = what, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            next_conn += 1;
            let served = handle(stream, peer, ConnId(next_conn));
            let t2 = t.clone();
            t.spawn(async move {
                tokio::select! {
                    _ = t2.shutdown_requested() => {}
                    _ = served => {}
                }
                drop(permit);
            });
        }
    });
}
