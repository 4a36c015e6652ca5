//! [`Region`]: one room's receive buffer, what each sender may write into it and has, the
//! connection each sender is bound to, and its state.

use std::collections::HashMap;
use std::io;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;

use handoff_core::Room;
use tokio::io::ReadBuf;
use tokio::sync::watch;
use tracing::debug;
use xxhash_rust::xxh3::Xxh3;

use super::PieceBytes;
use super::placement::Placement;
use super::region_buf::RegionBuf;
use crate::{ConnId, KvPoll, Notice, RegionId, SenderId, TransferError};

/// A receive region (see the module docs).
pub(super) struct Region {
    pub(super) room: Room,
    pub(super) buf: RegionBuf,
    /// Each expected sender's ranges and progress.
    pub(super) expected: HashMap<SenderId, Placement>,
    /// The connection each sender is bound to (that of its first write or notice).
    pub(super) bound: HashMap<SenderId, ConnId>,
    pub(super) notices: Vec<Notice>,
    pub(super) state: watch::Sender<KvPoll>,
    pub(super) error: Option<String>,
}

impl Region {
    /// Applies written segments from `sender` over `conn` (see [`Inbox::on_write`]).
    pub(super) fn write(
        &mut self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        segments: &[(u64, &[u8])],
    ) -> Result<(), TransferError> {
        self.admit(id, sender, conn)?;
        let Region { buf, expected, .. } = self;
        let p = expected.get_mut(&sender).ok_or(TransferError::UnknownRegion(id))?;
        let checked = segments.iter().try_for_each(|&(off, b)| {
            p.check(off, b.len() as u64)?;
            land(buf, off, b)?;
            // Checked segment by segment: two segments of one frame may overlap too.
            p.record(off, b);
            Ok::<(), String>(())
        });
        let landed: u64 = segments.iter().map(|(_, b)| b.len() as u64).sum();
        if checked.is_ok() && landed > 0 {
            p.arrive(landed, Instant::now());
        }
        self.landed(sender, checked)
    }

    /// Applies a piece of one segment whose bytes arrive in pieces (a tcp frame read as it
    /// comes, a shared window): checked and landed as [`Region::write`] does, then hashed
    /// into `hasher` from the region's own copy (so what is hashed is what was kept, even
    /// if the source changes meanwhile). The caller ends the segment with
    /// [`Region::end_segment`] and the hasher's digest.
    pub(super) fn write_piece(
        &mut self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        (off, piece): (u64, impl PieceBytes),
        hasher: &mut Xxh3,
    ) -> Result<(), TransferError> {
        let n = piece.byte_len();
        let copy = |place: &mut ReadBuf<'_>| {
            piece.copy_to(place);
            Poll::Ready(Ok(()))
        };
        match self.recv_piece(id, sender, conn, (off, n), hasher, copy)? {
            Poll::Ready(Ok(got)) if got == n => Ok(()),
            _ => Err(self.refuse(sender, format!("a piece of {n} bytes at {off} did not land"))),
        }
    }

    /// [`Region::write_piece`] with the bytes read by `fill` straight into their place in
    /// the region (at most `n` of them at `off`; what `fill` put in its `ReadBuf` counts). Checked
    /// before `fill` is called, so a refused piece consumes nothing from the source; bytes
    /// `fill` leaves unread, or scribbles on before it reports none, stay unwritten.
    pub(super) fn recv_piece(
        &mut self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        (off, n): (u64, usize),
        hasher: &mut Xxh3,
        fill: impl FnOnce(&mut ReadBuf<'_>) -> Poll<io::Result<()>>,
    ) -> Result<Poll<io::Result<usize>>, TransferError> {
        self.admit(id, sender, conn)?;
        let Region { buf, expected, .. } = self;
        let p = expected.get_mut(&sender).ok_or(TransferError::UnknownRegion(id))?;
        if let Err(e) = p.check(off, n as u64) {
            return Err(self.refuse(sender, e));
        }
        if n == 0 {
            // Lands nowhere, whatever its offset (see `land`).
            return Ok(Poll::Ready(Ok(0)));
        }
        let Some(mut place) = buf.place(off, n) else {
            let e = format!("[{off}, +{n}) is past the region's {} bytes", buf.len());
            return Err(self.refuse(sender, e));
        };
        let Some(read) = fill_in(&mut place, fill) else {
            return Err(self.refuse(sender, "a read put its bytes elsewhere".into()));
        };
        if let Poll::Ready(Ok(got @ 1..)) = read {
            p.record_range(off, got as u64);
            p.arrive(got as u64, Instant::now());
            hasher.update(place.filled());
            self.advance(KvPoll::Transferring);
        }
        Ok(read)
    }

    /// Holds `len` bytes at `off` for a body of `sender`'s that lands in pieces over `conn`
    /// ([`super::Body`]): admitted and checked as a write is, and a refused one fails the
    /// region, before any of its bytes is read. The same write sent again takes the place of
    /// its earlier body (see [`Placement::take_over`]). `Ok`: the hold's number.
    pub(super) fn hold(
        &mut self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
        (off, len): (u64, u64),
    ) -> Result<u64, TransferError> {
        self.admit(id, sender, conn)?;
        let p = self.expected.get_mut(&sender).ok_or(TransferError::UnknownRegion(id))?;
        p.take_over(off, len);
        if let Err(e) = p.check(off, len) {
            return Err(self.refuse(sender, e));
        }
        Ok(p.hold(off, len))
    }

    /// Lands at most `n` bytes at `off` of the body `sender` holds under `hold`, read by
    /// `fill` straight into their place, and hashes what it read into `hasher` from there.
    /// Refused, with nothing read, once the region has closed, the hold is gone, or outside
    /// the body.
    pub(super) fn fill_held(
        &mut self,
        id: RegionId,
        (sender, hold): (SenderId, u64),
        (off, n): (u64, usize),
        hasher: &mut Xxh3,
        fill: impl FnOnce(&mut ReadBuf<'_>) -> Poll<io::Result<()>>,
    ) -> Result<Poll<io::Result<usize>>, TransferError> {
        self.open(id)?;
        let held = self.expected.get(&sender).is_some_and(|p| p.held(hold, off, n as u64));
        let place = self.buf.place(off, n).filter(|_| held);
        let Some(mut place) = place else {
            return Err(TransferError::Failed(format!(
                "[{off}, +{n}) is not inside a body {sender:?} holds in {id:?}"
            )));
        };
        let Some(read) = fill_in(&mut place, fill) else {
            return Err(self.refuse(sender, "a read put its bytes elsewhere".into()));
        };
        if let Poll::Ready(Ok(got @ 1..)) = read {
            hasher.update(place.filled());
            if let Some(p) = self.expected.get_mut(&sender) {
                p.arrive(got as u64, Instant::now());
            }
            self.advance(KvPoll::Transferring);
        }
        Ok(read)
    }

    /// Lets go of the body `sender` holds under `hold`: written, with its digest, when
    /// `whole` (refused if the region has closed meanwhile, or another body took its place);
    /// otherwise its bytes count for nothing.
    pub(super) fn settle(
        &mut self,
        id: RegionId,
        (sender, hold): (SenderId, u64),
        whole: Option<u64>,
    ) -> Result<(), TransferError> {
        let open = self.open(id);
        let Some(p) = self.expected.get_mut(&sender) else {
            return open;
        };
        let still_held = p.is_held(hold);
        p.settle(hold, whole.filter(|_| open.is_ok()));
        open?;
        if whole.is_some() && !still_held {
            return Err(TransferError::Failed(format!(
                "a body of {sender:?}'s in {id:?} was sent again before it finished"
            )));
        }
        Ok(())
    }

    /// Adds a segment written in pieces to `sender`'s checksum, by the digest its receiver
    /// computed over the pieces ([`super::placement::segment_hasher`]).
    /// Only over the connection the sender is bound to.
    pub(super) fn end_segment(&mut self, sender: SenderId, conn: ConnId, digest: u64) {
        if self.bound.get(&sender) != Some(&conn) {
            return;
        }
        if let Some(p) = self.expected.get_mut(&sender) {
            p.add_digest(digest);
        }
    }

    /// Whether a write from `sender` over `conn` may touch the region: it is open, expects
    /// the sender (else it fails), and the sender is bound to `conn`.
    fn admit(&mut self, id: RegionId, sender: SenderId, conn: ConnId) -> Result<(), TransferError> {
        self.open(id)?;
        if !self.expected.contains_key(&sender) {
            let reason = format!("write from unexpected sender {sender:?}");
            self.fail(reason.clone());
            return Err(TransferError::Failed(reason));
        }
        self.bind(id, sender, conn)
    }

    /// Refuses anything more once the region has failed or succeeded.
    pub(super) fn open(&self, id: RegionId) -> Result<(), TransferError> {
        if matches!(*self.state.borrow(), KvPoll::Failed | KvPoll::Success) {
            return Err(TransferError::Failed(format!("region {id:?} is closed")));
        }
        Ok(())
    }

    /// After a write: a refused one fails the region, with the sender named.
    fn landed(
        &mut self,
        sender: SenderId,
        checked: Result<(), String>,
    ) -> Result<(), TransferError> {
        checked.map_err(|e| self.refuse(sender, e))?;
        self.advance(KvPoll::Transferring);
        Ok(())
    }

    /// Fails the region for what `sender` wrote, named.
    fn refuse(&mut self, sender: SenderId, e: String) -> TransferError {
        let reason = format!("{sender:?}: {e}");
        self.fail(reason.clone());
        TransferError::Failed(reason)
    }

    /// Binds `sender` to `conn`, or refuses `conn` if the sender is bound to another.
    pub(super) fn bind(
        &mut self,
        id: RegionId,
        sender: SenderId,
        conn: ConnId,
    ) -> Result<(), TransferError> {
        match *self.bound.entry(sender).or_insert(conn) {
            c if c == conn => Ok(()),
            _ => Err(TransferError::Forbidden(format!(
                "{sender:?} of region {id:?} is bound to another connection"
            ))),
        }
    }

    /// Whether its KV was still arriving at `at` (a wait's deadline): some sender's bytes
    /// are missing, and every sender missing some was sending within `window` before it, at
    /// a rate that moves a KV ([`Placement::arriving`]). A sender silent (or trickling), or
    /// every byte in with a notice missing, is not arriving: the sender went quiet.
    pub(super) fn arriving(&self, window: Duration, at: Instant) -> bool {
        let mut missing = self.expected.values().filter(|p| !p.complete()).peekable();
        missing.peek().is_some() && missing.all(|p| p.arriving(window, at))
    }

    pub(super) fn advance(&mut self, to: KvPoll) {
        self.state.send_if_modified(|s| {
            let forward = *s != KvPoll::Failed && *s != KvPoll::Success && to > *s;
            if forward {
                *s = to;
            }
            forward
        });
    }

    pub(super) fn fail(&mut self, reason: String) {
        if matches!(*self.state.borrow(), KvPoll::Success | KvPoll::Failed) {
            return;
        }
        debug!(room = %self.room, %reason, "KV transfer failed");
        self.error = Some(reason);
        self.state.send_replace(KvPoll::Failed);
    }
}

/// Runs `fill` on `place`: how many bytes it put there, or `None` if it swapped `place` for
/// another buffer (a reader may: `ReadBuf` is its to replace), whose bytes never reached
/// the region. As tokio's own `read_buf` checks.
fn fill_in(
    place: &mut ReadBuf<'_>,
    fill: impl FnOnce(&mut ReadBuf<'_>) -> Poll<io::Result<()>>,
) -> Option<Poll<io::Result<usize>>> {
    let (at, room) = (place.filled().as_ptr(), place.capacity());
    let read = fill(place);
    let same = place.filled().as_ptr() == at && place.capacity() == room;
    same.then(|| read.map_ok(|()| place.filled().len()))
}

/// Copies checked bytes into the buffer. An empty segment lands nowhere, whatever its offset
/// (fuzzing found one at 2^34).
fn land(buf: &mut RegionBuf, off: u64, b: &[u8]) -> Result<(), String> {
    if b.is_empty() {
        return Ok(());
    }
    let len = buf.len();
    let mut place = buf
        .place(off, b.len())
        .ok_or_else(|| format!("[{off}, +{}) is past the region's {len} bytes", b.len()))?;
    place.put_slice(b);
    Ok(())
}
