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

/// `head`, `item` `n` times joined by commas, `tail`: written into one string of its final
/// size, so that building it leaves no peak above what the request is measured against
/// (the heap's high-water mark cannot be reset).
fn body_of(head: &str, item: &str, n: usize, tail: &str) -> String {
    let mut body = String::with_capacity(head.len() + n * (item.len() + 1) + tail.len());
    body.push_str(head);
    for i in 0..n {
        if i > 0 {
            body.push(',');
        }
        body.push_str(item);
    }
    body.push_str(tail);
    body
}

/// The heap's peak past what was live before, while a frontend answers `body` at `uri` (it
/// is refused with 400 once read, before any scheduler is needed, and none listens), over
/// the body's size.
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
    // What the setup already reached above that: the request's peak must be past it to count.
    let floor = HEAP.max_allocated() - before;
    let status = app.oneshot(req.unwrap()).await.unwrap().status().as_u16();
    let peak = HEAP.max_allocated() - before;
    assert_eq!(status, 400, "{uri}: past the context");
    eprintln!(
        "{uri}: a body of {size} bytes peaked at {peak} ({:.1}x; the setup reached {floor})",
        peak as f64 / size as f64
    );
    // A peak the setup reached hides the request's below it: a bound that only tells the
    // request stayed under the body's size.
    assert!(floor < size, "the setup's peak hides the request's");
    tasks.shutdown().await;
    peak.max(floor) / size
}

/// Two million token ids in under 4 MiB cost a few times their size while read, not 20 or
/// more (serde's untagged enums held each id as 32 bytes of generic content first).
#[tokio::test(flavor = "current_thread")]
async fn a_body_of_token_ids_costs_a_few_times_its_size() {
    let body =
        body_of(r#"{"model": "mock", "prompt": ["#, "1", 1_900_000, r#"], "max_tokens": 4}"#);
    assert!(peak_of("/v1/completions", body).await < 6);
}

/// 140,000 chat content parts likewise, not 25 times (each was a generic JSON map).
#[tokio::test(flavor = "current_thread")]
async fn a_body_of_content_parts_costs_a_few_times_its_size() {
    let body = body_of(
        r#"{"model": "mock", "messages": [{"role": "user", "content": ["#,
        r#"{"type":"text","text":"a "}"#,
        140_000,
        r#"]}], "max_tokens": 4}"#,
    );
    assert!(peak_of("/v1/chat/completions", body).await < 6);
}

/// 900,000 stop strings cost no more than the body: the list is refused once it is past its
/// bound, as it is read (it was held whole, each string a generic value, 20 times its size).
#[tokio::test(flavor = "current_thread")]
async fn a_body_of_stop_strings_is_refused_as_it_is_read() {
    let body = body_of(r#"{"model": "mock", "prompt": "hi", "stop": ["#, r#""a""#, 900_000, "]}");
    assert!(peak_of("/v1/completions", body).await < 1);
}
