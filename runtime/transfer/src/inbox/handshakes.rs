//! [`Handshakes`]: the sending side's table of receivers' handshakes, by room, until the
//! room's prefill takes them. Bounded in rooms, in handshakes per room and in each one's size
//! (the token is not kept once checked, the receiver's host is at most [`MAX_HOST_LEN`]
//! bytes); stale rooms go first. A room its prefill is done with (served, refused, failed or
//! cancelled) is closed: its handshakes are dropped, and later ones answered and dropped, so
//! requests that ended before their handshakes came leave nothing behind.

use std::collections::{HashMap, HashSet, VecDeque};
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

/// The rooms closed last, at most as many as pending rooms may be, the oldest forgotten first.
#[derive(Default)]
struct Closed {
    rooms: HashSet<Room>,
    order: VecDeque<Room>,
}

impl Closed {
    fn insert(&mut self, room: Room, cap: usize) {
        if !self.rooms.insert(room) {
            return;
        }
        self.order.push_back(room);
        while self.order.len() > cap {
            if let Some(old) = self.order.pop_front() {
                self.rooms.remove(&old);
            }
        }
    }
}

/// See the module docs.
pub(super) struct Handshakes {
    token: Option<String>,
    max_rooms: usize,
    max_per_room: usize,
    ttl: Duration,
    pending: Mutex<HashMap<Room, Pending>>,
    closed: Mutex<Closed>,
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
            closed: Mutex::default(),
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
        // The pending table's lock first, then the closed rooms' (as `close` takes them): a
        // room closed meanwhile is seen closed here, or its entry is removed there.
        let mut pending = lock(&self.pending);
        // Its request ended already: nothing will take it. Answered all the same, as the
        // request's own answer says why it ended (a refusal for overload is not a fault).
        if self.closed(req.room) {
            return Ok(());
        }
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

    /// Closes `room`: its request is done with it, however it ended.
    pub(super) fn close(&self, room: Room) {
        let mut pending = lock(&self.pending);
        lock(&self.closed).insert(room, self.max_rooms);
        pending.remove(&room);
    }

    pub(super) fn closed(&self, room: Room) -> bool {
        lock(&self.closed).rooms.contains(&room)
    }

    /// Rooms with pending handshakes.
    pub(super) fn rooms(&self) -> usize {
        lock(&self.pending).len()
    }
}
