//! A public gRPC server's request bodies within bounds ([`handoff_core::body`]): each must
//! come whole within its time, and those being received hold at most a budget of bytes
//! between them. tonic reserves the length a message declares and buffers it whole, on
//! each of a connection's streams, before the service sees the request; nothing timed a
//! body, so one client's unfinished messages (16 MiB each, thousands of streams) could fill
//! the process's memory.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use handoff_core::body::{BodyBudget, BodyError, BodyRefused, BoundedBody};
use http_body_util::BodyExt;
use tonic::Status;
use tonic::codegen::http::Request;

/// Bounds every request body of the service it wraps.
#[derive(Debug, Clone)]
pub struct BoundBodies {
    within: Duration,
    budget: Arc<BodyBudget>,
}

impl BoundBodies {
    /// Bodies that must come whole within `within` of their head, holding at most
    /// `max_bytes` between them while they come.
    pub fn new(within: Duration, max_bytes: usize) -> Self {
        BoundBodies { within, budget: BodyBudget::new(max_bytes) }
    }
}

impl<S> tower::Layer<S> for BoundBodies {
    type Service = Bounded<S>;

    fn layer(&self, inner: S) -> Bounded<S> {
        Bounded { inner, bounds: self.clone() }
    }
}

/// A service whose request bodies are bounded (see [`BoundBodies`]).
#[derive(Debug, Clone)]
pub struct Bounded<S> {
    inner: S,
    bounds: BoundBodies,
}

impl<S> tower::Service<Request<tonic::body::Body>> for Bounded<S>
where
    S: tower::Service<Request<tonic::body::Body>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<tonic::body::Body>) -> S::Future {
        let BoundBodies { within, budget } = self.bounds.clone();
        self.inner.call(req.map(|body| {
            tonic::body::Body::new(BoundedBody::new(body, within, budget).map_err(status_of))
        }))
    }
}

/// The status a cut-off body's call ends with.
fn status_of(e: BodyError) -> Status {
    match e {
        BodyError::Refused(full @ BodyRefused::Full { .. }) => {
            Status::resource_exhausted(full.to_string())
        }
        BodyError::Refused(slow @ BodyRefused::TooSlow(_)) => {
            Status::deadline_exceeded(slow.to_string())
        }
        BodyError::Inner(e) => Status::from_error(e),
    }
}
