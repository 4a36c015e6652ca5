//! The decode's PULL socket, where SGLang's prefill ranks push each request's status and
//! `AUX_DATA` rows, in [`handoff_core::zmtp`]: every frame's length is checked before a byte of it
//! is kept, and a frame's buffer grows only as its bytes arrive. A peer that breaks a bound
//! loses its connection; nobody else notices.

use std::collections::HashMap;
use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;
use tracing::{debug, warn};

use handoff_core::log_every::LogEvery;
use handoff_core::zmtp::{Connection, ZmtpError};

/// Connections served at once (one per prefill rank that pushes to this decode); beyond,
/// accepts wait in the backlog.
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections from one address at once (a host's prefill ranks); beyond, a new one is
/// closed at once, so one host cannot take every place.
pub const MAX_PER_PEER: usize = 64;

/// What each message's frames are handed to.
type OnMessage = Arc<dyn Fn(&[Bytes]) + Send + Sync>;

/// One peer's connection: the handshake in time, then each message to `on_message`.
async fn connection(stream: TcpStream, on_message: OnMessage) -> Result<(), ZmtpError> {
    let mut pull = Connection::accept(stream, b"PULL", b"PUSH").await?;
    loop {
        let message = pull.recv().await?;
        on_message(&message);
    }
}

/// Serves PUSH peers on `listener` until `shutdown`, handing each message's frames to
/// `on_message`.
pub async fn serve(
    listener: TcpListener,
    on_message: impl Fn(&[Bytes]) + Send + Sync + 'static,
    shutdown: impl Future<Output = ()>,
) {
    let on_message: OnMessage = Arc::new(on_message);
    let mut peers = JoinSet::new();
    // Each connection's address by its task, so that one which ended in any way (a panic
    // included) gives its place back.
    let mut from_of: HashMap<tokio::task::Id, IpAddr> = HashMap::new();
    let mut refused = LogEvery::new(Duration::from_secs(60));
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            Some(ended) = peers.join_next_with_id(), if !peers.is_empty() => {
                let id = match ended {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                from_of.remove(&id);
            }
            accepted = listener.accept(), if peers.len() < MAX_CONNECTIONS => match accepted {
                Ok((stream, from)) => {
                    // At most `MAX_CONNECTIONS` to count through, once per accept.
                    let held = from_of.values().filter(|&&ip| ip == from.ip()).count();
                    if held >= MAX_PER_PEER {
                        if let Some(refused) = refused.note(std::time::Instant::now()) {
                            warn!(%from, refused, "SGLang PULL connections refused: {MAX_PER_PEER} from one address at most (logged at most once a minute)");
                        }
                        continue;
                    }
                    let on_message = on_message.clone();
                    let task = peers.spawn(async move {
                        if let Err(e) = connection(stream, on_message).await {
                            debug!(%from, error = %e, "SGLang PULL connection ended");
                        }
                    });
                    from_of.insert(task.id(), from.ip());
                }
                Err(e) => {
                    // Out of descriptors, say: a moment for some to close.
                    debug!(error = %e, "SGLang PULL accept");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            },
        }
    }
}

#[cfg(test)]
mod tests;
