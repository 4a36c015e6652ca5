//! Serving an axum router over HTTP/1.1, as `axum::serve` does, with the bounds a listener
//! open to clients needs (`axum::serve` sets neither):
//! - a request's head must arrive within [`HttpLimits::head_timeout`], counted from when the
//!   connection waits for it: a client that connects and says nothing, trickles a head, or
//!   leaves a kept-alive connection idle is cut off then;
//! - at most [`HttpLimits::max_connections`] connections are open at once; the next ones
//!   wait in the listen backlog until one closes (rather than the process running out of
//!   file descriptors, when no listener can accept at all).
//!
//! On shutdown it stops accepting, lets each connection finish the request it is serving
//! (an idle one closes at once) and returns when all have closed.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::serve::Listener;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinSet;
use tracing::debug;

/// What one HTTP listener allows.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    /// Time a request's head has to arrive, from when the connection waits for it.
    pub head_timeout: Duration,
    /// Connections open at once.
    pub max_connections: usize,
}

impl Default for HttpLimits {
    fn default() -> Self {
        HttpLimits { head_timeout: Duration::from_secs(30), max_connections: 4096 }
    }
}

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
        let service = TowerToHyperService::new(router.clone());
        let mut stopped = stopped.clone();
        conns.spawn(async move {
            let _place = place;
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(limits.head_timeout)
                .serve_connection(TokioIo::new(io), service);
            let mut conn = std::pin::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => return,
                _ = stopped.wait_for(|s| *s) => {}
            }
            conn.as_mut().graceful_shutdown();
            let _ = conn.await;
        });
    }
    drop(listener);
    let _ = stop.send(true);
    while conns.join_next().await.is_some() {}
    Ok(())
}

/// [`serve`] on a TCP listener, over TLS when `tls` is given (see
/// [`TlsListener`](crate::tls::TlsListener)); connections set `TCP_NODELAY` (streamed tokens
/// must not wait on Nagle's algorithm).
pub async fn serve_tcp(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
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
        Some(acceptor) => {
            let listener = crate::tls::TlsListener::new(listener, acceptor);
            serve(listener, router, shutdown, limits).await
        }
    }
}

#[cfg(test)]
mod tests;
