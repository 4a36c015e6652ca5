//! An OpenAI-compatible router in front of several engine endpoints (vLLM, SGLang): for each
//! `POST /v1/completions` or `/v1/chat/completions` it asks a handoff scheduler's JSON API
//! (`handoff scheduler --engine ... --http-listen ...`) which engine holds most of the prompt,
//! forwards the request there unchanged, and reports how it went.
//!
//! A `prompt` given as token ids is routed by its cached prefix; any other request by load
//! alone (the router has no tokenizer). The engine's answer streams through as it comes
//! (`"stream": true` server-sent events included); the outcome is reported when it ends (a
//! client that leaves mid-stream leaves its booking to expire). With the cluster token, the
//! router sends it to the scheduler as a bearer token.

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header::CONTENT_LENGTH;
use axum::http::{StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};
use tokio::net::TcpListener;

struct Routing {
    /// `host:port` of the scheduler's JSON API.
    scheduler: String,
    /// The cluster's token, sent to the scheduler.
    token: Option<String>,
    http: Client<HttpConnector, Full<Bytes>>,
}

type Answer = hyper::Response<hyper::body::Incoming>;

async fn send(r: &Routing, url: String, body: Bytes, auth: bool) -> Result<Answer, String> {
    let mut req = hyper::Request::post(url).header("content-type", "application/json");
    if let (true, Some(t)) = (auth, &r.token) {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    let req = req.body(Full::new(body)).map_err(|e| e.to_string())?;
    r.http.request(req).await.map_err(|e| e.to_string())
}

/// A call to the scheduler's JSON API: its status and whole body.
async fn call(r: &Routing, path: &str, body: Bytes) -> Result<(StatusCode, Bytes), String> {
    let resp = send(r, format!("http://{}{path}", r.scheduler), body, true).await?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, body))
}

async fn report(r: &Routing, booking: u64, outcome: &str) {
    let report = json!({ "booking_id": booking, "outcome": outcome }).to_string();
    let _ = call(r, "/v1/report", report.into()).await;
}

/// The engine's answer, streamed to the client as it comes; the outcome is reported when it
/// ends.
fn stream_through(r: Arc<Routing>, booking: u64, answer: Answer) -> Response {
    use futures::StreamExt;
    let (parts, body) = answer.into_parts();
    let broke = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let b = broke.clone();
    let chunks = body.into_data_stream().inspect(move |c| {
        if c.is_err() {
            b.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    });
    let end = futures::stream::once(async move {
        let failed = broke.load(std::sync::atomic::Ordering::Relaxed);
        report(&r, booking, if failed { "instance_fault" } else { "success" }).await;
        None
    });
    let all = chunks.map(Some).chain(end).filter_map(|c| async move { c });
    Response::from_parts(parts, Body::from_stream(all))
}

fn answer(status: StatusCode, body: Bytes) -> Response {
    (status, [("content-type", "application/json")], Body::from(body)).into_response()
}

fn refuse(status: StatusCode, reason: impl std::fmt::Display) -> Response {
    answer(status, Bytes::from(json!({ "error": { "message": reason.to_string() } }).to_string()))
}

async fn forward(State(r): State<Arc<Routing>>, uri: Uri, body: Bytes) -> Response {
    let request: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return refuse(StatusCode::BAD_REQUEST, format!("body: {e}")),
    };
    let tokens: Vec<u64> = request["prompt"]
        .as_array()
        .map(|p| p.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default();
    let ask = if tokens.is_empty() {
        // No token ids: by load alone, its length guessed from the body (4 bytes a token).
        json!({ "block_hashes": [], "prompt_tokens": (body.len() / 4).max(1) })
    } else {
        json!({ "token_ids": tokens })
    }
    .to_string();
    let selected = call(&r, "/v1/select", ask.into()).await;
    let chosen: Value = match selected {
        Ok((StatusCode::OK, b)) => serde_json::from_slice(&b).unwrap_or_default(),
        Ok((status, b)) => return answer(status, b),
        Err(e) => return refuse(StatusCode::BAD_GATEWAY, format!("scheduler: {e}")),
    };
    let (Some(url), Some(booking)) = (chosen["url"].as_str(), chosen["booking_id"].as_u64()) else {
        return refuse(StatusCode::BAD_GATEWAY, "the scheduler's answer has no url");
    };
    match send(&r, format!("http://{url}{}", uri.path()), body, false).await {
        // An answer of unknown length (a stream): through as it comes. (One with a length is
        // read whole first: the server stops reading a body at its last byte, and would never
        // reach a report chained after it.)
        Ok(a) if a.status().is_success() && !a.headers().contains_key(CONTENT_LENGTH) => {
            stream_through(r.clone(), booking, a)
        }
        Ok(a) => {
            let outcome = match a.status() {
                s if s.is_success() => "success",
                StatusCode::TOO_MANY_REQUESTS => "overloaded",
                s if s.is_client_error() => "invalid",
                _ => "instance_fault",
            };
            report(&r, booking, outcome).await;
            let status = a.status();
            match a.into_body().collect().await {
                Ok(b) => answer(status, b.to_bytes()),
                Err(e) => refuse(StatusCode::BAD_GATEWAY, format!("engine {url}: {e}")),
            }
        }
        Err(e) => {
            report(&r, booking, "instance_fault").await;
            refuse(StatusCode::BAD_GATEWAY, format!("engine {url}: {e}"))
        }
    }
}

/// Routes OpenAI requests on `listener` through the scheduler JSON API at `scheduler`
/// (`host:port`, sent `token` as a bearer token when given) until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    scheduler: String,
    token: Option<String>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let http = Client::builder(TokioExecutor::new()).build_http();
    let routing = Arc::new(Routing { scheduler, token, http });
    let app = Router::new()
        .route("/v1/completions", post(forward))
        .route("/v1/chat/completions", post(forward))
        .with_state(routing);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
