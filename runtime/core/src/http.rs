//! Serving an axum router over HTTP/1.1 and HTTP/2 (prior knowledge, as `axum::serve`
//! does), with the bounds a listener open to clients needs (`axum::serve` sets none):
//! - a connection's first bytes, which say which HTTP it speaks, must arrive within
//!   [`HttpLimits::head_timeout`] ([`sniff`]);
//! - an HTTP/1 request's head must arrive within [`HttpLimits::head_timeout`], counted from
//!   when the connection waits for it: a client that connects and says nothing, trickles a
//!   head, or leaves a kept-alive connection idle is cut off then (90 s: longer than the idle
//!   time of the usual load balancers, which would otherwise reuse a connection being
//!   closed);
//! - a request's body must arrive whole within [`HttpLimits::body_timeout`] of its head, and
//!   the bodies being received hold at most [`HttpLimits::receiving_bytes`] between them
//!   ([`crate::body`]);
//! - at most [`HttpLimits::max_connections`] connections are open at once; the next ones
//!   wait in the listen backlog until one closes (rather than the process running out of
//!   file descriptors, when no listener can accept at all);
//! - an HTTP/2 connection is pinged every 30 s and dropped after 10 s without an answer;
//! - a connection none of whose writes has gone through for [`HttpLimits::write_timeout`] is
//!   closed (a client that stopped reading a response, [`stalled`]).
//!
//! On shutdown it stops accepting, lets each connection finish the request it is serving
//! (an idle one closes at once) and returns when all have closed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::{http1, http2};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulConnection;
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::debug;

use crate::body::{BodyBudget, BoundedBody};

mod sniff;
mod stalled;

use sniff::Spoken;

/// What one HTTP listener allows.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Time an HTTP/1 request's head has to arrive, from when the connection waits for it
    /// (an idle kept-alive connection's too).
    pub head_timeout: Duration,
    /// Time a request's body has to arrive whole, from its head.
    pub body_timeout: Duration,
    /// Bytes the request bodies being received may hold at once, across the listener's
    /// connections; a body whose next bytes would pass it is refused.
    pub receiving_bytes: usize,
    /// Connections open at once.
    pub max_connections: usize,
    /// Time a connection's writes may make no progress (its client not reading) before it
    /// is closed.
    pub write_timeout: Duration,
    /// Time a gRPC connection under these limits (the frontend's Generate listener) may go
    /// without a byte read before it is closed. Not an HTTP bound: a gRPC client that only
    /// receives is heard when it answers the server's pings, sent after 30 s without a
    /// word, so keep it at 45 s or more.
    pub grpc_quiet: Duration,
    /// Once the server stops, how long a connection may take to finish what it serves
    /// (a response to a client that no longer reads, a request whose head or body is still
    /// coming) before it is cut.
    pub shutdown_grace: Duration,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits {
            head_timeout: Duration::from_secs(90),
            body_timeout: Duration::from_secs(60),
            receiving_bytes: 256 << 20,
            max_connections: 16_384,
            write_timeout: Duration::from_secs(30),
            grpc_quiet: Duration::from_secs(90),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// How often an HTTP/2 connection is pinged, and how long its answer may take.
const H2_PING_EVERY: Duration = Duration::from_secs(30);
const H2_PING_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `router` on `listener` within `limits` until `shutdown` completes, then waits for
/// the requests being served.
pub async fn serve<L>(
    mut listener: L,
    router: Router,
    shutdown: impl Future<Output = ()> + Send,
    limits: HttpLimits,
) -> std::io::Result<()>
where
    L: Listener,
    L::Addr: std::fmt::Debug,
{
    // Layered once: each connection gets a clone of the same router.
    let (within, budget) = (limits.body_timeout, BodyBudget::new(limits.receiving_bytes));
    let timed = router.layer(axum::middleware::map_request(move |r: axum::extract::Request| {
        let budget = budget.clone();
        async move { r.map(|b| axum::body::Body::new(BoundedBody::new(b, within, budget))) }
    }));
    let places = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (stop, stopped) = watch::channel(false);
    let mut conns = JoinSet::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        while conns.try_join_next().is_some() {}
        let place = tokio::select! {
            _ = &mut shutdown => break,
            place = places.clone().acquire_owned() => place,
        };
        let Ok(place) = place else { break };
        let (io, peer) = tokio::select! {
            _ = &mut shutdown => break,
            accepted = listener.accept() => accepted,
        };
        debug!(?peer, "HTTP connection accepted");
        let service = TowerToHyperService::new(timed.clone());
        let mut stopped = stopped.clone();
        let io = stalled::StallBounded::new(io, limits.write_timeout);
        conns.spawn(async move {
            let _place = place;
            // A shutdown while its first bytes are awaited: nothing to finish.
            let spoken = tokio::select! {
                spoken = sniff::sniff(io, limits.head_timeout) => spoken,
                _ = stopped.wait_for(|s| *s) => None,
            };
            match spoken {
                None => {}
                Some(Spoken::Http1(io)) => {
                    let mut h1 = http1::Builder::new();
                    h1.timer(TokioTimer::new()).header_read_timeout(limits.head_timeout);
                    let conn = h1.serve_connection(TokioIo::new(io), service);
                    until_stopped(conn, stopped, limits.shutdown_grace).await;
                }
                Some(Spoken::Http2(io)) => {
                    let mut h2 = http2::Builder::new(TokioExecutor::new());
                    h2.timer(TokioTimer::new())
                        .keep_alive_interval(H2_PING_EVERY)
                        .keep_alive_timeout(H2_PING_TIMEOUT);
                    let conn = h2.serve_connection(TokioIo::new(io), service);
                    until_stopped(conn, stopped, limits.shutdown_grace).await;
                }
            }
        });
    }
    drop(listener);
    let _ = stop.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// Serves `conn` until it ends; once `stopped`, it finishes what it is serving and ends, or
/// is cut after `grace`.
async fn until_stopped<C: GracefulConnection>(
    conn: C,
    mut stopped: watch::Receiver<bool>,
    grace: Duration,
) {
    let mut conn = std::pin::pin!(conn);
    tokio::select! {
        _ = conn.as_mut() => return,
        _ = stopped.wait_for(|s| *s) => {}
    }
    conn.as_mut().graceful_shutdown();
    let _ = tokio::time::timeout(grace, conn).await;
}

/// [`serve`] on a TCP listener, over TLS when `tls` is given (see
/// [`TlsListener`](crate::tls::TlsListener)); connections set `TCP_NODELAY` (streamed tokens
/// must not wait on Nagle's algorithm).
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    tls: Option<crate::tls::ListenerTls>,
    router: Router,
    shutdown: impl Future<Output = ()> + Send,
    limits: HttpLimits,
) -> std::io::Result<()> {
    use axum::serve::ListenerExt;
    match tls {
        None => {
            let listener = listener.tap_io(|s| {
                // Best effort: a socket that refuses the option still works, only slower.
                let _ = s.set_nodelay(true);
            });
            serve(listener, router, shutdown, limits).await
        }
        Some(tls) => {
            let listener = crate::tls::TlsListener::new(listener, tls);
            serve(listener, router, shutdown, limits).await
        }
    }
}

#[cfg(test)]
mod tests;
