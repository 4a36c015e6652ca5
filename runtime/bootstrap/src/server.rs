//! The directory's HTTP server. Status codes and text bodies follow SGLang's directory;
//! where SGLang answers 500 or hangs on bad input, this answers 400 with a reason.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::QueryRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use handoff_core::traffic::{Protocol, TrafficLayer};
use serde_json::Value;
use tokio::net::TcpListener;

use crate::{BootstrapError, Directory, Registration};

// === impl BootstrapError (the HTTP edge) ===

impl IntoResponse for BootstrapError {
    fn into_response(self) -> Response {
        let status = match self {
            BootstrapError::MissingInputs
            | BootstrapError::BadRequest(_)
            | BootstrapError::Inconsistent(_)
            | BootstrapError::Topology(_) => StatusCode::BAD_REQUEST,
            BootstrapError::NotReady(_) => StatusCode::SERVICE_UNAVAILABLE,
            BootstrapError::NotFound { .. } => StatusCode::NOT_FOUND,
            BootstrapError::Unauthorized => StatusCode::UNAUTHORIZED,
        };
        (status, self.to_string()).into_response()
    }
}

/// The directory's routes, for serving or for testing without a socket.
pub fn router(dir: Arc<Directory>) -> Router {
    let limit = dir.config().max_body_bytes;
    let query_limit = DefaultBodyLimit::max(dir.config().max_query_body_bytes);
    Router::new()
        .route("/health", get(|| async { "OK" }))
        .route("/route", get(get_route).put(put_route).fallback(method_not_allowed))
        .route("/register_dp_rank", post(register_dp_rank).fallback(method_not_allowed))
        .route(
            "/query_dp_ranks",
            post(query_dp_ranks).fallback(method_not_allowed).layer(query_limit),
        )
        .route_layer(TrafficLayer(Protocol::Http))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(dir)
}

/// Serves the directory on `listener` until `shutdown` completes (over the cluster's mutual
/// TLS when its config has it).
pub async fn run(
    listener: TcpListener,
    dir: Arc<Directory>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = dir.config().tls.clone().map(handoff_core::tls::ListenerTls::Cluster);
    handoff_core::http::serve_tcp(listener, tls, router(dir), shutdown, Default::default()).await
}

async fn method_not_allowed() -> Response {
    (StatusCode::METHOD_NOT_ALLOWED, "Method not allowed").into_response()
}

fn auth_header(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok())
}

async fn get_route(
    State(dir): State<Arc<Directory>>,
    query: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Response {
    let Ok(Query(q)) = query else {
        return BootstrapError::BadRequest("malformed query string".into()).into_response();
    };
    let names = ["prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank"];
    let mut vals = [0i64; 4];
    for (i, name) in names.iter().enumerate() {
        match q.get(*name).map(|s| s.trim()) {
            None | Some("") => return BootstrapError::MissingInputs.into_response(),
            Some(s) => match s.parse::<i64>() {
                Ok(v) => vals[i] = v,
                Err(_) => {
                    return BootstrapError::BadRequest(format!(
                        "{name} must be an integer, got {s:?}"
                    ))
                    .into_response();
                }
            },
        }
    }
    let [dp, cp, tp, pp] = vals;
    if vals == [-1; 4] {
        return match dir.server_info() {
            Ok(info) => Json(info).into_response(),
            Err(e) => e.into_response(),
        };
    }
    match dir.rank(dp, cp, tp, pp) {
        Ok(addr) => Json(addr).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn put_route(State(dir): State<Arc<Directory>>, headers: HeaderMap, body: Bytes) -> Response {
    if let Err(e) = dir.authorize(auth_header(&headers)) {
        return e.into_response();
    }
    let reg: Registration = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return BootstrapError::BadRequest(format!("invalid registration: {e}"))
                .into_response();
        }
    };
    match dir.register(reg) {
        Ok(()) => "OK".into_response(),
        Err(e) => e.into_response(),
    }
}

/// An integer field that SGLang also accepts as a decimal string.
fn int_field(body: &Value, name: &str) -> Result<i64, BootstrapError> {
    let v = body.get(name).ok_or_else(|| BootstrapError::BadRequest(format!("missing {name}")))?;
    let n = match v {
        Value::Number(n) => n.as_i64(),
        Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    n.ok_or_else(|| BootstrapError::BadRequest(format!("{name} must be an integer, got {v}")))
}

fn json_body(body: &[u8]) -> Result<Value, BootstrapError> {
    serde_json::from_slice(body)
        .map_err(|e| BootstrapError::BadRequest(format!("invalid JSON: {e}")))
}

async fn register_dp_rank(
    State(dir): State<Arc<Directory>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<&'static str, BootstrapError> {
    dir.authorize(auth_header(&headers))?;
    let v = json_body(&body)?;
    let room = int_field(&v, "bootstrap_room")?;
    let dp = int_field(&v, "dp_rank")?;
    if room < 1 {
        return Err(BootstrapError::BadRequest(format!(
            "bootstrap_room must be positive, got {room}"
        )));
    }
    let dp = u32::try_from(dp)
        .map_err(|_| BootstrapError::BadRequest(format!("dp_rank must be >= 0, got {dp}")))?;
    dir.register_dp_rank(room as u64, dp);
    Ok("OK")
}

async fn query_dp_ranks(
    State(dir): State<Arc<Directory>>,
    body: Bytes,
) -> Result<Json<Value>, BootstrapError> {
    let v = json_body(&body)?;
    let Some(list) = v.get("bootstrap_rooms").and_then(Value::as_array) else {
        return Err(BootstrapError::BadRequest("bootstrap_rooms must be a list".into()));
    };
    // The first rooms only: the rest are asked for again, as unregistered ones are.
    let list = &list[..list.len().min(dir.config().max_query_rooms)];
    let mut rooms = Vec::with_capacity(list.len());
    for r in list {
        let n = match r {
            Value::Number(n) => n.as_u64(),
            Value::String(s) => s.trim().parse().ok(),
            _ => None,
        };
        rooms.push(n.ok_or_else(|| {
            BootstrapError::BadRequest(format!("bootstrap_rooms must hold integers, got {r}"))
        })?);
    }
    Ok(Json(serde_json::to_value(dir.query_dp_ranks(&rooms)).unwrap_or_default()))
}

#[cfg(test)]
mod tests;
