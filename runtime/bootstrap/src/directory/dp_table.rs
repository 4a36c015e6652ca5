//! The room -> dp rank table: entries expire after a TTL and the table never holds more than
//! its capacity (the oldest entry goes first), whatever the request rate.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

#[derive(Debug)]
pub(super) struct DpTable {
    capacity: usize,
    ttl: Duration,
    seq: u64,
    entries: HashMap<u64, (u32, u64)>,
    // Insertion order; an entry whose seq no longer matches `entries` is stale.
    pub(super) order: VecDeque<(u64, u64, Instant)>,
}

impl DpTable {
    pub(super) fn new(capacity: usize, ttl: Duration) -> Self {
        DpTable {
            capacity: capacity.max(1),
            ttl,
            seq: 0,
            entries: HashMap::new(),
            order: VecDeque::new(),
        }
    }

    pub(super) fn insert(&mut self, room: u64, dp_rank: u32, now: Instant) {
        self.expire(now);
        self.seq += 1;
        if self.entries.insert(room, (dp_rank, self.seq)).is_none() {
            while self.entries.len() > self.capacity {
                self.pop_oldest();
            }
        }
        self.order.push_back((room, self.seq, now));
        if self.order.len() > 2 * self.capacity {
            // Many re-registrations of the same rooms: drop the stale order entries.
            let entries = &self.entries;
            self.order.retain(|(r, s, _)| entries.get(r).is_some_and(|e| e.1 == *s));
        }
    }

    fn pop_oldest(&mut self) {
        while let Some((room, seq, _)) = self.order.pop_front() {
            if self.entries.get(&room).is_some_and(|e| e.1 == seq) {
                self.entries.remove(&room);
                return;
            }
        }
    }

    pub(super) fn expire(&mut self, now: Instant) {
        while let Some(&(room, seq, at)) = self.order.front() {
            if now.duration_since(at) < self.ttl {
                break;
            }
            self.order.pop_front();
            if self.entries.get(&room).is_some_and(|e| e.1 == seq) {
                self.entries.remove(&room);
            }
        }
    }

    pub(super) fn get(&self, room: u64) -> Option<u32> {
        self.entries.get(&room).map(|e| e.0)
    }

    pub(super) fn len(&self) -> usize {
        self.entries.len()
    }
}
