//! [`Handshakes`]: the sending side's table of receivers' handshakes, by room, until the
//! room's prefill takes them. Bounded in rooms, in handshakes per room and in each one's size
//! (the token is not kept once checked, the receiver's host is at most [`MAX_HOST_LEN`]
//! bytes); stale rooms go first.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use handoff_core::Room;
use tokio::sync::Notify;
use tokio::time::Instant;

use super::{InboxConfig, lock};
use crate::{ConnectRequest, TransferError};

/// Longest receiver host a handshake may name (a DNS name is at most 253 bytes).
pub(crate) const MAX_HOST_LEN: usize = 255;

struct Pending {
    reqs: Vec<ConnectRequest>,
    since: Instant,
}

/// See the module docs.
pub(super) struct Handshakes {
    token: Option<String>,
    max_rooms: usize,
    max_per_room: usize,
    ttl: Duration,
    pending: Mutex<HashMap<Room, Pending>>,
    changed: Notify,
}

impl Handshakes {
    pub(super) fn new(cfg: &InboxConfig) -> Self {
        Handshakes {
            token: cfg.token.clone(),
            max_rooms: cfg.max_pending_rooms,
            max_per_room: cfg.max_connects_per_room,
            ttl: cfg.pending_ttl,
            pending: Mutex::default(),
            changed: Notify::new(),
        }
    }

    /// Accepts a receiver's handshake for a room this agent will send.
    pub(super) fn on_connect(&self, mut req: ConnectRequest) -> Result<(), TransferError> {
        if let Some(t) = &self.token
            && req.token.as_deref() != Some(t.as_str())
        {
            return Err(TransferError::Unauthorized);
        }
        if req.receiver.ip.len() > MAX_HOST_LEN {
            return Err(TransferError::Malformed(format!(
                "a receiver host of {} bytes (at most {MAX_HOST_LEN})",
                req.receiver.ip.len()
            )));
        }
        req.token = None;
        let mut pending = lock(&self.pending);
        if pending.len() >= self.max_rooms && !pending.contains_key(&req.room) {
            let ttl = self.ttl;
            pending.retain(|_, p| p.since.elapsed() < ttl);
            if pending.len() >= self.max_rooms {
                return Err(TransferError::Full("pending handshake"));
            }
        }
        let entry = pending
            .entry(req.room)
            .or_insert_with(|| Pending { reqs: Vec::new(), since: Instant::now() });
        if entry.reqs.len() >= self.max_per_room {
            return Err(TransferError::Full("handshakes per room"));
        }
        entry.reqs.push(req);
        drop(pending);
        self.changed.notify_waiters();
        Ok(())
    }

    /// Waits until at least `count` handshakes for `room` have arrived, and takes them all
    /// (the caller learns from the first how many it needs, and refuses more).
    pub(super) async fn accept(
        &self,
        room: Room,
        count: usize,
        deadline: Instant,
    ) -> Result<Vec<ConnectRequest>, TransferError> {
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            {
                let mut pending = lock(&self.pending);
                if pending.get(&room).is_some_and(|p| p.reqs.len() >= count) {
                    let p = pending.remove(&room).map(|p| p.reqs).unwrap_or_default();
                    return Ok(p);
                }
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                let have = lock(&self.pending).remove(&room).map_or(0, |p| p.reqs.len());
                return Err(TransferError::Timeout(format!(
                    "waiting for {count} handshakes for room {room}, {have} arrived"
                )));
            }
        }
    }

    /// Rooms with pending handshakes.
    pub(super) fn rooms(&self) -> usize {
        lock(&self.pending).len()
    }
}
