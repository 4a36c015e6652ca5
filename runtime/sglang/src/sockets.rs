//! [`RankSockets`]: one cached ZMQ PUSH socket per prefill rank ([`Connection`]),
//! registered with this decode once. A socket's messages arrive in order, so a registration
//! sent on a socket arrives before any transfer info sent on it after.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::SglangError;
use crate::wire::Registration;
use bytes::Bytes;
use handoff_core::zmtp::Connection;

/// How long connecting to a rank and sending it a message may take.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);
/// Prefill ranks with a cached socket; past it, idle ones are dropped.
const MAX_RANKS: usize = 4096;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn zmq(e: impl std::fmt::Display) -> SglangError {
    SglangError::Zmq(e.to_string())
}

/// One prefill rank's PUSH socket (registered once), behind its own lock: a slow rank holds
/// up only its own requests.
type Slot = Arc<tokio::sync::Mutex<Option<Connection>>>;

/// The PUSH sockets to prefill ranks, by address and attention-TP rank (a rank's
/// registration names metadata pointers of its own).
#[derive(Default)]
pub(crate) struct RankSockets {
    pushes: Mutex<HashMap<(String, usize), Slot>>,
}

impl RankSockets {
    /// Sends `frames` to tp rank `rank` at `addr`, registering with it first (with
    /// `registration`) on a new socket. A send that fails (or is abandoned) drops the
    /// socket: the next one registers again.
    pub(crate) async fn send(
        &self,
        addr: &str,
        rank: usize,
        registration: impl FnOnce() -> Registration,
        frames: Vec<Bytes>,
    ) -> Result<(), SglangError> {
        let key = (addr.to_owned(), rank);
        let slot = {
            let mut pushes = lock(&self.pushes);
            if !pushes.contains_key(&key) {
                // A rank met for the first time (one restarted comes back on a new port):
                // those whose rank closed their connection go, else each restart left one
                // socket in CLOSE_WAIT until the table filled.
                pushes.retain(|_, p| Arc::strong_count(p) > 1 || open(p));
                if pushes.len() >= MAX_RANKS {
                    pushes.retain(|_, p| Arc::strong_count(p) > 1);
                }
            }
            pushes.entry(key).or_default().clone()
        };
        let mut slot = slot.lock().await;
        // A rank that restarted closed our connection: register again on a new one (a
        // message written into the closed one would be lost without a word).
        let mut push = match slot.take().filter(|p| !p.peer_closed()) {
            Some(p) => p,
            None => register(addr, registration()).await?,
        };
        send_on(&mut push, addr, frames).await?;
        *slot = Some(push);
        Ok(())
    }
}

/// Whether `slot`, not in use, holds a connection its rank has not closed.
fn open(slot: &Slot) -> bool {
    slot.try_lock().is_ok_and(|c| c.as_ref().is_some_and(|c| !c.peer_closed()))
}

/// Sockets cached.
#[cfg(test)]
impl RankSockets {
    fn cached(&self) -> usize {
        lock(&self.pushes).len()
    }
}

/// A new PUSH socket to the rank at `addr`, with `registration` sent on it.
async fn register(addr: &str, registration: Registration) -> Result<Connection, SglangError> {
    let mut push = Connection::connect(addr, b"PUSH", b"PULL")
        .await
        .map_err(|e| zmq(format!("connecting to {addr}: {e}")))?;
    send_on(&mut push, addr, registration.frames()).await?;
    Ok(push)
}

async fn send_on(push: &mut Connection, addr: &str, frames: Vec<Bytes>) -> Result<(), SglangError> {
    tokio::time::timeout(SEND_TIMEOUT, push.send(&frames))
        .await
        .map_err(|_| zmq(format!("sending to {addr} timed out")))?
        .map_err(|e| zmq(format!("sending to {addr}: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn registration() -> Registration {
        Registration {
            decode_ip: "127.0.0.1".into(),
            decode_port: 1,
            session: "127.0.0.1:1".into(),
            kv_ptrs: vec![0],
            aux_ptrs: vec![0],
            dst_tp_rank: 0,
            dst_attn_tp_size: 1,
            kv_item_len: 1,
        }
    }

    /// A rank's PULL listener (ours, as SGLang's): its connections kept until `stop`.
    async fn rank() -> (String, tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let serving = tokio::spawn(crate::pull::serve(l, |_| {}, async {
            let _ = stopped.await;
        }));
        (addr, stop, serving)
    }

    /// Found in the soak review: a rank gone (restarted on a new port) left its socket
    /// cached, in CLOSE_WAIT, until 4,096 were; now the next new rank drops it.
    #[tokio::test]
    async fn a_rank_gone_leaves_no_socket_behind_once_another_comes() {
        let sockets = RankSockets::default();
        let (old, stop, serving) = rank().await;
        sockets.send(&old, 0, registration, vec![Bytes::from_static(b"x")]).await.unwrap();
        assert_eq!(sockets.cached(), 1);
        stop.send(()).unwrap();
        serving.await.unwrap();
        // Until the close has reached the cached socket.
        let key = (old.clone(), 0);
        let slot = lock(&sockets.pushes).get(&key).unwrap().clone();
        for _ in 0..500 {
            if !open(&slot) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        drop(slot);
        let (new, stop, serving) = rank().await;
        sockets.send(&new, 0, registration, vec![Bytes::from_static(b"y")]).await.unwrap();
        assert_eq!(sockets.cached(), 1, "the gone rank's socket was dropped");
        stop.send(()).unwrap();
        serving.await.unwrap();
    }
}
