//! The HTTP edge without a socket: bad requests get 400 (an unknown model 404) with an
//! OpenAI error body before anything reaches a scheduler.

use axum::body::Body;
use axum::http::{Method, Request};
use handoff_core::Tasks;
use handoff_engine::{MockConfig, MockEngine};
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::*;
use crate::{FrontendConfig, FrontendError};

async fn call(app: &Router, method: Method, uri: &str, body: &str) -> (u16, Value) {
    let req = Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", "application/json")
        .body(Body::from(body.to_owned()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// A frontend of the mock engine whose scheduler is nowhere (127.0.0.1:9): what a test
/// asks of it must be answered before one is needed.
async fn frontend() -> (Tasks, Arc<Frontend>) {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = Frontend::new(FrontendConfig::default(), engine, &["127.0.0.1:9".into()], &tasks)
        .await
        .unwrap();
    (tasks, fe)
}

#[tokio::test]
async fn bad_requests_get_400_with_an_openai_error_body() {
    let (tasks, fe) = frontend().await;
    let app = router(fe);
    let cases = [
        ("/v1/chat/completions", r#"{"model": "mock", "messages": []}"#, "messages"),
        ("/v1/chat/completions", r#"{"model": "mock"}"#, "messages"),
        (
            "/v1/chat/completions",
            r#"{"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100000}"#,
            "context",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "mock", "messages": [{"role": "wizard", "content": "hi"}]}"#,
            "role",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "mock", "messages": [{"role": "user", "content": "hi"}], "n": 3}"#,
            "n = 1",
        ),
        (
            "/v1/chat/completions",
            r#"{"model": "mock", "messages": [{"role": "user", "content": "hi"}"#,
            "invalid request body",
        ),
        ("/v1/completions", r#"{"model": "mock", "prompt": ""}"#, "empty"),
        (
            "/v1/completions",
            r#"{"model": "mock", "prompt": "hi", "temperature": 9}"#,
            "temperature",
        ),
        ("/v1/completions", r#"not json"#, "invalid request body"),
        ("/v1/completions", r#"{"model": "mock", "prompt": "hi", "top_p": 0}"#, "top_p"),
    ];
    for (uri, body, want) in cases {
        let (status, v) = call(&app, Method::POST, uri, body).await;
        assert_eq!(status, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "{body}: {msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // An unknown model is 404, as OpenAI answers it.
    let body = r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, v) = call(&app, Method::POST, "/v1/chat/completions", body).await;
    assert_eq!((status, v["error"]["code"].as_str()), (404, Some("model_not_found")), "{v}");
    let (status, v) = call(&app, Method::GET, "/v1/models", "").await;
    assert_eq!((status, v["data"][0]["id"].as_str()), (200, Some("mock")));
    // A body past the bound, and a method a route does not take: OpenAI's error body too.
    let huge = format!(r#"{{"model": "mock", "prompt": "{}"}}"#, "a".repeat(5 << 20));
    let (status, v) = call(&app, Method::POST, "/v1/completions", &huge).await;
    assert_eq!(status, 413, "{v}");
    assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    let (status, v) = call(&app, Method::GET, "/v1/chat/completions", "").await;
    assert_eq!(
        (status, v["error"]["message"].as_str()),
        (405, Some("method not allowed on this route"))
    );
    tasks.shutdown().await;
}

/// Parameters handoff does not serve are refused by name when asked for, and taken when
/// they ask for nothing (null, false, 0, empty, a text response format); `stream: null` is
/// absent, and a `stop` list past its bound is refused as it is read.
#[tokio::test]
async fn parameters_not_served_are_refused_by_name_when_asked_for() {
    let (tasks, fe) = frontend().await;
    let app = router(fe);
    let chat = |extra: &str| {
        format!(
            r#"{{"model": "mock", "messages": [{{"role": "user", "content": "hi"}}], {extra}}}"#
        )
    };
    for (extra, name) in [
        (r#""logprobs": true"#, "logprobs"),
        (r#""top_logprobs": 3"#, "top_logprobs"),
        (r#""tools": [{"type": "function", "function": {"name": "f"}}]"#, "tools"),
        (r#""response_format": {"type": "json_object"}"#, "response_format"),
        (r#""logit_bias": {"50256": -100}"#, "logit_bias"),
        (r#""presence_penalty": 0.5"#, "presence_penalty"),
        (r#""frequency_penalty": -1"#, "frequency_penalty"),
        (r#""best_of": 2"#, "best_of"),
        (r#""echo": true"#, "echo"),
        (r#""functions": [{"name": "f"}]"#, "functions"),
        (r#""stop": ["a", "b", "c", "d", "e", "f", "g", "h", "i"]"#, "at most 8 strings"),
    ] {
        let (status, v) = call(&app, Method::POST, "/v1/chat/completions", &chat(extra)).await;
        assert_eq!(status, 400, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(name), "{extra}: {msg}");
    }
    let (status, v) = call(
        &app,
        Method::POST,
        "/v1/completions",
        r#"{"model": "mock", "prompt": "hi", "suffix": "x"}"#,
    )
    .await;
    assert_eq!((status, v["error"]["param"].as_str()), (400, Some("suffix")), "{v}");
    let nothing = r#"{"logprobs": false, "top_logprobs": 0, "tools": [], "logit_bias": {},
        "presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1, "echo": null,
        "suffix": "", "response_format": {"type": "text"}, "functions": null}"#;
    let asked: unsupported::Unsupported = serde_json::from_str(nothing).unwrap();
    assert!(asked.refuse(false).is_ok(), "nothing asked for");
    // Tools not to be called ask for nothing; a completion's `logprobs: 0` asks for the
    // sampled token's, a chat's `logprobs: 0` (false) for nothing; a format without a type is
    // text.
    let tools =
        r#"{"tools": [{"type": "function"}], "tool_choice": "none", "response_format": {}}"#;
    let other: unsupported::Unsupported = serde_json::from_str(r#"{"tool_choice": true}"#).unwrap();
    assert!(other.refuse(false).is_ok(), "a tool choice of any shape is read past");
    let asked: unsupported::Unsupported = serde_json::from_str(tools).unwrap();
    assert!(asked.refuse(false).is_ok());
    let zero: unsupported::Unsupported = serde_json::from_str(r#"{"logprobs": 0}"#).unwrap();
    assert!(zero.refuse(false).is_ok());
    assert!(zero.refuse(true).is_err(), "a completion's logprobs: 0 asks for one");
    let s: openai::Sampling =
        serde_json::from_str(r#"{"stream": null, "stream_options": {"include_usage": null}}"#)
            .unwrap();
    assert_eq!(s.stream, None);
    let s: openai::Sampling = serde_json::from_str(r#"{"stop": ["a", "b"]}"#).unwrap();
    assert_eq!(s.stop.map(|s| s.0), Some(vec!["a".to_owned(), "b".to_owned()]));
    tasks.shutdown().await;
}

/// What OpenAI's clients send is read as OpenAI reads it: no temperature samples at 1 (not
/// greedy), a negative seed is a seed, an assistant's `content: null` is empty and the
/// `developer` role is the template's system.
#[test]
fn openai_defaults_and_shapes_are_read_as_openai_reads_them() {
    let none: openai::Sampling = serde_json::from_str("{}").unwrap();
    let p = sampling(&none).unwrap();
    assert_eq!((p.temperature, p.top_p, p.seed), (1.0, 1.0, None));
    let s: openai::Sampling = serde_json::from_str(r#"{"seed": -1, "temperature": 0}"#).unwrap();
    assert_eq!((s.seed, sampling(&s).unwrap().temperature), (Some(u64::MAX), 0.0));
    let s: openai::Sampling = serde_json::from_str(r#"{"seed": null}"#).unwrap();
    assert_eq!(s.seed, None);
    let chat: ChatRequest = serde_json::from_str(
        r#"{"model": "m", "messages": [{"role": "developer", "content": "be brief"},
            {"role": "assistant", "content": null}]}"#,
    )
    .unwrap();
    assert_eq!(role(&chat.messages[0].role), "system");
    assert_eq!(text_content(&chat.messages[1].content).unwrap(), "");
}

/// While the frontend drains, an HTTP/1.1 answer closes its connection (a client's pool
/// opens the next one elsewhere); before, it is kept alive.
#[tokio::test]
async fn a_draining_frontend_closes_each_http1_connection_after_its_answer() {
    let (tasks, fe) = frontend().await;
    let app = router(fe.clone());
    let models = || Request::get("/v1/models").body(Body::empty()).unwrap();
    let kept = app.clone().oneshot(models()).await.unwrap();
    assert_eq!(kept.headers().get(header::CONNECTION), None);
    fe.start_draining();
    let closed = app.clone().oneshot(models()).await.unwrap();
    assert_eq!(closed.status(), 200);
    assert_eq!(closed.headers().get(header::CONNECTION).unwrap(), "close");
    tasks.shutdown().await;
}

#[test]
fn each_failure_has_its_status_and_overload_says_when_to_retry() {
    use crate::Cause;
    use std::time::Duration;
    let status = |e: FrontendError| openai::ApiError::from(e).into_response();
    let r = status(FrontendError::Overloaded {
        retry_after: Duration::from_millis(1500),
        limit: crate::Limit::Requests,
        reason: "busy".into(),
    });
    assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(r.headers()[header::RETRY_AFTER], "2", "whole seconds, rounded up");
    let attempt = |cause| FrontendError::Attempt { stage: "prefill", reason: "x".into(), cause };
    let cases = [
        (FrontendError::Invalid("x".into()), StatusCode::BAD_REQUEST),
        (FrontendError::UnknownModel("x".into()), StatusCode::NOT_FOUND),
        (FrontendError::Unavailable("x".into()), StatusCode::SERVICE_UNAVAILABLE),
        (FrontendError::Deadline("x".into()), StatusCode::GATEWAY_TIMEOUT),
        (attempt(Cause::Overloaded), StatusCode::TOO_MANY_REQUESTS),
        (attempt(Cause::Deadline), StatusCode::GATEWAY_TIMEOUT),
        (attempt(Cause::Invalid), StatusCode::BAD_REQUEST),
        (attempt(Cause::Instance), StatusCode::SERVICE_UNAVAILABLE),
    ];
    for (e, want) in cases {
        let text = e.to_string();
        assert_eq!(status(e).status(), want, "{text}");
    }
    // gRPC says the same.
    let s = tonic::Status::from(FrontendError::Overloaded {
        retry_after: Duration::from_millis(1500),
        limit: crate::Limit::Requests,
        reason: "busy".into(),
    });
    assert_eq!(s.code(), tonic::Code::ResourceExhausted);
    assert_eq!(s.metadata().get(crate::RETRY_AFTER_MS).unwrap(), "1500");
}

/// Found in review: with an operations listener of its own, up from the start, a frontend
/// was ready before its public API served (its listeners bound, its registration waiting on
/// etcd): a balancer sent clients to a port nothing answered. Ready once the API serves.
#[tokio::test]
async fn a_frontend_is_not_ready_before_its_api_serves() {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let cfg = FrontendConfig { require_registered_prefill: false, ..FrontendConfig::default() };
    let fe = Frontend::new(cfg, engine, &["127.0.0.1:9".into()], &tasks).await.unwrap();
    let not_yet = Err("its API is not served yet".to_owned());
    assert_eq!(fe.ops().readiness(), not_yet);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let serving = serve(listener, fe.clone(), std::future::pending());
    let mut serving = std::pin::pin!(serving);
    assert!(futures::poll!(&mut serving).is_pending());
    assert_eq!(fe.ops().readiness(), Ok(()));
    tasks.shutdown().await;
}
