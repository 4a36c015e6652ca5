//! What one large request body costs the frontend while it is read: the peak of heap bytes,
//! counted by this test binary's own allocator (each test runs in a process of its own).

use std::alloc::System;

use axum::body::Body;
use axum::http::Request;
use cap::Cap;
use handoff_core::Tasks;
use handoff_engine::{MockConfig, MockEngine};
use handoff_frontend::{Frontend, FrontendConfig};
use tower::ServiceExt;

#[global_allocator]
static HEAP: Cap<System> = Cap::new(System, usize::MAX);

/// The heap's peak past what was live before, while a frontend answers `body` at `uri`
/// (its prompt is past the context: refused with 400 once read, before any scheduler is
/// needed, and none listens).
async fn peak_of(uri: &str, body: String) -> usize {
    let tasks = Tasks::new();
    let engine = std::sync::Arc::new(MockEngine::new(MockConfig::default()));
    let fe = Frontend::new(FrontendConfig::default(), engine, &["127.0.0.1:9".into()], &tasks)
        .await
        .unwrap();
    let app = handoff_frontend::http::router(fe);
    let size = body.len();
    assert!(size < 4 << 20, "{size}");
    let req = Request::post(uri).header("content-type", "application/json").body(Body::from(body));
    let before = HEAP.allocated();
    let status = app.oneshot(req.unwrap()).await.unwrap().status().as_u16();
    let peak = HEAP.max_allocated() - before;
    assert_eq!(status, 400, "{uri}: past the context");
    eprintln!("{uri}: a body of {size} bytes peaked at {peak} ({:.1}x)", peak as f64 / size as f64);
    tasks.shutdown().await;
    peak / size
}

/// Two million token ids in under 4 MiB cost a few times their size while read, not 20 or
/// more (serde's untagged enums held each id as 32 bytes of generic content first).
#[tokio::test(flavor = "current_thread")]
async fn a_body_of_token_ids_costs_a_few_times_its_size() {
    let ids = vec!["1"; 1_900_000].join(",");
    let body = format!(r#"{{"model": "mock", "prompt": [{ids}], "max_tokens": 4}}"#);
    assert!(peak_of("/v1/completions", body).await < 10);
}

/// 140,000 chat content parts likewise, not 25 times (each was a generic JSON map).
#[tokio::test(flavor = "current_thread")]
async fn a_body_of_content_parts_costs_a_few_times_its_size() {
    let parts = vec![r#"{"type":"text","text":"a "}"#; 140_000].join(",");
    let body = format!(
        r#"{{"model": "mock", "messages": [{{"role": "user", "content": [{parts}]}}], "max_tokens": 4}}"#
    );
    assert!(peak_of("/v1/chat/completions", body).await < 10);
}
