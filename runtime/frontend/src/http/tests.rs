//! The HTTP edge without a socket: bad requests get 400 with an OpenAI error body before
//! anything reaches a scheduler.

use axum::body::Body;
use axum::http::{Method, Request};
use handoff_core::Tasks;
use handoff_engine::{MockConfig, MockEngine};
use http_body_util::BodyExt;
use tower::ServiceExt;

use super::*;
use crate::FrontendConfig;

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

#[tokio::test]
async fn bad_requests_get_400_with_an_openai_error_body() {
    let tasks = Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    // No scheduler listens there: every case below must be refused before one is needed.
    let fe = Frontend::new(FrontendConfig::default(), engine, "127.0.0.1:9", &tasks).await.unwrap();
    let app = router(fe);
    let cases = [
        ("/v1/chat/completions", r#"{"model": "mock", "messages": []}"#, "messages"),
        ("/v1/chat/completions", r#"{"model": "mock"}"#, "messages"),
        (
            "/v1/chat/completions",
            r#"{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}"#,
            "gpt-9",
        ),
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
    ];
    for (uri, body, want) in cases {
        let (status, v) = call(&app, Method::POST, uri, body).await;
        assert_eq!(status, 400, "{body}: {v}");
        let msg = v["error"]["message"].as_str().unwrap_or_default();
        assert!(msg.contains(want), "{body}: {msg}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    let (status, v) = call(&app, Method::GET, "/v1/models", "").await;
    assert_eq!((status, v["data"][0]["id"].as_str()), (200, Some("mock")));
    tasks.shutdown().await;
}
