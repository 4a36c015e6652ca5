//! An OpenAI-compatible router in front of several engine endpoints (vLLM, SGLang): for each
//! `POST /v1/completions` or `/v1/chat/completions` it asks a handoff scheduler's JSON API
//! (`handoff scheduler --engine ... --http-listen ...`) which engine holds most of the prompt,
//! forwards the request there unchanged, and reports how it went.
//!
//! A `prompt` given as token ids is routed by its cached prefix; any other request by load
//! alone (the router has no tokenizer).

use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
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
    http: Client<HttpConnector, Full<Bytes>>,
}

async fn call(r: &Routing, url: String, body: Bytes) -> Result<(StatusCode, Bytes), String> {
    let req = hyper::Request::post(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let resp = r.http.request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let body = resp.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    Ok((status, body))
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
    let selected = call(&r, format!("http://{}/v1/select", r.scheduler), ask.into()).await;
    let chosen: Value = match selected {
        Ok((StatusCode::OK, b)) => serde_json::from_slice(&b).unwrap_or_default(),
        Ok((status, b)) => return answer(status, b),
        Err(e) => return refuse(StatusCode::BAD_GATEWAY, format!("scheduler: {e}")),
    };
    let (Some(url), Some(booking)) = (chosen["url"].as_str(), chosen["booking_id"].as_u64()) else {
        return refuse(StatusCode::BAD_GATEWAY, "the scheduler's answer has no url");
    };
    let sent = call(&r, format!("http://{url}{}", uri.path()), body).await;
    let outcome = match &sent {
        Ok((s, _)) if s.is_success() => "success",
        Ok((StatusCode::TOO_MANY_REQUESTS, _)) => "overloaded",
        Ok((s, _)) if s.is_client_error() => "invalid",
        _ => "instance_fault",
    };
    let report = json!({ "booking_id": booking, "outcome": outcome }).to_string();
    let _ = call(&r, format!("http://{}/v1/report", r.scheduler), report.into()).await;
    match sent {
        Ok((status, b)) => answer(status, b),
        Err(e) => refuse(StatusCode::BAD_GATEWAY, format!("engine {url}: {e}")),
    }
}

/// Routes OpenAI requests on `listener` through the scheduler JSON API at `scheduler`
/// (`host:port`) until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    scheduler: String,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let http = Client::builder(TokioExecutor::new()).build_http();
    let routing = Arc::new(Routing { scheduler, http });
    let app = Router::new()
        .route("/v1/completions", post(forward))
        .route("/v1/chat/completions", post(forward))
        .with_state(routing);
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
