//! The scheduler over JSON, for routers that do not speak gRPC (`--http-listen`).
//!
//! - `POST /v1/select` `{"token_ids": [..]}` (hashed here, `page_size` tokens per page) or
//!   `{"block_hashes": [..], "prompt_tokens": n}`, optionally `"exclude": ["id", ..]` and
//!   `"deadline_ms"`: `{"instance_id", "dp_rank", "url", "cached_blocks", "booking_id",
//!   "expected_wait_ms", "expected_prefill_ms"}`; `url` is where the instance takes requests
//!   (an engine's `url=`).
//! - `POST /v1/report` `{"booking_id", "outcome": "success" | "instance_fault" |
//!   "overloaded" | "deadline" | "cancelled" | "invalid" | "decode_fault"}`:
//!   `{"closed": bool}`.
//!
//! Errors are JSON `{"error": reason}`: 400 for bad input, 429 with `Retry-After` when
//! overloaded, 503 with no instance; with a cluster token, 401 without it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::post;
use handoff_core::traffic::{Protocol, TrafficLayer};
use handoff_core::{BlockHash, InstanceId, block_hashes};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::net::TcpListener;

use crate::{Ask, BookingId, Outcome, SchedulerError, SchedulerState};

/// Largest request body.
const MAX_BODY: usize = 4 << 20;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SelectBody {
    #[serde(default)]
    token_ids: Option<Vec<u32>>,
    #[serde(default)]
    block_hashes: Option<Vec<u64>>,
    #[serde(default)]
    prompt_tokens: Option<u32>,
    #[serde(default)]
    exclude: Vec<String>,
    #[serde(default)]
    deadline_ms: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Selected {
    instance_id: String,
    dp_rank: u32,
    url: String,
    cached_blocks: u32,
    booking_id: u64,
    expected_wait_ms: u64,
    expected_prefill_ms: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct ReportBody {
    booking_id: u64,
    outcome: String,
}

struct Api {
    state: Arc<SchedulerState>,
    page_size: usize,
}

/// An error answer: its status, reason and, when overloaded, when to retry.
struct ApiError {
    status: StatusCode,
    reason: String,
    retry_after_secs: Option<u64>,
}

fn error(status: StatusCode, reason: impl std::fmt::Display) -> ApiError {
    ApiError { status, reason: reason.to_string(), retry_after_secs: None }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(json!({ "error": self.reason }))).into_response();
        if let Some(secs) = self.retry_after_secs {
            r.headers_mut().insert(header::RETRY_AFTER, secs.into());
        }
        r
    }
}

impl From<SchedulerError> for ApiError {
    fn from(e: SchedulerError) -> ApiError {
        match &e {
            SchedulerError::Invalid(_) => error(StatusCode::BAD_REQUEST, &e),
            SchedulerError::NoInstance(_) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
            SchedulerError::Overloaded { retry_after, .. } => ApiError {
                retry_after_secs: Some(retry_after.as_secs_f64().ceil().max(1.0) as u64),
                ..error(StatusCode::TOO_MANY_REQUESTS, &e)
            },
            SchedulerError::Discovery(_) => error(StatusCode::SERVICE_UNAVAILABLE, &e),
        }
    }
}

/// Checks the cluster token, when the scheduler has one.
fn authorized(api: &Api, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(token) = api.state.config().token.as_deref() else { return Ok(()) };
    let got = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()).unwrap_or_default();
    if handoff_proto::auth::bearer_matches(got, token) {
        Ok(())
    } else {
        Err(error(StatusCode::UNAUTHORIZED, "the cluster's bearer token is required"))
    }
}

/// Refuses requests without the cluster token before their bodies are read.
async fn gate(
    State(api): State<Arc<Api>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match authorized(&api, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| error(StatusCode::BAD_REQUEST, format!("body: {e}")))
}

async fn select(State(api): State<Arc<Api>>, body: axum::body::Bytes) -> Response {
    match select_inner(&api, &body) {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

fn select_inner(api: &Api, body: &[u8]) -> Result<Response, ApiError> {
    let b: SelectBody = parse(body)?;
    let (hashes, prompt_tokens): (Vec<BlockHash>, u32) = match (&b.token_ids, &b.block_hashes) {
        (Some(t), None) => (block_hashes(t, api.page_size), t.len().min(u32::MAX as usize) as u32),
        (None, Some(h)) => {
            let n = b
                .prompt_tokens
                .ok_or_else(|| error(StatusCode::BAD_REQUEST, "block_hashes need prompt_tokens"))?;
            (h.iter().copied().map(BlockHash).collect(), n)
        }
        _ => {
            return Err(error(StatusCode::BAD_REQUEST, "give token_ids or block_hashes, not both"));
        }
    };
    let exclude = b
        .exclude
        .iter()
        .map(|s| s.parse::<InstanceId>())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| error(StatusCode::BAD_REQUEST, format!("exclude: {e}")))?;
    let ask = Ask {
        hashes: &hashes,
        prompt_tokens,
        policy: None,
        exclude: &exclude,
        deadline: b.deadline_ms.filter(|&d| d > 0).map(Duration::from_millis),
        protocols: crate::Protocols::ANY,
        owner: None,
    };
    let sel = api.state.select(&ask)?;
    Ok(Json(Selected {
        instance_id: sel.instance.id.to_string(),
        dp_rank: sel.dp_rank,
        url: sel.instance.grpc_addr,
        cached_blocks: sel.cached_blocks,
        booking_id: sel.booking.0,
        expected_wait_ms: sel.expected_wait.as_millis().min(u128::from(u64::MAX)) as u64,
        expected_prefill_ms: sel
            .expected_prefill
            .as_micros()
            .div_ceil(1000)
            .min(u128::from(u64::MAX)) as u64,
    })
    .into_response())
}

async fn report(State(api): State<Arc<Api>>, body: axum::body::Bytes) -> Response {
    let run = || -> Result<Response, ApiError> {
        let b: ReportBody = parse(&body)?;
        let outcome = match b.outcome.as_str() {
            "success" => Outcome::Success,
            "instance_fault" => Outcome::InstanceFault,
            "overloaded" => Outcome::Overloaded,
            "deadline" => Outcome::Deadline,
            "cancelled" => Outcome::Cancelled,
            "invalid" => Outcome::Invalid,
            "decode_fault" => Outcome::DecodeFault,
            other => {
                return Err(error(StatusCode::BAD_REQUEST, format!("unknown outcome {other:?}")));
            }
        };
        let closed = api.state.report(BookingId(b.booking_id), outcome);
        Ok(Json(json!({ "closed": closed })).into_response())
    };
    match run() {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The JSON API's routes (`page_size`: tokens per page when hashing `token_ids`).
pub fn router(state: Arc<SchedulerState>, page_size: usize) -> Router {
    let api = Arc::new(Api { state, page_size: page_size.max(1) });
    Router::new()
        .route("/v1/select", post(select))
        .route("/v1/report", post(report))
        .route_layer(TrafficLayer(Protocol::Http))
        // The token first: nobody without it gets a body read.
        .layer(axum::middleware::from_fn_with_state(api.clone(), gate))
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .with_state(api)
}

/// Serves the JSON API on `listener` until `shutdown` completes (over the cluster's mutual
/// TLS when the scheduler's config has it).
pub async fn serve(
    listener: TcpListener,
    state: Arc<SchedulerState>,
    page_size: usize,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = state.config().tls.clone();
    let app = router(state, page_size);
    let tls = tls.map(handoff_core::tls::ListenerTls::Cluster);
    handoff_core::http::serve_tcp(listener, tls, app, shutdown, Default::default()).await
}
