//! Selections are leases. Each selection opens a [`Booking`]: the load it queued on one
//! (instance, dp rank) and the pending prefix it noted there. The booking ends exactly once:
//! when its outcome is reported (a second report finds nothing), when it expires unreported,
//! or when its instance leaves or goes silent (its load is forgotten with it); one whose
//! frontend leaves discovery (killed, it can report nothing) expires soon after. So whatever
//! mix of completed, failed, cancelled and lost requests happens, the load comes back to zero.

use std::collections::{BTreeSet, HashMap, HashSet};
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
    /// The frontend that asked for it, if it said.
    pub(super) owner: Option<InstanceId>,
    /// Its expiry before its frontend left and it was cut short (given back if the frontend
    /// registers again).
    pub(super) cut_from: Option<Instant>,
}

/// The open bookings (see the module docs).
#[derive(Debug, Default)]
pub(super) struct Bookings {
    open: HashMap<BookingId, Booking>,
    by_expiry: BTreeSet<(Instant, BookingId)>,
    /// The open bookings of each instance: a sweep that silences many instances at once
    /// closes theirs without scanning every open booking for each.
    by_instance: HashMap<InstanceId, HashSet<BookingId>>,
    /// The open bookings of each frontend that named itself.
    by_owner: HashMap<InstanceId, HashSet<BookingId>>,
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
        self.by_instance.entry(b.instance.clone()).or_default().insert(id);
        if let Some(owner) = &b.owner {
            self.by_owner.entry(owner.clone()).or_default().insert(id);
        }
        self.open.insert(id, b);
        id
    }

    /// Takes `id` out of its instance's set, and its owner's.
    fn unlist(&mut self, b: &Booking, id: BookingId) {
        unlist_in(&mut self.by_instance, &b.instance, id);
        if let Some(owner) = &b.owner {
            unlist_in(&mut self.by_owner, owner, id);
        }
    }

    /// Closes `id`, returning what it held; `None` if it is not open (already closed).
    pub(super) fn close(&mut self, id: BookingId) -> Option<Booking> {
        let b = self.open.remove(&id)?;
        self.by_expiry.remove(&(b.until, id));
        self.unlist(&b, id);
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
            if let Some(b) = self.open.remove(&id) {
                self.unlist(&b, id);
                out.push(b);
            }
        }
        out
    }

    /// Closes every booking on `instance` (it left or went silent; its load is reset).
    pub(super) fn forget_instance(&mut self, instance: &InstanceId) -> usize {
        let gone = self.by_instance.remove(instance).unwrap_or_default();
        for &id in &gone {
            if let Some(b) = self.open.remove(&id) {
                self.by_expiry.remove(&(b.until, id));
                if let Some(owner) = &b.owner {
                    unlist_in(&mut self.by_owner, owner, id);
                }
            }
        }
        gone.len()
    }

    /// Has every booking `owner` asked for expire by `until` at the latest (it left);
    /// returns how many it holds.
    pub(super) fn cut_short_owned_by(&mut self, owner: &InstanceId, until: Instant) -> usize {
        let Some(ids) = self.by_owner.get(owner) else { return 0 };
        for id in ids {
            if let Some(b) = self.open.get_mut(id)
                && b.until > until
            {
                self.by_expiry.remove(&(b.until, *id));
                b.cut_from = b.cut_from.or(Some(b.until));
                b.until = until;
                self.by_expiry.insert((until, *id));
            }
        }
        ids.len()
    }

    /// Gives `owner`'s bookings still open the expiry they had before it left (it registered
    /// again: alive, its lease had lapsed); returns how many.
    pub(super) fn restore_owned_by(&mut self, owner: &InstanceId) -> usize {
        let Some(ids) = self.by_owner.get(owner) else { return 0 };
        let mut restored = 0;
        for id in ids {
            if let Some(b) = self.open.get_mut(id)
                && let Some(from) = b.cut_from.take()
            {
                self.by_expiry.remove(&(b.until, *id));
                b.until = from;
                self.by_expiry.insert((from, *id));
                restored += 1;
            }
        }
        restored
    }
}

/// Takes `id` out of `key`'s set in `sets` (the set too, once empty).
fn unlist_in(sets: &mut HashMap<InstanceId, HashSet<BookingId>>, key: &InstanceId, id: BookingId) {
    if let Some(ids) = sets.get_mut(key) {
        ids.remove(&id);
        if ids.is_empty() {
            sets.remove(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use handoff_kv_index::KvIndex;

    use super::*;

    /// A booking of one token on `on`, asked for `by`, until `until`.
    fn booking(on: &str, by: Option<&str>, until: Instant) -> Booking {
        let slot = KvIndex::default().slot_at(0);
        let (instance, owner) = (on.parse().unwrap(), by.map(|b| b.parse().unwrap()));
        Booking {
            slot,
            instance,
            tokens: 1,
            pending: None,
            until,
            probe: false,
            owner,
            cut_from: None,
        }
    }

    /// Bookings of several instances ending every way: each instance's set holds exactly its
    /// open bookings, and forgetting one instance closes its own alone.
    #[test]
    fn each_instance_lists_exactly_its_open_bookings() {
        let t0 = Instant::now();
        let mut bookings = Bookings::default();
        let mut open = |on: &str, secs: u64| {
            bookings.open(booking(on, Some("frontend-1"), t0 + Duration::from_secs(secs)))
        };
        let (a1, _a2, _a3) = (open("a", 10), open("a", 20), open("a", 30));
        let (b1, _b2, _c1) = (open("b", 5), open("b", 40), open("c", 50));
        assert!(bookings.close(a1).is_some() && bookings.close(a1).is_none());
        assert_eq!(bookings.expire(t0 + Duration::from_secs(5)).len(), 1, "b's first");
        assert!(bookings.close(b1).is_none(), "expired already");
        assert_eq!(bookings.forget_instance(&"a".parse().unwrap()), 2);
        assert_eq!(bookings.len(), 2, "b's second and c's");
        let listed: usize = bookings.by_instance.values().map(HashSet::len).sum();
        let owned: usize = bookings.by_owner.values().map(HashSet::len).sum();
        assert_eq!((listed, owned, bookings.by_expiry.len()), (2, 2, 2));
        assert_eq!(bookings.expire(t0 + Duration::from_secs(60)).len(), 2);
        assert!(bookings.by_instance.is_empty() && bookings.open.is_empty());
        assert!(bookings.by_owner.is_empty());
    }

    /// A frontend leaving has exactly the bookings it asked for, on every instance, expire
    /// soon (none later than they would have); registering again, it gives them their time
    /// back.
    #[test]
    fn a_frontend_leaving_cuts_its_own_bookings_short() {
        let t0 = Instant::now();
        let at = |secs: u64| t0 + Duration::from_secs(secs);
        let mut bookings = Bookings::default();
        let mut open =
            |on: &str, by: Option<&str>, secs: u64| bookings.open(booking(on, by, at(secs)));
        let _ = (open("a", Some("f1"), 60), open("b", Some("f1"), 5), open("a", Some("f2"), 60));
        let _anonymous = open("b", None, 60);
        let (f1, f3) = ("f1".parse().unwrap(), "f3".parse().unwrap());
        assert_eq!(bookings.cut_short_owned_by(&f1, at(10)), 2);
        assert_eq!(bookings.cut_short_owned_by(&f3, at(10)), 0);
        // f1 registers again (alive): its 60 s booking is given its time back.
        assert_eq!(bookings.restore_owned_by(&f1), 1, "the one cut");
        assert_eq!(bookings.expire(at(9)).len(), 1, "the one due at 5 s, not made later");
        assert!(bookings.expire(at(10)).is_empty(), "restored");
        // f1 leaves again.
        assert_eq!(bookings.cut_short_owned_by(&f1, at(10)), 1);
        let gone = bookings.expire(at(10));
        assert_eq!(gone.len(), 1);
        assert!(gone[0].owner.as_ref().is_some_and(|o| o.as_str() == "f1"));
        assert_eq!(bookings.len(), 2, "f2's and the anonymous one");
        assert_eq!(bookings.by_expiry.len(), 2);
        assert!(!bookings.by_owner.contains_key(&f1));
    }
}
