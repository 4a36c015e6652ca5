//! [`Body`]: one write whose bytes arrive in pieces and count all or nothing (a Mooncake
//! write's body).
//!
//! Its range is checked and held before a byte is read, so no other write can touch it
//! while it lands. Its bytes are read straight into their place in the region and hashed
//! there. It counts as written, with its segment's digest, only when the last byte is in. A
//! body dropped before then (its connection broke, its time ran out) counts for nothing: its
//! range may be written again, as a sender retrying the write would. A retry may even come
//! before its receiver has noticed the first try broke (a connection left half-open): the
//! same range from the same sender takes the earlier body's place.

use std::io;
use std::ops::Range;
use std::task::Poll;

use xxhash_rust::xxh3::Xxh3;

use super::placement::segment_hasher;
use super::{Inbox, lock};
use crate::{ConnId, RegionId, SenderId, TransferError};

/// A body being landed (see the module docs); dropping it unfinished lets go of its range.
pub(crate) struct Body<'a> {
    inbox: &'a Inbox,
    id: RegionId,
    sender: SenderId,
    /// Its hold's number.
    hold: u64,
    range: Range<u64>,
    /// Bytes landed so far, from the range's start.
    landed: u64,
    hasher: Xxh3,
    settled: bool,
}

impl Inbox {
    /// Begins a body of `len` bytes at `offset` whose sender is not named (Mooncake's
    /// writes): the expected sender whose ranges hold `offset` wrote it, as the shard plan
    /// says, arrived over `conn`. Refused as a write is: a body out of its sender's ranges,
    /// or over bytes written or landing, fails the region. The same write sent again (the
    /// same range) while its earlier body still lands takes that body's place: the earlier
    /// one lands nothing more and does not count.
    pub(crate) fn begin_body(
        &self,
        id: RegionId,
        conn: ConnId,
        offset: u64,
        len: u64,
    ) -> Result<Body<'_>, TransferError> {
        let region = self.region(id)?;
        let mut r = lock(&region);
        let holder = r.expected.iter().find(|(_, p)| p.holds(offset)).map(|(s, _)| *s);
        let Some(sender) = holder else {
            return Err(TransferError::Failed(format!(
                "offset {offset} of {id:?} belongs to no sender"
            )));
        };
        let hold = r.hold(id, sender, conn, (offset, len))?;
        let range = offset..offset + len;
        let hasher = segment_hasher(offset, len);
        Ok(Body { inbox: self, id, sender, hold, range, landed: 0, hasher, settled: false })
    }

    /// Bodies landing in the region now.
    #[cfg(test)]
    pub(crate) fn bodies_landing(&self, id: RegionId) -> usize {
        self.region(id).map_or(0, |r| lock(&r).expected.values().map(|p| p.landing()).sum())
    }
}

impl Body<'_> {
    /// Bytes still to come.
    pub(crate) fn remaining(&self) -> u64 {
        self.range.end - self.range.start - self.landed
    }

    /// Reads at most `n` of the next bytes with `fill` straight into their place in the
    /// region (what `fill` put in its `ReadBuf` counts). `Err`: the region has closed or is gone,
    /// and `fill` was not called.
    pub(crate) fn recv(
        &mut self,
        n: usize,
        fill: impl FnOnce(&mut tokio::io::ReadBuf<'_>) -> Poll<io::Result<()>>,
    ) -> Result<Poll<io::Result<usize>>, TransferError> {
        let n = self.remaining().min(n as u64) as usize;
        let at = self.range.start + self.landed;
        let region = self.inbox.region(self.id)?;
        let mut r = lock(&region);
        let held = (self.sender, self.hold);
        let read = r.fill_held(self.id, held, (at, n), &mut self.hasher, fill)?;
        if let Poll::Ready(Ok(got)) = read {
            self.landed += got.min(n) as u64;
        }
        Ok(read)
    }

    /// Counts the whole body as written. Refused if bytes are still to come or the region
    /// has closed meanwhile; the body counts for nothing then.
    pub(crate) fn finish(mut self) -> Result<(), TransferError> {
        if self.remaining() > 0 {
            return Err(TransferError::Failed(format!(
                "a body of {} bytes finished {} short",
                self.range.end - self.range.start,
                self.remaining()
            )));
        }
        self.settle(Some(self.hasher.digest()))
    }

    fn settle(&mut self, whole: Option<u64>) -> Result<(), TransferError> {
        self.settled = true;
        let region = self.inbox.region(self.id)?;
        let mut r = lock(&region);
        r.settle(self.id, (self.sender, self.hold), whole)
    }
}

impl Drop for Body<'_> {
    fn drop(&mut self) {
        if !self.settled {
            // Gone or closed: nothing more to let go of.
            let _ = self.settle(None);
        }
    }
}

#[cfg(test)]
mod tests;
