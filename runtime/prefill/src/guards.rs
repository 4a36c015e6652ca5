//! Guards a prefill request holds while it is served: each undoes its count when dropped,
//! however the request ends (answered, failed, or cancelled midway by its caller).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

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

/// Counts a request's uncached tokens as work ahead of the next ones on its dp rank (what
/// heartbeats say of its queue) until dropped: when its compute ends, or it does not start.
pub(crate) struct Ahead<'a> {
    work: &'a AtomicU64,
    tokens: u64,
}

impl<'a> Ahead<'a> {
    pub(crate) fn new(work: &'a AtomicU64, tokens: u64) -> Self {
        work.fetch_add(tokens, Ordering::Relaxed);
        Ahead { work, tokens }
    }
}

impl Drop for Ahead<'_> {
    fn drop(&mut self) {
        self.work.fetch_sub(self.tokens, Ordering::Relaxed);
    }
}
