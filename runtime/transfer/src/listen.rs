//! The accept loop of every transfer listener: a place for each connection (over the limit,
//! connections wait in the listen backlog: backpressure, not drops), then one task per
//! connection, each ended by shutdown.
//!
//! A connection holds its place unproven until its peer shows the cluster token (a hello, a
//! handshake's token). With every place held, a new connection takes the place of the
//! oldest unproven one, if it has been unproven for a grace (a second by default): a
//! stranger who opens connections and says nothing cannot keep a token holder out, since a
//! token holder's connection proves itself within a round trip, and a burst of token
//! holders' fresh connections waits for places rather than ending each other's hellos.

use std::collections::BTreeMap;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use handoff_core::Tasks;
use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};
use tokio::sync::Semaphore;
use tokio::time::Instant;
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

/// An unproven connection: since when, and its signal to end.
type Entry = (Instant, CancellationToken);

/// A listener's unproven connections, oldest first (ids grow with time).
#[derive(Debug, Default)]
struct Unproven(Mutex<BTreeMap<u64, Entry>>);

impl Unproven {
    fn add(self: &Arc<Self>, id: u64, now: Instant) -> (Place, CancellationToken) {
        let end = CancellationToken::new();
        self.table().insert(id, (now, end.clone()));
        (Place { id, unproven: self.clone() }, end)
    }

    fn forget(&self, id: u64) {
        self.table().remove(&id);
    }

    /// Ends the oldest unproven connection if it has been so for `grace` as of `now`.
    fn end_oldest(&self, now: Instant, grace: Duration) -> Oldest {
        let mut table = self.table();
        let Some(entry) = table.first_entry() else { return Oldest::None };
        let due = entry.get().0 + grace;
        if now < due {
            return Oldest::Young(due);
        }
        entry.remove().1.cancel();
        Oldest::Ended
    }

    fn table(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What [`Unproven::end_oldest`] did.
#[derive(Debug, PartialEq)]
enum Oldest {
    /// It ended: its place is free soon.
    Ended,
    /// It is unproven for less than the grace, which ends at this instant.
    Young(Instant),
    /// Every connection is proven.
    None,
}

/// A listener's places: how many connections at once, and how long one may stay unproven
/// before a newer connection may take its place.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Places {
    pub(crate) max: usize,
    pub(crate) grace: Duration,
}

/// Serves `listener` on `tasks` until they shut down: at most `places.max` connections at
/// once (and one accepted, waiting for a place), each handed to `handle` with its peer, a
/// fresh [`ConnId`] and its [`Place`].
pub(crate) fn serve_accepts<L, F, Fut>(
    listener: L,
    places: Places,
    tasks: &Tasks,
    what: &'static str,
    handle: F,
) where
    L: Accept + Sync,
    F: Fn(L::Stream, L::Peer, ConnId, Place) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let t = tasks.clone();
    let limit = Arc::new(Semaphore::new(places.max.max(1)));
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
            let Some(permit) = place_for(&limit, &unproven, places.grace, &t, what).await else {
                break;
            };
            next_conn += 1;
            // Its grace counts from its place, not its accept: a token holder that waited
            // for one has its whole second to say its hello in.
            let (place, ended) = unproven.add(next_conn, Instant::now());
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

/// A place for a connection just accepted: a free one, or the oldest unproven connection's
/// once past its grace; meanwhile the backlog waits. `None` at shutdown.
async fn place_for(
    limit: &Arc<Semaphore>,
    unproven: &Unproven,
    grace: Duration,
    tasks: &Tasks,
    what: &'static str,
) -> Option<tokio::sync::OwnedSemaphorePermit> {
    loop {
        if let Ok(p) = limit.clone().try_acquire_owned() {
            return Some(p);
        }
        let wake = match unproven.end_oldest(Instant::now(), grace) {
            Oldest::Ended => {
                debug!(listener = what, "places full: an unproven connection ended");
                None
            }
            Oldest::Young(due) => Some(due),
            Oldest::None => None,
        };
        let again = async {
            match wake {
                Some(due) => tokio::time::sleep_until(due).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = tasks.shutdown_requested() => return None,
            p = limit.clone().acquire_owned() => return p.ok(),
            () = again => {}
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;
