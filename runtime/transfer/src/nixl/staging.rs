//! [`Staging`]: the receiving side's staging memory. One arena, registered for the agent's
//! life; a slot per region, lent to each of the region's senders with a ticket of its own
//! (random, told only to that sender). A sender's notice redeems its ticket. The slot goes
//! back once every ticket is redeemed; a slot whose region closed with tickets outstanding
//! rests first, since its senders may still be writing, so no late WRITE lands in a slot lent
//! to another request.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::memory::{Arena, Slot};
use crate::inbox::lock;
use crate::{RegionId, TransferError};

/// Senders of one region at most (prefill ranks).
const MAX_TICKETS: usize = 256;

/// A region's slot and the tickets not yet redeemed.
struct Staged {
    slot: Arc<Slot>,
    tickets: Vec<u64>,
    /// A handshake failed after its sender may have got it: that sender may write without
    /// ever noticing, so the slot rests before it is lent again.
    in_doubt: bool,
}

/// See the module docs.
pub(super) struct Staging {
    arena: Arena,
    /// How long a slot rests when its senders may still write.
    rest: Duration,
    max_regions: usize,
    table: Mutex<HashMap<RegionId, Staged>>,
    resting: Mutex<VecDeque<(Instant, Arc<Slot>)>>,
}

impl Staging {
    pub(super) fn new(arena: Arena, rest: Duration, max_regions: usize) -> Self {
        Staging { arena, rest, max_regions, table: Mutex::default(), resting: Mutex::default() }
    }

    pub(super) fn arena(&self) -> &Arena {
        &self.arena
    }

    /// Lends `region`'s slot (`len` bytes, zeroed, taken at its first handshake) to one more
    /// sender: its address and a fresh ticket. Regions `open` says are closed are taken back
    /// first, and rested slots whose time has come.
    pub(super) fn lend(
        &self,
        region: RegionId,
        len: usize,
        now: Instant,
        open: impl Fn(RegionId) -> bool,
    ) -> Result<(u64, u64), TransferError> {
        self.wake(now);
        // Asked outside the table's lock: `open` takes a region's lock, which a notice holds
        // while it copies its region's bytes, and every other handshake and notice would
        // wait on the table behind it. A region closed stays closed.
        let ids: Vec<RegionId> = lock(&self.table).keys().copied().collect();
        let gone: Vec<RegionId> = ids.into_iter().filter(|id| !open(*id)).collect();
        let closed: Vec<Staged> = {
            let mut table = lock(&self.table);
            gone.iter().filter_map(|id| table.remove(id)).collect()
        };
        closed.into_iter().for_each(|s| self.back(s, now));
        let ticket = rand::random::<u64>();
        if let Some(addr) = self.add_ticket(region, ticket)? {
            return Ok((addr, ticket));
        }
        if lock(&self.table).len() >= self.max_regions {
            return Err(TransferError::Full("nixl staging"));
        }
        // Zeroed outside the table's lock.
        let slot = self
            .arena
            .take(len)
            .ok_or(TransferError::Full("nixl staging memory (NixlConfig::staging_bytes)"))?;
        let slot = Arc::new(slot);
        let mut table = lock(&self.table);
        match table.get_mut(&region) {
            // Another sender's handshake took one meanwhile: share it, give ours back.
            Some(staged) => {
                let full = staged.tickets.len() >= MAX_TICKETS;
                if !full {
                    staged.tickets.push(ticket);
                }
                let addr = self.addr(&staged.slot);
                drop(table);
                self.give(slot, now);
                if full {
                    return Err(TransferError::Full("nixl senders of one region"));
                }
                Ok((addr, ticket))
            }
            None => {
                let addr = self.addr(&slot);
                table.insert(region, Staged { slot, tickets: vec![ticket], in_doubt: false });
                Ok((addr, ticket))
            }
        }
    }

    /// Adds `ticket` to `region`'s slot if it has one; its address.
    fn add_ticket(&self, region: RegionId, ticket: u64) -> Result<Option<u64>, TransferError> {
        let mut table = lock(&self.table);
        let Some(staged) = table.get_mut(&region) else { return Ok(None) };
        if staged.tickets.len() >= MAX_TICKETS {
            return Err(TransferError::Full("nixl senders of one region"));
        }
        staged.tickets.push(ticket);
        Ok(Some(self.addr(&staged.slot)))
    }

    fn addr(&self, slot: &Slot) -> u64 {
        (self.arena.registered().addr() + slot.offset()) as u64
    }

    /// Takes back `ticket`, whose handshake failed: its sender may have got it and begun
    /// writing, so the slot rests before it is lent again, whenever it goes back.
    pub(super) fn cancel(&self, region: RegionId, ticket: u64, now: Instant) {
        let mut table = lock(&self.table);
        let Some(staged) = table.get_mut(&region) else { return };
        staged.tickets.retain(|t| *t != ticket);
        staged.in_doubt = true;
        if staged.tickets.is_empty()
            && let Some(staged) = table.remove(&region)
        {
            drop(table);
            self.rest_slot(staged.slot, now);
        }
    }

    /// Redeems a sender's `ticket` for its notice: the slot to read its bytes from.
    pub(super) fn redeem(&self, region: RegionId, ticket: u64) -> Result<Arc<Slot>, TransferError> {
        let mut table = lock(&self.table);
        let staged = table.get_mut(&region);
        let Some(staged) = staged.filter(|s| s.tickets.contains(&ticket)) else {
            return Err(TransferError::Forbidden(format!(
                "no nixl handshake for region {region:?} with that ticket"
            )));
        };
        staged.tickets.retain(|t| *t != ticket);
        Ok(staged.slot.clone())
    }

    /// After a notice: a region `closed` (verified or failed), or whose tickets are all
    /// redeemed, gives its slot back.
    pub(super) fn settle(&self, region: RegionId, closed: bool, now: Instant) {
        let staged = {
            let mut table = lock(&self.table);
            let done = table.get(&region).is_some_and(|s| closed || s.tickets.is_empty());
            if !done {
                return;
            }
            table.remove(&region)
        };
        if let Some(staged) = staged {
            self.back(staged, now);
        }
    }

    /// A region's slot back: at once if every sender noticed, else after resting.
    fn back(&self, staged: Staged, now: Instant) {
        if staged.tickets.is_empty() && !staged.in_doubt {
            self.give(staged.slot, now);
        } else {
            self.rest_slot(staged.slot, now);
        }
    }

    fn rest_slot(&self, slot: Arc<Slot>, now: Instant) {
        lock(&self.resting).push_back((now + self.rest, slot));
    }

    /// Gives `slot` to the arena, or, while a notice still reads it, to the resting queue.
    fn give(&self, slot: Arc<Slot>, now: Instant) {
        match Arc::try_unwrap(slot) {
            Ok(slot) => self.arena.give(slot),
            Err(shared) => lock(&self.resting).push_back((now, shared)),
        }
    }

    /// Gives back the rested slots whose time has come.
    fn wake(&self, now: Instant) {
        let due: Vec<Arc<Slot>> = {
            let mut resting = lock(&self.resting);
            let (due, waiting): (VecDeque<_>, VecDeque<_>) =
                resting.drain(..).partition(|(t, _)| *t <= now);
            *resting = waiting;
            due.into_iter().map(|(_, s)| s).collect()
        };
        due.into_iter().for_each(|s| self.give(s, now));
    }

    /// Regions with a slot.
    pub(super) fn regions(&self) -> usize {
        lock(&self.table).len()
    }

    /// Slots resting.
    #[cfg(test)]
    pub(super) fn resting(&self) -> usize {
        lock(&self.resting).len()
    }
}
