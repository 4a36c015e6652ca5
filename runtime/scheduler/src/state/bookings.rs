//! Selections are leases. Each selection opens a [`Booking`]: the load it queued on one
//! (instance, dp rank) and the pending prefix it noted there. The booking ends exactly once:
//! when its outcome is reported (a second report finds nothing), when it expires unreported,
//! or when its instance leaves or goes silent (its load is forgotten with it). So whatever
//! mix of completed, failed, cancelled and lost requests happens, the load comes back to zero.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use handoff_core::InstanceId;
use handoff_kv_index::Slot;

/// A booking's id: random, never 0 (0 on the wire means "none").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BookingId(pub u64);

/// What one selection holds until it ends.
#[derive(Debug, Clone)]
pub(super) struct Booking {
    /// The (instance, dp rank) it was placed on.
    pub(super) slot: Slot,
    /// That slot's instance (slots are reused after an instance leaves).
    pub(super) instance: InstanceId,
    /// Uncached prefill tokens it queued there.
    pub(super) tokens: u64,
    /// Its pending-prefix entry, if one was noted.
    pub(super) pending: Option<u64>,
    /// When it expires unreported.
    pub(super) until: Instant,
    /// Whether it is its instance's half-open probe: given back if it expires unreported.
    pub(super) probe: bool,
}

/// The open bookings (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Bookings {
    open: HashMap<BookingId, Booking>,
    by_expiry: BTreeSet<(Instant, BookingId)>,
}

impl Bookings {
    /// Open bookings.
    pub(super) fn len(&self) -> usize {
        self.open.len()
    }

    /// Opens `b` under a fresh id.
    pub(super) fn open(&mut self, b: Booking) -> BookingId {
        let id = loop {
            let id = BookingId(rand::random::<u64>());
            if id.0 != 0 && !self.open.contains_key(&id) {
                break id;
            }
        };
        self.by_expiry.insert((b.until, id));
        self.open.insert(id, b);
        id
    }

    /// Closes `id`, returning what it held; `None` if it is not open (already closed).
    pub(super) fn close(&mut self, id: BookingId) -> Option<Booking> {
        let b = self.open.remove(&id)?;
        self.by_expiry.remove(&(b.until, id));
        Some(b)
    }

    /// Closes every booking past its time at `now`.
    pub(super) fn expire(&mut self, now: Instant) -> Vec<Booking> {
        let mut out = Vec::new();
        while let Some(&(until, id)) = self.by_expiry.first() {
            if until > now {
                break;
            }
            self.by_expiry.pop_first();
            out.extend(self.open.remove(&id));
        }
        out
    }

    /// Closes every booking on `instance` (it left or went silent; its load is reset).
    pub(super) fn forget_instance(&mut self, instance: &InstanceId) -> usize {
        let gone: Vec<BookingId> =
            self.open.iter().filter(|(_, b)| &b.instance == instance).map(|(id, _)| *id).collect();
        for id in &gone {
            self.close(*id);
        }
        gone.len()
    }
}
