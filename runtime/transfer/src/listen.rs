//! The accept loop of every transfer listener: a place first (over the limit, connections
//! wait in the listen backlog: backpressure, not drops), then one task per connection, each
//! ended by shutdown.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use handoff_core::Tasks;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tracing::warn;

use crate::ConnId;

/// Serves `listener` on `tasks` until they shut down: at most `max_inbound` connections at
/// once, each handed to `handle` with its peer and a fresh [`ConnId`].
pub(crate) fn serve_accepts<F, Fut>(
    listener: TcpListener,
    max_inbound: usize,
    tasks: &Tasks,
    what: &'static str,
    handle: F,
) where
    F: Fn(TcpStream, SocketAddr, ConnId) -> Fut + Send + Sync + 'static,
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
                a = listener.accept() => a,
            };
            let (stream, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    warn!(error = %e, listener = what, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
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
