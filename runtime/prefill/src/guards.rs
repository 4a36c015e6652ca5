//! Guards a prefill request holds while it is served: each undoes its count when dropped,
//! however the request ends (answered, failed, or cancelled midway by its caller).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use handoff_core::BlockHash;

use crate::service::Inner;

/// Counts a request as running (and its tokens as queued) until dropped, even when the
/// request is cancelled midway.
pub(crate) struct Running<'a> {
    inner: &'a Inner,
    tokens: u64,
}

impl<'a> Running<'a> {
    pub(crate) fn new(inner: &'a Inner, tokens: u64) -> Self {
        inner.running.fetch_add(1, Ordering::Relaxed);
        inner.queued_tokens.fetch_add(tokens, Ordering::Relaxed);
        Running { inner, tokens }
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.inner.queued_tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        // Release: whoever sees the count fall (`idle`) sees the request's store begun.
        self.inner.running.fetch_sub(1, Ordering::Release);
    }
}

/// Counts a request dropped before it was answered (its caller went away) as cancelled.
pub(crate) struct Unanswered<'a>(pub(crate) Option<&'a crate::metrics::PrefillMetrics>);

impl Drop for Unanswered<'_> {
    fn drop(&mut self) {
        if let Some(m) = self.0 {
            m.cancelled();
        }
    }
}

/// Holds a place in a dp rank's queue until dropped.
pub(crate) struct Queued<'a>(pub(crate) &'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Closes a request's room on each of its dp rank's senders when dropped, however the
/// request ended: handshakes that came for it and were not taken (it was refused, timed out,
/// failed or was cancelled first), or that come later, are dropped rather than kept until
/// the table is full.
pub(crate) struct RoomClosing<'a> {
    pub(crate) ranks: &'a [crate::rank::Rank],
    pub(crate) room: handoff_core::Room,
}

impl Drop for RoomClosing<'_> {
    fn drop(&mut self) {
        for r in self.ranks {
            r.agent.inbox().close_room(self.room);
        }
    }
}

/// The work ahead on one dp rank, as its heartbeats say it: the uncached tokens of the
/// requests waiting for or in compute there, a prefix pending in an earlier one counted once,
/// as the schedulers book it (so the figure is not above what they would have booked for the
/// same requests). Neither is exact: a prompt is stored once its KV is sent, so the request
/// that gets the slot right after the one computing a shared prefix computes it again (one
/// prefix per burst short); those after it find it stored.
#[derive(Debug, Default)]
pub(crate) struct WorkAhead {
    tokens: AtomicU64,
    /// Page hashes of the requests counted, with how many of them hold each.
    pending: Mutex<HashMap<BlockHash, u32>>,
}

impl WorkAhead {
    /// The uncached tokens counted now.
    pub(crate) fn tokens(&self) -> u64 {
        self.tokens.load(Ordering::Relaxed)
    }

    /// Counts a prompt of `prompt_len` tokens whose full pages hash to `hashes` (pages of
    /// `page_size`), the leading ones `cached` or pending in a request counted before not
    /// counted, until the returned guard drops.
    pub(crate) fn enter(
        &self,
        hashes: &[BlockHash],
        prompt_len: usize,
        page_size: usize,
        cached: impl Fn(&BlockHash) -> bool,
    ) -> Ahead<'_> {
        // At least one token is computed, as the cache's lookup leaves it.
        let pages = &hashes[..hashes.len().min(prompt_len.saturating_sub(1) / page_size.max(1))];
        let mut pending = self.pending.lock().unwrap_or_else(|e| e.into_inner());
        let covered = pages.iter().take_while(|h| cached(h) || pending.contains_key(h)).count();
        for h in pages {
            *pending.entry(*h).or_default() += 1;
        }
        let tokens = prompt_len.saturating_sub(covered * page_size) as u64;
        self.tokens.fetch_add(tokens, Ordering::Relaxed);
        Ahead { work: self, tokens, pages: pages.to_vec() }
    }
}

/// A request counted in its dp rank's [`WorkAhead`] until dropped: when its compute ends, or
/// it does not start.
pub(crate) struct Ahead<'a> {
    work: &'a WorkAhead,
    tokens: u64,
    pages: Vec<BlockHash>,
}

impl Drop for Ahead<'_> {
    fn drop(&mut self) {
        self.work.tokens.fetch_sub(self.tokens, Ordering::Relaxed);
        let mut pending = self.work.pending.lock().unwrap_or_else(|e| e.into_inner());
        for h in &self.pages {
            if let Some(n) = pending.get_mut(h) {
                *n -= 1;
                if *n == 0 {
                    pending.remove(h);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A prefix pending in a request counted before is counted once: the later one is priced
    /// as the schedulers book it (cached by the time it computes).
    #[test]
    fn a_prefix_pending_in_an_earlier_request_is_counted_once() {
        let work = WorkAhead::default();
        let hashes: Vec<BlockHash> = (1..=6).map(BlockHash).collect();
        let first = work.enter(&hashes, 100, 16, |_| false);
        assert_eq!(work.tokens(), 100);
        // The same prompt: its 6 pages (96 tokens) pending, 4 tokens its own.
        let second = work.enter(&hashes, 100, 16, |_| false);
        assert_eq!(work.tokens(), 104);
        // Cached pages are not counted either; the last token is always computed.
        let third = work.enter(&hashes[..2], 32, 16, |h| *h == BlockHash(1));
        assert_eq!(work.tokens(), 104 + 16);
        drop((first, third));
        assert_eq!(work.tokens(), 4);
        drop(second);
        assert_eq!(work.tokens(), 0);
        assert!(work.pending.lock().unwrap().is_empty(), "every page let go");
    }
}
