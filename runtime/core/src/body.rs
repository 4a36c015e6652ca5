//! Request bodies within bounds: each must arrive whole within a time of its head, and the
//! bodies a listener is receiving hold at most a budget of bytes between them.
//!
//! hyper times a request's head, nothing times its body: a client declaring a large body and
//! trickling it held its connection for as long as it liked. And each body is buffered
//! whole before anything looks at it (an HTTP handler's extractor, tonic's message decoder,
//! which reserves the length a message declares): a listener bounding only its connections
//! (16,384) and a body's size (4 MiB) let one client fill gigabytes with bodies it never
//! finished, until the process was killed for its memory.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// An error a body's reader may get from the body itself.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Bytes of request bodies being received at once, shared by one listener's connections.
#[derive(Debug)]
pub struct BodyBudget {
    limit: usize,
    held: AtomicUsize,
}

impl BodyBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> Arc<Self> {
        Arc::new(BodyBudget { limit, held: AtomicUsize::new(0) })
    }

    /// Bytes held now by the bodies being received.
    pub fn held(&self) -> usize {
        self.held.load(Ordering::Relaxed)
    }

    /// Takes `n` bytes if they fit.
    fn take(&self, n: usize) -> bool {
        self.held
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |h| {
                h.checked_add(n).filter(|&after| after <= self.limit)
            })
            .is_ok()
    }

    fn give_back(&self, n: usize) {
        self.held.fetch_sub(n, Ordering::AcqRel);
    }
}

/// Why a body was cut off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum BodyRefused {
    /// It did not arrive whole within its time.
    #[error("the request body did not arrive within {0:?}")]
    TooSlow(Duration),
    /// The bodies being received already held the budget.
    #[error("request bodies being received hold this listener's {limit} bytes: try again shortly")]
    Full {
        /// The budget, in bytes.
        limit: usize,
    },
}

/// What reading a [`BoundedBody`] failed with.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// A bound cut it off.
    #[error(transparent)]
    Refused(#[from] BodyRefused),
    /// The body's own error (the connection's).
    #[error(transparent)]
    Inner(BoxError),
}

/// `BodyRefused` behind an error's sources, if there is one.
pub fn refusal_in(e: &(dyn std::error::Error + 'static)) -> Option<BodyRefused> {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(r) = e.downcast_ref::<BodyRefused>() {
            return Some(*r);
        }
        if let Some(BodyError::Refused(r)) = e.downcast_ref::<BodyError>() {
            return Some(*r);
        }
        at = e.source();
    }
    None
}

/// A body whose frames must all come within its time, each charged to its listener's
/// [`BodyBudget`] until the body is dropped.
pub struct BoundedBody<B> {
    inner: B,
    deadline: Pin<Box<tokio::time::Sleep>>,
    within: Duration,
    budget: Arc<BodyBudget>,
    charged: usize,
}

impl<B> BoundedBody<B> {
    /// `inner`, which must come whole within `within` from now, within `budget`.
    pub fn new(inner: B, within: Duration, budget: Arc<BodyBudget>) -> Self {
        let deadline = Box::pin(tokio::time::sleep(within));
        BoundedBody { inner, deadline, within, budget, charged: 0 }
    }
}

impl<B> Drop for BoundedBody<B> {
    fn drop(&mut self) {
        self.budget.give_back(self.charged);
    }
}

impl<B> http_body::Body for BoundedBody<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let n = frame.data_ref().map_or(0, Bytes::len);
                if !this.budget.take(n) {
                    let full = BodyRefused::Full { limit: this.budget.limit };
                    return Poll::Ready(Some(Err(full.into())));
                }
                this.charged += n;
                Poll::Ready(Some(Ok(frame)))
            }
            Poll::Ready(Some(Err(e))) => Poll::Ready(Some(Err(BodyError::Inner(e.into())))),
            Poll::Ready(None) => Poll::Ready(None),
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(BodyRefused::TooSlow(this.within).into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests;
