//! The accept loop of every transfer listener: a place for each connection (over the limit,
//! connections wait in the listen backlog: backpressure, not drops), then one task per
//! connection, each ended by shutdown.
//!
//! A connection holds its place unproven until its peer shows the cluster token (a hello, a
//! handshake's token). With every place held, a new connection takes the place of the
//! oldest unproven one: a stranger who opens connections and says nothing cannot keep a
//! token holder out, since a token holder's connection proves itself within a round trip.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use handoff_core::Tasks;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

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

/// A connection's place at its listener, handed to its handler: [`Place::proven`] once the
/// peer showed the token, after which the place is the connection's until it ends.
#[derive(Debug)]
pub(crate) struct Place {
    id: u64,
    unproven: Arc<Unproven>,
}

impl Place {
    /// The peer showed the token: the place is no longer given to newer connections.
    pub(crate) fn proven(&self) {
        self.unproven.forget(self.id);
    }
}

impl Drop for Place {
    fn drop(&mut self) {
        self.unproven.forget(self.id);
    }
}

/// A listener's unproven connections, oldest first (ids grow), each with its signal to end.
#[derive(Debug, Default)]
struct Unproven(Mutex<BTreeMap<u64, CancellationToken>>);

impl Unproven {
    fn add(self: &Arc<Self>, id: u64) -> (Place, CancellationToken) {
        let end = CancellationToken::new();
        self.table().insert(id, end.clone());
        (Place { id, unproven: self.clone() }, end)
    }

    fn forget(&self, id: u64) {
        self.table().remove(&id);
    }

    /// Ends the oldest unproven connection; `false` when every connection is proven.
    fn end_oldest(&self) -> bool {
        let oldest = self.table().pop_first();
        oldest.map(|(_, end)| end.cancel()).is_some()
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, CancellationToken>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Serves `listener` on `tasks` until they shut down: at most `max_inbound` connections at
/// once (and one accepted, waiting for a place), each handed to `handle` with its peer, a
/// fresh [`ConnId`] and its [`Place`].
pub(crate) fn serve_accepts<L, F, Fut>(
    listener: L,
    max_inbound: usize,
    tasks: &Tasks,
    what: &'static str,
    handle: F,
) where
    L: Accept + Sync,
    F: Fn(L::Stream, L::Peer, ConnId, Place) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let t = tasks.clone();
    let limit = Arc::new(Semaphore::new(max_inbound.max(1)));
    let unproven = Arc::new(Unproven::default());
    tasks.spawn(async move {
        let mut next_conn = 0u64;
        loop {
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
            let permit = match limit.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    // Every place held: the oldest unproven connection gives its place up.
                    // With none, this one waits for a place, and the backlog behind it.
                    if unproven.end_oldest() {
                        debug!(listener = what, "places full: an unproven connection ended");
                    }
                    tokio::select! {
                        _ = t.shutdown_requested() => break,
                        p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => break },
                    }
                }
            };
            next_conn += 1;
            let (place, ended) = unproven.add(next_conn);
            let served = handle(stream, peer, ConnId(next_conn), place);
            let t2 = t.clone();
            t.spawn(async move {
                tokio::select! {
                    _ = t2.shutdown_requested() => {}
                    _ = ended.cancelled() => {}
                    _ = served => {}
                }
                drop(permit);
            });
        }
    });
}

#[cfg(test)]
mod tests;
