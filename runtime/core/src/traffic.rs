//! [`TrafficLayer`]: a tower layer that counts and times every gRPC call and HTTP request a
//! process serves, by protocol, route and status, into one per-process registry
//! ([`traffic_registry`]) that every role's `/metrics` renders.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::extract::MatchedPath;
use axum::http::{Request, Response};

use crate::metrics::{Counter, Family, Histogram, LATENCY_BUCKETS, Registry};

/// The process's traffic metrics.
#[derive(Debug)]
struct Traffic {
    requests: Arc<Family<Counter>>,
    seconds: Arc<Family<Histogram>>,
}

fn traffic() -> &'static (Arc<Registry>, Traffic) {
    static TRAFFIC: OnceLock<(Arc<Registry>, Traffic)> = OnceLock::new();
    TRAFFIC.get_or_init(|| {
        let r = Registry::new();
        let t = Traffic {
            requests: r.counters(
                "handoff_served_requests_total",
                "gRPC calls and HTTP requests served, by protocol, route and status (the gRPC \
                 code, or the HTTP status).",
                &["protocol", "route", "status"],
            ),
            seconds: r.histograms(
                "handoff_served_request_seconds",
                "Time to a served call's response headers (a stream's first message), by \
                 protocol and route.",
                &["protocol", "route"],
                LATENCY_BUCKETS,
            ),
        };
        (r, t)
    })
}

/// The registry of the process's served traffic (shared by every role in the process).
pub fn traffic_registry() -> &'static Arc<Registry> {
    &traffic().0
}

/// Which protocol a layer counts.
#[derive(Debug, Clone, Copy)]
pub enum Protocol {
    /// gRPC: the route is the method path, the status the `grpc-status` of a trailers-only
    /// answer (an error), else `0`.
    Grpc,
    /// HTTP: the route is the matched route pattern, the status the HTTP status (requests
    /// no route matched are not counted).
    Http,
}

/// Counts and times the requests of the service it wraps.
#[derive(Debug, Clone, Copy)]
pub struct TrafficLayer(pub Protocol);

impl<S> tower::Layer<S> for TrafficLayer {
    type Service = Counted<S>;

    fn layer(&self, inner: S) -> Counted<S> {
        Counted { inner, protocol: self.0 }
    }
}

/// A service whose requests are counted (see [`TrafficLayer`]).
#[derive(Debug, Clone)]
pub struct Counted<S> {
    inner: S,
    protocol: Protocol,
}

/// The gRPC methods handoff serves, by path.
const GRPC_METHODS: &[&str] = &[
    "/handoff.v1.Generate/Generate",
    "/handoff.v1.Scheduler/SelectPrefill",
    "/handoff.v1.Scheduler/ReportOutcome",
    "/handoff.v1.Scheduler/ReportOutcomes",
    "/handoff.v1.Scheduler/ListInstances",
    "/handoff.v1.Prefill/Prefill",
    "/handoff.v1.Prefill/Drain",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
];

/// A gRPC method path as a label: one of [`GRPC_METHODS`], anything else (a caller can send
/// any path) as `unknown`, so callers cannot grow the label set.
fn grpc_route(path: &str) -> String {
    GRPC_METHODS.iter().find(|m| **m == path).map_or("unknown", |m| m).to_owned()
}

type Boxed<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B, RB> tower::Service<Request<B>> for Counted<S>
where
    S: tower::Service<Request<B>, Response = Response<RB>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Boxed<S::Response, S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (protocol, route) = match self.protocol {
            Protocol::Grpc => ("grpc", grpc_route(req.uri().path())),
            Protocol::Http => (
                "http",
                req.extensions()
                    .get::<MatchedPath>()
                    .map_or_else(|| "unknown".to_owned(), |m| m.as_str().to_owned()),
            ),
        };
        let grpc = matches!(self.protocol, Protocol::Grpc);
        let started = Instant::now();
        let answer = self.inner.call(req);
        Box::pin(async move {
            let res = answer.await;
            let status = match &res {
                Ok(r) if grpc => r
                    .headers()
                    .get("grpc-status")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or("0")
                    .to_owned(),
                Ok(r) => r.status().as_u16().to_string(),
                Err(_) => "error".to_owned(),
            };
            let t = &traffic().1;
            t.requests.with(&[protocol, &route, &status]).inc();
            t.seconds.with(&[protocol, &route]).observe_duration(started.elapsed());
            res
        })
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_known_grpc_methods_become_labels() {
        use super::grpc_route;
        assert_eq!(
            grpc_route("/handoff.v1.Scheduler/SelectPrefill"),
            "/handoff.v1.Scheduler/SelectPrefill"
        );
        assert_eq!(grpc_route("/grpc.health.v1.Health/Check"), "/grpc.health.v1.Health/Check");
        assert_eq!(grpc_route("/evil.Service/x"), "unknown");
        assert_eq!(grpc_route("/handoff.v1.Scheduler/Invented"), "unknown");
        assert_eq!(grpc_route(&format!("/handoff.v1.{}", "a".repeat(100))), "unknown");
        assert_eq!(grpc_route("/handoff.v1.X/\"\n"), "unknown");
    }
}
