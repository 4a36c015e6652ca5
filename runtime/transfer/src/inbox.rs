//! The receiving side of every backend.
//!
//! As a receiver, an inbox holds one region per room: the bytes written so far, per sender
//! its byte ranges (from the shard plan) and what it wrote into them with a running checksum
//! over (offset, length, bytes) ([`placement`]), and the notices received. A write outside
//! the sender's ranges, over bytes already written, or over a body still landing
//! ([`body`]; the same write sent again by the same sender takes that body's place instead)
//! fails the region. A notice is verified on arrival: its room must be the region's room,
//! every byte of the sender's ranges must have been written exactly once, and its byte count
//! and checksum must match. The region reaches `Success` when every expected sender's notice
//! has verified; any violation fails it (terminal). As a sender, an inbox holds the handshakes
//! (`ConnectRequest`s) that receivers sent for rooms the sender will compute.
//!
//! Region ids are random, so only the senders a region's handshakes went to can name it, and
//! each sender is bound to the connection of its first write or notice: a forged or
//! misdirected frame is refused without touching the region.
//!
//! Every table is bounded; regions are removed when their waiter takes them or gives up.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_core::Room;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::{ConnId, ConnectRequest, KvPoll, Notice, RegionId, SenderId, TransferError};

mod body;
mod completion;
mod handshakes;
pub mod placement;
mod region;
mod region_buf;

use handshakes::Handshakes;
use placement::Placement;
use region::Region;
use region_buf::RegionBuf;

/// How recently bytes must have arrived, at a wait's deadline, for the wait to end
/// [`TransferError::Late`] (the sender sending, the link or the receiver slow) rather than
/// [`TransferError::Timeout`] (nothing moving: the sender silent).
pub const ARRIVING: Duration = Duration::from_secs(1);

/// The most bytes one read into a region asks for (and the size of the buffer a refused
/// write's bytes are drained through): well inside a core's L2, so what a read landed is
/// hashed from cache.
pub(crate) const PIECE: usize = 256 << 10;

/// Bytes a piece lands from: copied into its region once, then hashed from the region's copy
/// (what is verified is what was kept). Our own memory, or a window another process shares
/// (`tcp::shm`), which is never seen through a reference.
pub(crate) trait PieceBytes: Copy {
    /// How many bytes.
    fn byte_len(self) -> usize;
    /// `n` of them from `from`, or `None` past the end.
    fn range(self, from: usize, n: usize) -> Option<Self>;
    /// Copies them into `dst`; `false` (nothing copied) unless it has exactly as much room.
    fn copy_to(self, dst: &mut tokio::io::ReadBuf<'_>) -> bool;
}

impl PieceBytes for &[u8] {
    fn byte_len(self) -> usize {
        self.len()
    }

    fn range(self, from: usize, n: usize) -> Option<Self> {
        self.get(from..from.checked_add(n)?)
    }

    fn copy_to(self, dst: &mut tokio::io::ReadBuf<'_>) -> bool {
        let same = dst.remaining() == self.len();
        if same {
            dst.put_slice(self);
        }
        same
    }
}

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

/// Region map shards: a region is found under its shard's lock, then written under its own,
/// so copying and hashing one region's bytes holds up no other.
const SHARDS: usize = 16;

type Shard = Mutex<HashMap<RegionId, Arc<Mutex<Region>>>>;

/// The receiving side of a transfer agent (see the module docs).
pub struct Inbox {
    cfg: InboxConfig,
    shards: [Shard; SHARDS],
    /// Regions registered.
    count: AtomicUsize,
    /// Bytes the regions hold.
    held_bytes: AtomicU64,
    /// The sending side's table.
    handshakes: Handshakes,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inbox").field("cfg", &self.cfg).finish_non_exhaustive()
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inbox {
    /// An empty inbox.
    pub fn new(cfg: InboxConfig) -> Self {
        Inbox {
            handshakes: Handshakes::new(&cfg),
            cfg,
            shards: std::array::from_fn(|_| Mutex::default()),
            count: AtomicUsize::new(0),
            held_bytes: AtomicU64::new(0),
        }
    }

    fn shard(&self, id: RegionId) -> &Shard {
        &self.shards[(id.0 % SHARDS as u64) as usize]
    }

    /// The region, out of its shard (whose lock is let go at once).
    fn region(&self, id: RegionId) -> Result<Arc<Mutex<Region>>, TransferError> {
        lock(self.shard(id)).get(&id).cloned().ok_or(TransferError::UnknownRegion(id))
    }

    /// Takes the region out of the inbox, giving back its place and memory.
    fn take(&self, id: RegionId) -> Option<Arc<Mutex<Region>>> {
        let r = lock(self.shard(id)).remove(&id)?;
        self.count.fetch_sub(1, Relaxed);
        self.held_bytes.fetch_sub(lock(&r).buf.len() as u64, Relaxed);
        Some(r)
    }

    /// Reserves `n` of `max` in `counter`, or refuses.
    fn reserve(counter: &AtomicU64, n: u64, max: u64) -> bool {
        let before = counter.fetch_add(n, Relaxed);
        if before.saturating_add(n) > max {
            counter.fetch_sub(n, Relaxed);
            return false;
        }
        true
    }

    // === receiver side ===

    /// Registers a region of `len` bytes for `room`, expecting from each of `expected`
    /// senders (each named once) a write of exactly its byte ranges (disjoint from the
    /// others', and inside the region), then its notice. Bytes outside every sender's ranges
    /// read as zero.
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
        let Some(all) = all.filter(|all| all.last().is_none_or(|r| r.end <= len)) else {
            return Err(TransferError::Malformed(format!(
                "senders' ranges overlap or run past the region's {len} bytes"
            )));
        };
        let named = expected.len();
        let expected: HashMap<SenderId, Placement> = expected
            .into_iter()
            .map(|(s, r)| (s, Placement::new(placement::normalize(r).unwrap_or_default())))
            .collect();
        // A sender named twice would keep only its last ranges, and the others' bytes would
        // be neither written nor zeroed.
        if expected.len() != named {
            return Err(TransferError::Malformed("a sender is named twice".into()));
        }
        if self.count.fetch_add(1, Relaxed) >= self.cfg.max_regions {
            self.count.fetch_sub(1, Relaxed);
            return Err(TransferError::Full("region"));
        }
        if !Self::reserve(&self.held_bytes, len, self.cfg.max_total_bytes) {
            self.count.fetch_sub(1, Relaxed);
            return Err(TransferError::Full("region memory"));
        }
        let region = Region {
            room,
            buf: RegionBuf::new(len as usize, &all),
            expected,
            bound: HashMap::new(),
            notices: Vec::new(),
            state: watch::Sender::new(KvPoll::Bootstrapping),
            error: None,
        };
        let id = loop {
            let id = RegionId(rand::random());
            let mut shard = lock(self.shard(id));
            if id.0 != 0 && !shard.contains_key(&id) {
                shard.insert(id, Arc::new(Mutex::new(region)));
                break id;
            }
        };
        Ok(id)
    }

    /// The region's state; an unknown region reads as `Failed`.
    pub fn poll(&self, id: RegionId) -> KvPoll {
        self.region(id).map_or(KvPoll::Failed, |r| *lock(&r).state.borrow())
    }

    /// The region's length, while it is open (registered, neither failed nor succeeded).
    pub fn open_len(&self, id: RegionId) -> Option<u64> {
        let r = self.region(id).ok()?;
        let r = lock(&r);
        let open = !matches!(*r.state.borrow(), KvPoll::Failed | KvPoll::Success);
        open.then_some(r.buf.len() as u64)
    }

    /// Whether region `id` is open, without waiting for it: one whose lock is held (a write
    /// or a notice being applied to it, perhaps a copy of its whole length) counts as open.
    pub fn open_now(&self, id: RegionId) -> bool {
        let Ok(r) = self.region(id) else { return false };
        let r = match r.try_lock() {
            Ok(r) => r,
            Err(std::sync::TryLockError::WouldBlock) => return true,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        };
        !matches!(*r.state.borrow(), KvPoll::Failed | KvPoll::Success)
    }

    /// Marks the handshake for `id` done.
    pub fn mark_connected(&self, id: RegionId) {
        if let Ok(r) = self.region(id) {
            lock(&r).advance(KvPoll::WaitingForInput);
        }
    }

    /// Fails a region (e.g. its sender vanished).
    pub fn fail(&self, id: RegionId, reason: impl Into<String>) {
        if let Ok(r) = self.region(id) {
            lock(&r).fail(reason.into());
        }
    }

    /// Drops a region without waiting for it.
    pub fn release(&self, id: RegionId) {
        self.take(id);
    }

    /// Regions registered.
    pub fn regions(&self) -> usize {
        self.count.load(Relaxed)
    }

    /// Bytes the registered regions hold.
    pub fn held_bytes(&self) -> u64 {
        self.held_bytes.load(Relaxed)
    }

    /// Waits until the region succeeds or fails, or `deadline`; the region is removed
    /// either way. Past the deadline with its KV still arriving (every sender missing bytes
    /// sent some in its last [`ARRIVING`], at a rate that moves a KV), the error is
    /// [`TransferError::Late`] (the senders are sending), else [`TransferError::Timeout`].
    pub async fn wait(&self, id: RegionId, deadline: Instant) -> Result<Received, TransferError> {
        let mut rx = lock(&*self.region(id)?).state.subscribe();
        let done = rx.wait_for(|s| matches!(s, KvPoll::Success | KvPoll::Failed));
        let timed_out = tokio::time::timeout_at(deadline, done).await.is_err();
        let region = self.take(id).ok_or(TransferError::UnknownRegion(id))?;
        let mut region = lock(&region);
        let state = *region.state.borrow();
        match state {
            KvPoll::Success => Ok(Received {
                room: region.room,
                // Never `None` in this arm; were it ever, the request fails, not an empty KV.
                buf: region.take_written().ok_or_else(|| {
                    TransferError::Failed("the region succeeded but its bytes are gone".into())
                })?,
                notices: std::mem::take(&mut region.notices),
            }),
            KvPoll::Failed => Err(TransferError::Failed(region.error.take().unwrap_or_default())),
            _ if timed_out && region.arriving(ARRIVING, deadline) => Err(TransferError::Late(
                format!("every sender missing bytes sent some in the last {ARRIVING:?}"),
            )),
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
        let region = self.region(id)?;
        let mut r = lock(&region);
        r.write(id, sender, conn, segments)
    }

    /// Applies one piece `(offset, bytes)` of a segment of `sender`'s whose bytes arrive in
    /// pieces, arrived over `conn`: checked and landed as [`Inbox::on_write`] does, then
    /// hashed into `hasher` (made by [`placement::segment_hasher`]) from the region's copy.
    /// Its digest counts only once the segment ends ([`Inbox::on_segment_end`]): a segment
    /// left unfinished leaves the checksum short, so its notice cannot verify.
    pub(crate) fn on_piece(
        &self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        piece: (u64, impl PieceBytes),
        hasher: &mut xxhash_rust::xxh3::Xxh3,
    ) -> Result<(), TransferError> {
        let region = self.region(id)?;
        let mut r = lock(&region);
        r.write_piece(id, sender, conn, piece, hasher)
    }

    /// [`Inbox::on_piece`] with the piece's bytes read by `fill` straight into the region:
    /// `place` is (offset, at most how many), as for a tcp payload read from its socket.
    /// `Err`: the piece was refused before `fill` was called (the region failed, or the
    /// connection may not write it). Otherwise what `fill` returned, its bytes landed and
    /// hashed.
    pub(crate) fn on_recv(
        &self,
        w: (RegionId, SenderId, ConnId),
        place: (u64, usize),
        hasher: &mut xxhash_rust::xxh3::Xxh3,
        fill: impl FnOnce(&mut tokio::io::ReadBuf<'_>) -> std::task::Poll<std::io::Result<()>>,
    ) -> Result<std::task::Poll<std::io::Result<usize>>, TransferError> {
        let (id, sender, conn) = w;
        let region = self.region(id)?;
        let mut r = lock(&region);
        r.recv_piece(id, sender, conn, place, hasher, fill)
    }

    /// Ends a segment written with [`Inbox::on_piece`]: `digest` is its hasher's.
    pub(crate) fn on_segment_end(&self, id: RegionId, sender: SenderId, conn: ConnId, digest: u64) {
        if let Ok(region) = self.region(id) {
            lock(&region).end_segment(sender, conn, digest);
        }
    }

    // === sender side ===

    /// Accepts a receiver's handshake for a room this agent will send.
    pub fn on_connect(&self, req: ConnectRequest) -> Result<(), TransferError> {
        self.handshakes.on_connect(req)
    }

    /// Waits until `count` handshakes for `room` have arrived, and takes them.
    pub async fn accept(
        &self,
        room: Room,
        count: usize,
        deadline: Instant,
    ) -> Result<Vec<ConnectRequest>, TransferError> {
        self.handshakes.accept(room, count, deadline).await
    }

    /// Closes `room` on this sender: its request is done with it (served, refused, failed or
    /// cancelled). Its pending handshakes are dropped, and later ones answered and dropped.
    pub fn close_room(&self, room: Room) {
        self.handshakes.close(room);
    }

    /// Whether `room` was closed ([`Inbox::close_room`]) lately.
    pub fn room_closed(&self, room: Room) -> bool {
        self.handshakes.closed(room)
    }

    /// Rooms with pending handshakes.
    pub fn pending_rooms(&self) -> usize {
        self.handshakes.rooms()
    }
}

#[cfg(test)]
mod tests;
