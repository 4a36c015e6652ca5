//! [`PagePool`]: the decode's page pool as SGLang sees it, virtual. Each K/V buffer has a
//! fixed base address (what the registration tells every prefill rank, once); a request gets
//! a contiguous run of pages and a metadata row, and those addresses are mapped onto its own
//! receive region for as long as it lives. No memory backs the pool itself.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::SglangError;

/// Pages per buffer in the virtual pool.
pub const POOL_PAGES: u64 = 1 << 20;
/// Metadata rows in the virtual pool.
pub const POOL_ROWS: u32 = 1 << 16;
/// How long the pages of a request that failed stay out of use: a prefill may still write
/// to them (SGLang's decode holds them as long, `..._DEFERRED_DECODE_KV_RELEASE`).
pub const QUARANTINE: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// A first-fit allocator of page runs and rows (see the module docs).
#[derive(Debug)]
pub struct PagePool {
    /// Free page runs: start -> length, disjoint, adjacent ones merged.
    free: Mutex<BTreeMap<u64, u64>>,
    rows: Mutex<Vec<u32>>,
    /// Leases of failed requests, and when they failed.
    quarantine: Mutex<VecDeque<(Instant, Lease)>>,
}

impl Default for PagePool {
    fn default() -> Self {
        PagePool {
            free: Mutex::new(BTreeMap::from([(0, POOL_PAGES)])),
            rows: Mutex::new((0..POOL_ROWS).rev().collect()),
            quarantine: Mutex::default(),
        }
    }
}

/// A request's place in the pool: its first page, page count and metadata row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// First page.
    pub page: u64,
    /// Pages.
    pub pages: u64,
    /// Metadata row.
    pub row: u32,
}

impl PagePool {
    /// `pages` contiguous pages and a row, at `now` (quarantined leases past
    /// [`QUARANTINE`] come back first).
    pub fn lease_at(&self, pages: u64, now: Instant) -> Result<Lease, SglangError> {
        loop {
            let due = {
                let mut q = lock(&self.quarantine);
                match q.front() {
                    Some(&(at, l)) if now.saturating_duration_since(at) >= QUARANTINE => {
                        q.pop_front();
                        Some(l)
                    }
                    _ => None,
                }
            };
            match due {
                Some(l) => self.give_back(l),
                None => break,
            }
        }
        self.lease(pages)
    }

    /// Keeps a failed request's lease out of use until [`QUARANTINE`] after `now`.
    pub fn quarantine_at(&self, l: Lease, now: Instant) {
        lock(&self.quarantine).push_back((now, l));
    }

    /// `pages` contiguous pages and a row.
    pub fn lease(&self, pages: u64) -> Result<Lease, SglangError> {
        let full = || SglangError::Full("the decode page pool is full".into());
        let row = lock(&self.rows).pop().ok_or_else(full)?;
        let mut free = lock(&self.free);
        let Some((&start, &len)) = free.iter().find(|(_, len)| **len >= pages) else {
            lock(&self.rows).push(row);
            return Err(full());
        };
        free.remove(&start);
        if len > pages {
            free.insert(start + pages, len - pages);
        }
        Ok(Lease { page: start, pages, row })
    }

    /// Gives a lease back.
    pub fn give_back(&self, l: Lease) {
        lock(&self.rows).push(l.row);
        let mut free = lock(&self.free);
        let (mut start, mut len) = (l.page, l.pages);
        if let Some((&s, &n)) = free.range(..start).next_back()
            && s + n == start
        {
            free.remove(&s);
            start = s;
            len += n;
        }
        if let Some(n) = free.remove(&(l.page + l.pages)) {
            len += n;
        }
        free.insert(start, len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_disjoint_and_come_back_merged() {
        let p = PagePool::default();
        let (a, b, c) = (p.lease(4).unwrap(), p.lease(2).unwrap(), p.lease(8).unwrap());
        assert_eq!((a.page, b.page, c.page), (0, 4, 6));
        assert_ne!(a.row, b.row);
        p.give_back(b);
        assert_eq!(p.lease(3).unwrap().page, 14, "a 2-page hole does not fit 3");
        p.give_back(a);
        assert_eq!(p.lease(6).unwrap().page, 0, "the holes merged");
        assert!(p.lease(POOL_PAGES).is_err());
    }

    #[test]
    fn a_failed_requests_pages_wait_out_the_quarantine() {
        let p = PagePool::default();
        let t0 = Instant::now();
        let a = p.lease_at(POOL_PAGES, t0).unwrap();
        p.quarantine_at(a, t0);
        assert!(p.lease_at(1, t0 + QUARANTINE / 2).is_err(), "still quarantined");
        assert_eq!(p.lease_at(1, t0 + QUARANTINE).unwrap().page, 0);
    }
}
