//! The OpenAI-compatible HTTP API: `POST /v1/chat/completions`, `POST /v1/completions`
//! (streamed as server-sent events or not), `GET /v1/models`, plus `GET /health` and the
//! operations endpoints (`/metrics`, `/livez`, `/readyz`). Requests become `GenerateRequest`s and take the same path as gRPC.

mod openai;
mod unsupported;

use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post};
use futures::StreamExt;
use handoff_core::body::BodyRefused;
use handoff_core::tls::ListenerTls;
use handoff_core::traffic::{Protocol, TrafficLayer};
use handoff_proto::metadata::TRACE_ID;
use handoff_proto::trace::{TRACEPARENT, TraceContext};
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{
    ChatMessage, ChatMessages, FinishReason, GenerateRequest, GenerateResponse, SamplingParams,
    TokenIds,
};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::Frontend;
use openai::{ApiError, CachedTokens, ChatRequest, CompletionRequest, Content, Prompt, Usage};

/// Largest request body.
const MAX_BODY: usize = 4 << 20;

/// The HTTP routes, for serving or for testing without a socket.
pub fn router(fe: Arc<Frontend>) -> Router {
    let ops = fe.cfg.ops_on_public.then(|| handoff_core::ops::router(fe.ops()));
    let api = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "OK" }))
        .route("/v1/debug/requests/{room}", get(request_trace))
        .route_layer(TrafficLayer(Protocol::Http))
        .fallback(|| async {
            ApiError { status: StatusCode::NOT_FOUND, ..ApiError::invalid("no such route", None) }
        })
        .method_not_allowed_fallback(|| async {
            let status = StatusCode::METHOD_NOT_ALLOWED;
            ApiError { status, ..ApiError::invalid("method not allowed on this route", None) }
        })
        .layer(DefaultBodyLimit::max(MAX_BODY))
        .layer(axum::middleware::from_fn_with_state(fe.clone(), close_when_draining))
        .with_state(fe);
    match ops {
        Some(ops) => api.merge(ops),
        None => api,
    }
}

/// While the frontend drains, an HTTP/1 answer closes its connection: a client keeping
/// connections alive (a pool behind a balancer) opens its next one elsewhere, rather than
/// bringing this frontend new requests until its drain ends and cuts them.
async fn close_when_draining(
    State(fe): State<Arc<Frontend>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    let h1 = req.version() < axum::http::Version::HTTP_2;
    let mut answer = next.run(req).await;
    if h1 && fe.is_draining() {
        let close = axum::http::HeaderValue::from_static("close");
        answer.headers_mut().insert(header::CONNECTION, close);
    }
    answer
}

/// Serves the HTTP API on `listener` until `shutdown` completes (HTTPS when the frontend's
/// config has a public certificate).
pub async fn serve(
    listener: TcpListener,
    fe: Arc<Frontend>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let tls = fe.cfg.public_tls.clone().map(ListenerTls::Public);
    let limits = fe.cfg.http;
    fe.mark_serving();
    handoff_core::http::serve_tcp(listener, tls, router(fe), shutdown, limits).await
}

/// The body, or why it could not be read as an OpenAI error: too large, 413; the listener's
/// receiving budget full, 429; not come whole in time, 408.
fn read(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|r| match handoff_core::body::refusal_in(&r) {
        Some(full @ BodyRefused::Full { .. }) => ApiError {
            status: StatusCode::TOO_MANY_REQUESTS,
            kind: "rate_limit_error",
            code: Some("overloaded"),
            retry_after: Some(1),
            ..ApiError::server(StatusCode::TOO_MANY_REQUESTS, full.to_string())
        },
        Some(slow @ BodyRefused::TooSlow(_)) => ApiError {
            status: StatusCode::REQUEST_TIMEOUT,
            ..ApiError::invalid(slow.to_string(), None)
        },
        None => ApiError { status: r.status(), ..ApiError::invalid(r.body_text(), None) },
    })
}

fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::invalid(format!("invalid request body: {e}"), None))
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// The temperature of a request that names none.
const DEFAULT_TEMPERATURE: f32 = 1.0;

fn sampling(s: &openai::Sampling) -> Result<SamplingParams, ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported", Some("n")));
    }
    let max_tokens = s.max_completion_tokens.or(s.max_tokens).unwrap_or(0);
    if s.max_completion_tokens.or(s.max_tokens) == Some(0) {
        return Err(ApiError::invalid("max_tokens must be at least 1", Some("max_tokens")));
    }
    // Inside, 0 means off; OpenAI's 0 keeps no token at all.
    if s.top_p == Some(0.0) {
        return Err(ApiError::invalid("top_p must be in (0, 1]", Some("top_p")));
    }
    Ok(SamplingParams {
        max_tokens,
        // OpenAI's default (and vLLM's and SGLang's): sampled, not greedy.
        temperature: s.temperature.unwrap_or(DEFAULT_TEMPERATURE),
        top_p: s.top_p.unwrap_or(1.0),
        top_k: s.top_k.unwrap_or(0),
        // No seed: a fresh one per request (see `input::plan`).
        seed: s.seed,
        stop: s.stop.clone().map(|s| s.0).unwrap_or_default(),
        ignore_eos: false,
    })
}

/// A message's role as the chat template knows it: OpenAI's `developer` (its newer name
/// for instructions) is the template's `system`.
fn role(r: &str) -> String {
    if r == "developer" { "system" } else { r }.to_owned()
}

fn text_content(c: &Content) -> Result<String, ApiError> {
    match c {
        Content::Text(s) => Ok(s.clone()),
        // Content parts: concatenate the text parts.
        Content::Parts(parts) => parts
            .iter()
            .map(|p| match (p.kind.as_str(), &p.text) {
                ("text", Some(t)) => Ok(t.clone()),
                _ => Err(ApiError::invalid(
                    "only text content parts are supported",
                    Some("messages"),
                )),
            })
            .collect(),
    }
}

/// The caller's trace context (a `traceparent` header), or a new trace.
fn trace_of(headers: &axum::http::HeaderMap) -> TraceContext {
    headers
        .get(TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .and_then(TraceContext::parse)
        .unwrap_or_default()
}

async fn chat(
    State(fe): State<Arc<Frontend>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let trace = trace_of(&headers);
    let trace_id = trace.trace_id();
    let run = async {
        let body = read(body)?;
        let req: ChatRequest = parse(&body)?;
        let sampled: openai::Sampling = parse(&body)?;
        parse::<unsupported::Unsupported>(&body)?.refuse(false)?;
        if req.messages.is_empty() {
            return Err(ApiError::invalid("messages must not be empty", Some("messages")));
        }
        let messages = req
            .messages
            .iter()
            .map(|m| Ok(ChatMessage { role: role(&m.role), content: text_content(&m.content)? }))
            .collect::<Result<Vec<_>, ApiError>>()?;
        let g = GenerateRequest {
            model: req.model.clone(),
            input: Some(Input::Chat(ChatMessages { messages })),
            sampling: Some(sampling(&sampled)?),
            ..Default::default()
        };
        // Not held while the request is served: its text is in `g` (twice, else).
        let model = req.model;
        drop((req.messages, body));
        respond(&fe, g, trace, &model, &sampled, true).await
    };
    with_trace_id(run.await.unwrap_or_else(IntoResponse::into_response), &trace_id)
}

async fn completions(
    State(fe): State<Arc<Frontend>>,
    headers: axum::http::HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let trace = trace_of(&headers);
    let trace_id = trace.trace_id();
    let run = async {
        let body = read(body)?;
        let req: CompletionRequest = parse(&body)?;
        let sampled: openai::Sampling = parse(&body)?;
        parse::<unsupported::Unsupported>(&body)?.refuse(true)?;
        let input = match req.prompt {
            Prompt::Text(t) => Input::Text(t),
            Prompt::Tokens(ids) => Input::TokenIds(TokenIds { ids }),
        };
        let g = GenerateRequest {
            model: req.model.clone(),
            input: Some(input),
            sampling: Some(sampling(&sampled)?),
            ..Default::default()
        };
        let model = req.model;
        drop(body);
        respond(&fe, g, trace, &model, &sampled, false).await
    };
    with_trace_id(run.await.unwrap_or_else(IntoResponse::into_response), &trace_id)
}

/// `r` with the request's trace id (see [`TRACE_ID`]).
fn with_trace_id(mut r: Response, id: &str) -> Response {
    if let Ok(v) = axum::http::HeaderValue::from_str(id) {
        r.headers_mut().insert(TRACE_ID, v);
    }
    r
}

fn finish_reason(r: i32) -> &'static str {
    match FinishReason::try_from(r) {
        Ok(FinishReason::Length) => "length",
        _ => "stop",
    }
}

fn usage(u: Option<handoff_proto::v1::Usage>) -> Usage {
    let u = u.unwrap_or_default();
    Usage {
        prompt_tokens: u.prompt_tokens,
        completion_tokens: u.completion_tokens,
        total_tokens: u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details: CachedTokens { cached_tokens: u.cached_tokens },
    }
}

async fn respond(
    fe: &Arc<Frontend>,
    g: GenerateRequest,
    trace: TraceContext,
    model: &str,
    s: &openai::Sampling,
    chat: bool,
) -> Result<Response, ApiError> {
    let rx = crate::service::start(fe, g, trace).await?;
    let id = format!("{}-{:016x}", if chat { "chatcmpl" } else { "cmpl" }, rand_id());
    if s.stream == Some(true) {
        let include_usage =
            s.stream_options.as_ref().is_some_and(|o| o.include_usage == Some(true));
        return Ok(sse(rx, id, model.to_owned(), chat, include_usage));
    }
    let (text, done) = collect(rx).await?;
    let object = if chat { "chat.completion" } else { "text_completion" };
    let choice = if chat {
        json!({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason(done.finish_reason), "logprobs": null})
    } else {
        json!({"index": 0, "text": text, "finish_reason": finish_reason(done.finish_reason), "logprobs": null})
    };
    let body = json!({"id": id, "object": object, "created": now(), "model": model, "choices": [choice], "usage": usage(done.usage)});
    Ok(Json(body).into_response())
}

fn rand_id() -> u64 {
    handoff_core::Room::mint().get()
}

async fn collect(
    mut rx: mpsc::Receiver<Result<GenerateResponse, tonic::Status>>,
) -> Result<(String, handoff_proto::v1::Complete), ApiError> {
    let mut text = String::new();
    while let Some(m) = rx.recv().await {
        match m.map_err(status_error)?.event {
            Some(Event::Chunk(c)) => text.push_str(&c.text),
            Some(Event::Complete(c)) => return Ok((text, c)),
            None => {}
        }
    }
    Err(ApiError::server(StatusCode::INTERNAL_SERVER_ERROR, "generation ended early"))
}

fn status_error(s: tonic::Status) -> ApiError {
    let status = match s.code() {
        tonic::Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        tonic::Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    ApiError::server(status, s.message())
}

/// Server-sent events: one `data:` line per chunk, an error event if generation fails after
/// the first token, and `data: [DONE]`.
fn sse(
    rx: mpsc::Receiver<Result<GenerateResponse, tonic::Status>>,
    id: String,
    model: String,
    chat: bool,
    include_usage: bool,
) -> Response {
    let created = now();
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    let frame = |v: Value| Bytes::from(format!("data: {v}\n\n"));
    let chunk = move |delta: Option<&str>, finish: Option<&str>, first: bool| {
        let choice = if chat {
            let mut d = json!({});
            if first {
                d["role"] = json!("assistant");
            }
            if let Some(t) = delta {
                d["content"] = json!(t);
            }
            json!({"index": 0, "delta": d, "finish_reason": finish, "logprobs": null})
        } else {
            json!({"index": 0, "text": delta.unwrap_or_default(), "finish_reason": finish, "logprobs": null})
        };
        json!({"id": id, "object": object, "created": created, "model": model, "choices": [choice]})
    };
    let mut first = true;
    let events = tokio_stream::wrappers::ReceiverStream::new(rx).flat_map(move |m| {
        let out = match m {
            Ok(GenerateResponse { event: Some(Event::Chunk(c)) }) if !c.text.is_empty() || first => {
                let f = frame(chunk(Some(&c.text), None, first));
                first = false;
                vec![f]
            }
            Ok(GenerateResponse { event: Some(Event::Complete(done)) }) => {
                let mut v = vec![frame(chunk(None, Some(finish_reason(done.finish_reason)), first))];
                if include_usage {
                    let mut u = chunk(None, None, false);
                    u["choices"] = json!([]);
                    u["usage"] = serde_json::to_value(usage(done.usage)).unwrap_or_default();
                    v.push(frame(u));
                }
                v.push(Bytes::from_static(b"data: [DONE]\n\n"));
                v
            }
            Ok(_) => vec![],
            Err(s) => {
                let e = status_error(s);
                let body = json!({"error": {"message": e.message, "type": e.kind, "param": null, "code": null}});
                vec![frame(body), Bytes::from_static(b"data: [DONE]\n\n")]
            }
        };
        futures::stream::iter(out.into_iter().map(Ok::<_, std::convert::Infallible>))
    });
    let body = Body::from_stream(events);
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A recent request's evidence, found by one of its rooms (the cluster token is required
/// when the frontend has one: the evidence names internal instances).
async fn request_trace(
    State(fe): State<Arc<Frontend>>,
    axum::extract::Path(room): axum::extract::Path<String>,
    headers: axum::http::HeaderMap,
) -> Result<Json<Value>, ApiError> {
    if let Some(token) = fe.cfg.transfer_token.as_deref() {
        let got = headers.get(header::AUTHORIZATION).map(|v| v.as_bytes()).unwrap_or_default();
        if !handoff_proto::auth::bearer_matches(got, token) {
            return Err(ApiError {
                kind: "authentication_error",
                ..ApiError::server(
                    StatusCode::UNAUTHORIZED,
                    "the cluster's bearer token is required",
                )
            });
        }
    }
    let room: u64 = room.parse().map_err(|_| {
        ApiError::invalid(format!("room {room:?} is not a decimal u64"), Some("room"))
    })?;
    match fe.trace(room) {
        Some(t) => Ok(Json(t.to_json())),
        None => Err(ApiError {
            kind: "not_found_error",
            ..ApiError::server(
                StatusCode::NOT_FOUND,
                format!(
                    "no recent request had room {room} (the last {} are kept)",
                    crate::traces::RECENT_REQUESTS
                ),
            )
        }),
    }
}

async fn models(State(fe): State<Arc<Frontend>>) -> Json<Value> {
    Json(
        json!({"object": "list", "data": [{"id": fe.engine.info().name, "object": "model", "created": 0, "owned_by": "handoff"}]}),
    )
}

#[cfg(test)]
mod tests;
