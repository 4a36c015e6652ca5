//! The operations endpoints every role serves: `GET /metrics` (Prometheus text), `GET /livez`
//! (the process answers) and `GET /readyz` (200 when the role can do its work, else 503 with
//! the reason). [`Ops`] is what a role hands in: its metrics, what to refresh before a scrape,
//! and how to judge readiness.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::Registry;
use crate::traffic::{Protocol, TrafficLayer};

/// Whether a role can do its work, and if not, why.
pub type Readiness = Result<(), String>;

type Check = Box<dyn Fn() -> Readiness + Send + Sync>;
type Refresh = Box<dyn Fn() + Send + Sync>;

/// A role's operations surface.
pub struct Ops {
    metrics: Arc<Registry>,
    refresh: Vec<Refresh>,
    ready: Vec<Check>,
    /// One scrape at a time: refreshing clears and refills gauge families.
    scraping: std::sync::Mutex<()>,
    /// Whether a scrape includes the process's served traffic (every role's listeners in
    /// the process): not when another role's endpoint in the process already does.
    with_traffic: bool,
}

impl std::fmt::Debug for Ops {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ops")
            .field("metrics", &self.metrics)
            .field("checks", &self.ready.len())
            .finish_non_exhaustive()
    }
}

impl Ops {
    /// Ops over `metrics`, ready until a check says otherwise.
    pub fn new(metrics: Arc<Registry>) -> Self {
        Ops {
            metrics,
            refresh: Vec::new(),
            ready: Vec::new(),
            scraping: Default::default(),
            with_traffic: true,
        }
    }

    /// Scrapes leave out the process's served traffic: another role's endpoint in this
    /// process serves it (a scraper of both would count it twice).
    pub fn without_traffic(mut self) -> Self {
        self.with_traffic = false;
        self
    }

    /// Runs `f` before each scrape (to set gauges from current state).
    pub fn on_scrape(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.refresh.push(Box::new(f));
        self
    }

    /// Adds a readiness check: every check must pass.
    pub fn ready_when(mut self, f: impl Fn() -> Readiness + Send + Sync + 'static) -> Self {
        self.ready.push(Box::new(f));
        self
    }

    /// The metrics, refreshed, in the text format (with the process's served traffic).
    pub fn scrape(&self) -> String {
        let _one = self.scraping.lock().unwrap_or_else(|e| e.into_inner());
        for f in &self.refresh {
            f();
        }
        let mut out = self.metrics.render();
        if self.with_traffic {
            out.push_str(&crate::traffic::traffic_registry().render());
            out.push_str(&crate::tls::expiry::expiry_registry().render());
        }
        out
    }

    /// Every check's verdict: the first failure's reason.
    pub fn readiness(&self) -> Readiness {
        self.ready.iter().try_for_each(|c| c())
    }

    /// The metrics registry.
    pub fn metrics(&self) -> &Arc<Registry> {
        &self.metrics
    }
}

/// The routes, to serve alone or merge into a role's own HTTP server.
pub fn router(ops: Arc<Ops>) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/livez", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route_layer(TrafficLayer(Protocol::Http))
        .with_state(ops)
}

async fn metrics(State(ops): State<Arc<Ops>>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], ops.scrape())
}

async fn readyz(State(ops): State<Arc<Ops>>) -> impl IntoResponse {
    match ops.readiness() {
        Ok(()) => (StatusCode::OK, "ready".to_owned()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}")),
    }
}

/// Serves the operations endpoints on `listener` until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    ops: Arc<Ops>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let limits = crate::http::HttpLimits::default();
    crate::http::serve_tcp(listener, None, router(ops), shutdown, limits).await
}

#[cfg(test)]
mod tests;
