//! [`Pool`]: buffers kept for reuse between transfers, unregistered. A fresh buffer's pages
//! are faulted in as they are first written, which cost more than the copy itself at these
//! sizes; a reused one's are already there.

use std::sync::Mutex;

use super::memory::Pinned;
use crate::inbox::lock;

/// See the module docs. Bounded in buffers and bytes.
#[derive(Debug)]
pub(crate) struct Pool {
    free: Mutex<Vec<Pinned>>,
    max_buffers: usize,
    max_bytes: usize,
}

impl Pool {
    pub(crate) fn new(max_buffers: usize, max_bytes: usize) -> Self {
        Pool { free: Mutex::default(), max_buffers, max_bytes }
    }

    /// A buffer of at least `len` bytes (at most twice that, so a small transfer does not pin
    /// a large buffer); zeroed if `zeroed`, else holding whatever its last use left.
    pub(crate) fn take(&self, len: usize, zeroed: bool) -> Pinned {
        let reused = {
            let mut free = lock(&self.free);
            let fit = free
                .iter()
                .enumerate()
                .filter(|(_, p)| p.len() >= len && p.len() / 2 <= len)
                .min_by_key(|(_, p)| p.len())
                .map(|(i, _)| i);
            fit.map(|i| free.swap_remove(i))
        };
        match reused {
            Some(mut p) => {
                if zeroed {
                    p.bytes_mut().fill(0);
                }
                p
            }
            None => Pinned::zeroed(len),
        }
    }

    /// Keeps `p` for reuse, unless that would pass the bounds (then the smallest goes).
    pub(crate) fn give(&self, p: Pinned) {
        let mut free = lock(&self.free);
        free.push(p);
        while free.len() > self.max_buffers
            || free.iter().map(Pinned::len).sum::<usize>() > self.max_bytes
        {
            let smallest = free.iter().enumerate().min_by_key(|(_, p)| p.len()).map(|(i, _)| i);
            let Some(i) = smallest else { break };
            free.swap_remove(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_a_fitting_buffer_zeroed_on_request_and_stays_bounded() {
        let pool = Pool::new(2, 1 << 20);
        let mut p = pool.take(1000, true);
        p.bytes_mut().fill(7);
        let addr = p.addr();
        pool.give(p);
        // Too small a request for it (it is more than twice the size): a fresh buffer.
        assert_ne!(pool.take(400, false).addr(), addr);
        let again = pool.take(900, true);
        assert_eq!(again.addr(), addr, "reused");
        assert!(again.len() >= 900);
        let mut again = again;
        assert!(again.bytes_mut().iter().all(|&b| b == 0), "zeroed on request");
        pool.give(again);
        let kept = pool.take(1000, false);
        let mut kept = kept;
        kept.bytes_mut()[0] = 9;
        pool.give(kept);
        assert_eq!(pool.take(1000, false).bytes_mut()[0], 9, "not zeroed unless asked");
        for _ in 0..5 {
            pool.give(Pinned::zeroed(300_000));
        }
        assert!(lock(&pool.free).len() <= 2);
        pool.give(Pinned::zeroed(2 << 20));
        assert!(lock(&pool.free).iter().map(Pinned::len).sum::<usize>() <= 1 << 20);
    }
}
