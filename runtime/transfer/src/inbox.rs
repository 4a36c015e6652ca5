//! The receiving side of every backend.
//!
//! As a receiver, an inbox holds one region per room: the bytes written so far, per sender
//! its byte ranges (from the shard plan) and what it wrote into them with a running checksum
//! over (offset, length, bytes) ([`placement`]), and the notices received. A write outside
//! the sender's ranges or over bytes already written fails the region. A notice is verified
//! on arrival: its room must be the region's room, every byte of the sender's ranges must
//! have been written exactly once, and its byte count and checksum must match. The region
//! reaches `Success` when every expected sender's notice has verified; any violation fails
//! it (terminal). As a sender, an inbox holds the handshakes
//! (`ConnectRequest`s) that receivers sent for rooms the sender will compute.
//!
//! Region ids are random, so only the senders a region's handshakes went to can name it, and
//! each sender is bound to the connection of its first write or notice: a forged or
//! misdirected frame is refused without touching the region.
//!
//! Every table is bounded; regions are removed when their waiter takes them or gives up.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use handoff_core::Room;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tracing::debug;

use crate::{ConnId, ConnectRequest, KvPoll, Notice, RegionId, SenderId, TransferError};

pub mod placement;

use placement::Placement;

/// Bounds of an inbox.
#[derive(Debug, Clone)]
pub struct InboxConfig {
    /// When set, handshakes must carry this token.
    pub token: Option<String>,
    /// Most regions registered at once.
    pub max_regions: usize,
    /// Largest region.
    pub max_region_bytes: u64,
    /// Most bytes held by all regions at once (beyond, registration is refused as full).
    pub max_total_bytes: u64,
    /// Most rooms with pending handshakes.
    pub max_pending_rooms: usize,
    /// Most handshakes per room.
    pub max_connects_per_room: usize,
    /// How long a handshake waits for its room's prefill before it is dropped.
    pub pending_ttl: Duration,
}

impl Default for InboxConfig {
    fn default() -> Self {
        InboxConfig {
            token: None,
            max_regions: 16_384,
            max_region_bytes: 4 << 30,
            max_total_bytes: 8 << 30,
            max_pending_rooms: 16_384,
            max_connects_per_room: 256,
            pending_ttl: Duration::from_secs(60),
        }
    }
}

/// A verified region, taken out of the inbox.
#[derive(Debug)]
pub struct Received {
    /// The room it was registered for.
    pub room: Room,
    /// The bytes, as the senders wrote them.
    pub buf: Vec<u8>,
    /// Every sender's verified notice.
    pub notices: Vec<Notice>,
}

struct Region {
    room: Room,
    buf: Vec<u8>,
    /// Each expected sender's ranges and progress.
    expected: HashMap<SenderId, Placement>,
    /// The connection each sender is bound to (that of its first write or notice).
    bound: HashMap<SenderId, ConnId>,
    notices: Vec<Notice>,
    state: watch::Sender<KvPoll>,
    error: Option<String>,
}

impl Region {
    /// Binds `sender` to `conn`, or refuses `conn` if the sender is bound to another.
    fn bind(&mut self, id: RegionId, sender: SenderId, conn: ConnId) -> Result<(), TransferError> {
        match *self.bound.entry(sender).or_insert(conn) {
            c if c == conn => Ok(()),
            _ => Err(TransferError::Forbidden(format!(
                "{sender:?} of region {id:?} is bound to another connection"
            ))),
        }
    }

    fn advance(&mut self, to: KvPoll) {
        self.state.send_if_modified(|s| {
            let forward = *s != KvPoll::Failed && *s != KvPoll::Success && to > *s;
            if forward {
                *s = to;
            }
            forward
        });
    }

    fn fail(&mut self, reason: String) {
        if matches!(*self.state.borrow(), KvPoll::Success | KvPoll::Failed) {
            return;
        }
        debug!(room = %self.room, %reason, "KV transfer failed");
        self.error = Some(reason);
        self.state.send_replace(KvPoll::Failed);
    }
}

struct Pending {
    reqs: Vec<ConnectRequest>,
    since: Instant,
}

/// The receiving side of a transfer agent (see the module docs).
pub struct Inbox {
    cfg: InboxConfig,
    regions: Mutex<HashMap<RegionId, Region>>,
    /// Bytes held by `regions` (changed only under its lock).
    held_bytes: std::sync::atomic::AtomicU64,
    pending: Mutex<HashMap<Room, Pending>>,
    pending_changed: Notify,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inbox {
    /// An empty inbox.
    pub fn new(cfg: InboxConfig) -> Self {
        Inbox {
            cfg,
            regions: Mutex::default(),
            held_bytes: Default::default(),
            pending: Mutex::default(),
            pending_changed: Notify::new(),
        }
    }

    // === receiver side ===

    /// Registers a zeroed region of `len` bytes for `room`, expecting from each of
    /// `expected` senders a write of exactly its byte ranges (disjoint from the others', and
    /// inside the region), then its notice.
    pub fn register_region(
        &self,
        room: Room,
        len: u64,
        expected: impl IntoIterator<Item = (SenderId, Vec<Range<u64>>)>,
    ) -> Result<RegionId, TransferError> {
        if len > self.cfg.max_region_bytes {
            return Err(TransferError::Malformed(format!(
                "region of {len} bytes exceeds {}",
                self.cfg.max_region_bytes
            )));
        }
        let expected: Vec<(SenderId, Vec<Range<u64>>)> = expected.into_iter().collect();
        let all = placement::normalize(expected.iter().flat_map(|(_, r)| r.clone()).collect());
        if all.is_none_or(|all| all.last().is_some_and(|r| r.end > len)) {
            return Err(TransferError::Malformed(format!(
                "senders' ranges overlap or run past the region's {len} bytes"
            )));
        }
        let expected: HashMap<SenderId, Placement> = expected
            .into_iter()
            .map(|(s, r)| (s, Placement::new(placement::normalize(r).unwrap_or_default())))
            .collect();
        let mut regions = lock(&self.regions);
        if regions.len() >= self.cfg.max_regions {
            return Err(TransferError::Full("region"));
        }
        let held = self.held_bytes.load(Relaxed);
        if held.saturating_add(len) > self.cfg.max_total_bytes {
            return Err(TransferError::Full("region memory"));
        }
        self.held_bytes.store(held + len, Relaxed);
        let id = loop {
            let id = RegionId(rand::random());
            if id.0 != 0 && !regions.contains_key(&id) {
                break id;
            }
        };
        let region = Region {
            room,
            buf: vec![0; len as usize],
            expected,
            bound: HashMap::new(),
            notices: Vec::new(),
            state: watch::Sender::new(KvPoll::Bootstrapping),
            error: None,
        };
        regions.insert(id, region);
        Ok(id)
    }

    /// The region's state; an unknown region reads as `Failed`.
    pub fn poll(&self, id: RegionId) -> KvPoll {
        lock(&self.regions).get(&id).map_or(KvPoll::Failed, |r| *r.state.borrow())
    }

    /// Marks the handshake for `id` done.
    pub fn mark_connected(&self, id: RegionId) {
        if let Some(r) = lock(&self.regions).get_mut(&id) {
            r.advance(KvPoll::WaitingForInput);
        }
    }

    /// Fails a region (e.g. its sender vanished).
    pub fn fail(&self, id: RegionId, reason: impl Into<String>) {
        if let Some(r) = lock(&self.regions).get_mut(&id) {
            r.fail(reason.into());
        }
    }

    /// Drops a region without waiting for it.
    pub fn release(&self, id: RegionId) {
        let mut regions = lock(&self.regions);
        if let Some(r) = regions.remove(&id) {
            self.held_bytes.fetch_sub(r.buf.len() as u64, Relaxed);
        }
    }

    /// Regions registered.
    pub fn regions(&self) -> usize {
        lock(&self.regions).len()
    }

    /// Bytes the registered regions hold.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Relaxed)
    }

    /// Waits until the region succeeds or fails, or `deadline`; the region is removed
    /// either way.
    pub async fn wait(&self, id: RegionId, deadline: Instant) -> Result<Received, TransferError> {
        let mut rx = {
            let regions = lock(&self.regions);
            regions.get(&id).ok_or(TransferError::UnknownRegion(id))?.state.subscribe()
        };
        let done = rx.wait_for(|s| matches!(s, KvPoll::Success | KvPoll::Failed));
        let timed_out = tokio::time::timeout_at(deadline, done).await.is_err();
        let region = {
            let mut regions = lock(&self.regions);
            let r = regions.remove(&id).ok_or(TransferError::UnknownRegion(id))?;
            self.held_bytes.fetch_sub(r.buf.len() as u64, Relaxed);
            r
        };
        let state = *region.state.borrow();
        match state {
            KvPoll::Success => {
                Ok(Received { room: region.room, buf: region.buf, notices: region.notices })
            }
            KvPoll::Failed => Err(TransferError::Failed(region.error.unwrap_or_default())),
            s if timed_out => Err(TransferError::Timeout(format!("waiting for KV in state {s:?}"))),
            s => Err(TransferError::Failed(format!("region closed in state {s:?}"))),
        }
    }

    /// Applies written segments `(offset, bytes)` from `sender`, arrived over `conn`. A write
    /// out of bounds or from a sender the region does not expect fails the region (only its
    /// senders know its id); one over a connection the sender is not bound to is refused
    /// ([`TransferError::Forbidden`]) and changes nothing.
    pub fn on_write(
        &self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        segments: &[(u64, &[u8])],
    ) -> Result<(), TransferError> {
        let mut regions = lock(&self.regions);
        let r = regions.get_mut(&id).ok_or(TransferError::UnknownRegion(id))?;
        if matches!(*r.state.borrow(), KvPoll::Failed | KvPoll::Success) {
            return Err(TransferError::Failed(format!("region {id:?} is closed")));
        }
        if !r.expected.contains_key(&sender) {
            let reason = format!("write from unexpected sender {sender:?}");
            r.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        r.bind(id, sender, conn)?;
        let Region { buf, expected, .. } = &mut *r;
        let p = expected.get_mut(&sender).ok_or(TransferError::UnknownRegion(id))?;
        let checked = segments.iter().try_for_each(|&(off, b)| {
            p.check(off, b.len() as u64)?;
            // Checked segment by segment: two segments of one frame may overlap too.
            p.record(off, b);
            // An empty segment lands nowhere, whatever its offset (fuzzing found one at 2^34).
            if !b.is_empty() {
                buf[off as usize..off as usize + b.len()].copy_from_slice(b);
            }
            Ok::<(), String>(())
        });
        if let Err(e) = checked {
            let reason = format!("{sender:?}: {e}");
            r.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        r.advance(KvPoll::Transferring);
        Ok(())
    }

    /// Verifies a notice, arrived over `conn`. A notice whose room, byte count or checksum
    /// does not match fails the region (`bootstrap_room mismatch`, `short transfer`,
    /// `checksum mismatch`); one over a connection its sender is not bound to is refused.
    pub fn on_notice(&self, id: RegionId, conn: ConnId, n: Notice) -> Result<(), TransferError> {
        let mut regions = lock(&self.regions);
        let r = regions.get_mut(&id).ok_or(TransferError::UnknownRegion(id))?;
        if matches!(*r.state.borrow(), KvPoll::Failed | KvPoll::Success) {
            return Err(TransferError::Failed(format!("region {id:?} is closed")));
        }
        if r.expected.contains_key(&n.sender) {
            r.bind(id, n.sender, conn)?;
        }
        let reason = if n.room != r.room {
            Some(format!("bootstrap_room mismatch: expected {}, got {}", r.room, n.room))
        } else if r.notices.iter().any(|m| m.sender == n.sender) {
            Some(format!("duplicate notice from {:?}", n.sender))
        } else {
            match r.expected.get(&n.sender) {
                None => Some(format!("notice from unexpected sender {:?}", n.sender)),
                Some(p) => {
                    let (w, got, sum) = (p.total(), p.bytes, p.hasher.digest());
                    if let Some(gap) = p.first_gap() {
                        Some(format!(
                            "short transfer from {:?}: gap, bytes [{}, {}) of its ranges never written ({got} of {w} bytes written)",
                            n.sender, gap.start, gap.end
                        ))
                    } else if got != w || n.bytes != w {
                        Some(format!(
                            "short transfer from {:?}: expected {w} bytes, received {got}, notice says {}",
                            n.sender, n.bytes
                        ))
                    } else if sum != n.checksum {
                        Some(format!(
                            "checksum mismatch from {:?}: computed {sum:016x}, notice says {:016x}",
                            n.sender, n.checksum
                        ))
                    } else {
                        None
                    }
                }
            }
        };
        if let Some(reason) = reason {
            r.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        r.notices.push(n);
        if r.notices.len() == r.expected.len() {
            r.advance(KvPoll::Success);
        }
        Ok(())
    }

    // === sender side ===

    /// Accepts a receiver's handshake for a room this agent will send.
    pub fn on_connect(&self, req: ConnectRequest) -> Result<(), TransferError> {
        if let Some(t) = &self.cfg.token
            && req.token.as_deref() != Some(t.as_str())
        {
            return Err(TransferError::Unauthorized);
        }
        let mut pending = lock(&self.pending);
        if pending.len() >= self.cfg.max_pending_rooms && !pending.contains_key(&req.room) {
            let ttl = self.cfg.pending_ttl;
            pending.retain(|_, p| p.since.elapsed() < ttl);
            if pending.len() >= self.cfg.max_pending_rooms {
                return Err(TransferError::Full("pending handshake"));
            }
        }
        let entry = pending
            .entry(req.room)
            .or_insert_with(|| Pending { reqs: Vec::new(), since: Instant::now() });
        if entry.reqs.len() >= self.cfg.max_connects_per_room {
            return Err(TransferError::Full("handshakes per room"));
        }
        entry.reqs.push(req);
        drop(pending);
        self.pending_changed.notify_waiters();
        Ok(())
    }

    /// Waits until `count` handshakes for `room` have arrived, and takes them.
    pub async fn accept(
        &self,
        room: Room,
        count: usize,
        deadline: Instant,
    ) -> Result<Vec<ConnectRequest>, TransferError> {
        loop {
            let changed = self.pending_changed.notified();
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
    pub fn pending_rooms(&self) -> usize {
        lock(&self.pending).len()
    }
}

#[cfg(test)]
mod tests;
