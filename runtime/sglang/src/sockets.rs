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
            if pushes.len() >= MAX_RANKS && !pushes.contains_key(&key) {
                pushes.retain(|_, p| Arc::strong_count(p) > 1);
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
