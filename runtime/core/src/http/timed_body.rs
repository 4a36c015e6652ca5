//! A request body that must arrive whole within a time of its head: hyper times a request's
//! head (and the wait for it), nothing times its body, so a client declaring a large body and
//! trickling it held its connection for as long as it liked.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use bytes::Bytes;
use http_body::{Frame, SizeHint};

/// Wraps each request's body in a [`TimedBody`] of `within`.
pub(super) async fn timed(within: Duration, req: Request) -> Request {
    req.map(|body| Body::new(TimedBody::new(body, within)))
}

/// A body whose frames must all have come by its deadline; past it, reading fails.
struct TimedBody {
    inner: Body,
    deadline: Pin<Box<tokio::time::Sleep>>,
    within: Duration,
}

impl TimedBody {
    fn new(inner: Body, within: Duration) -> Self {
        TimedBody { inner, deadline: Box::pin(tokio::time::sleep(within)), within }
    }
}

/// The body did not arrive in time.
#[derive(Debug, thiserror::Error)]
#[error("the request body did not arrive within {0:?}")]
struct TooSlow(Duration);

impl http_body::Body for TimedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Poll::Ready(frame) = Pin::new(&mut self.inner).poll_frame(cx) {
            return Poll::Ready(frame);
        }
        match self.deadline.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Some(Err(axum::Error::new(TooSlow(self.within))))),
            Poll::Pending => Poll::Pending,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
