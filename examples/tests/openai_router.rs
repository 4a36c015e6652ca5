//! The OpenAI router example in front of two stand-in engines (HTTP servers that answer
//! with their own name) and a scheduler's JSON API whose index says engine b holds the
//! prompt: requests for that prompt go to b, and come back unchanged.

use std::sync::Arc;

use axum::Router;
use axum::routing::post;
use handoff_core::{Tasks, block_hashes};
use handoff_discovery::{Instance, Role, Topology};
use handoff_kv_events::IndexOp;
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A stand-in engine: a streamed request (`"stream": true`) gets `data: NAME` at once and
/// `data: [DONE]` once `go` is notified; any other its name as JSON.
async fn engine(name: &'static str, tasks: &Tasks, go: Arc<tokio::sync::Notify>) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = Router::new().route(
        "/v1/completions",
        post(move |body: String| async move {
            let v: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if v["stream"] != true {
                return axum::body::Body::from(format!("{{\"engine\": \"{name}\"}}"));
            }
            let first = futures::stream::once(async move {
                Ok::<_, std::convert::Infallible>(format!("data: {name}\n\n"))
            });
            let rest = futures::stream::once(async move {
                go.notified().await;
                Ok("data: [DONE]\n\n".to_owned())
            });
            axum::body::Body::from_stream(futures::StreamExt::chain(first, rest))
        }),
    );
    let t = tasks.clone();
    tasks.spawn(async move {
        axum::serve(l, app)
            .with_graceful_shutdown(async move { t.shutdown_requested().await })
            .await
    });
    addr
}

async fn post_json(addr: &str, body: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned()).unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_go_to_the_engine_holding_their_prompt() {
    let tasks = Tasks::new();
    let cfg = SchedulerConfig { token: Some("s3cret".into()), ..SchedulerConfig::default() };
    let state = Arc::new(SchedulerState::new(cfg));
    let go = Arc::new(tokio::sync::Notify::new());
    let (a, b) = (engine("a", &tasks, go.clone()).await, engine("b", &tasks, go.clone()).await);
    for (id, url) in [("a", a), ("b", b)] {
        state.add_engine(Instance {
            id: id.parse().unwrap(),
            role: Role::Prefill,
            model: "m".into(),
            bootstrap_addr: String::new(),
            grpc_addr: url,
            topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
            page_size: 16,
            version: 1,
            engine: None,
        });
    }
    let prompt: Vec<u32> = (500..628).collect();
    let held = block_hashes(&prompt, 16);
    state.apply_engine_ops(
        &"b".parse().unwrap(),
        0,
        &mut 0,
        vec![IndexOp::Store { parent: None, blocks: held }],
    );

    let api = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_addr = api.local_addr().unwrap().to_string();
    let (s, t) = (state.clone(), tasks.clone());
    tasks.spawn(async move {
        handoff_scheduler::http::serve(api, s, 16, async move { t.shutdown_requested().await })
            .await
    });
    let router = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let router_addr = router.local_addr().unwrap().to_string();
    let t = tasks.clone();
    tasks.spawn(async move {
        let stop = async move { t.shutdown_requested().await };
        handoff_examples::router::serve(router, api_addr, Some("s3cret".into()), stop).await
    });

    let body = serde_json::json!({"model": "m", "prompt": prompt, "max_tokens": 4}).to_string();
    for _ in 0..5 {
        let (status, got) = post_json(&router_addr, &body).await;
        assert_eq!((status, got.as_str()), (200, "{\"engine\": \"b\"}"));
    }
    // Without token ids (a chat request), by load: still served.
    let chat = r#"{"model": "m", "messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, got) = post_json(&router_addr, chat).await;
    assert!(status == 200 && got.contains("engine"), "{status} {got}");
    let (status, got) = post_json(&router_addr, "{not json").await;
    assert!(status == 400 && got.contains("body"), "{status} {got}");

    // Streamed: the first event reaches the client before the engine has sent the rest.
    let streamed = serde_json::json!({"model": "m", "prompt": prompt, "stream": true}).to_string();
    let mut s = tokio::net::TcpStream::connect(&router_addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{streamed}",
        streamed.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    while !String::from_utf8_lossy(&seen).contains("data: b") {
        let n = tokio::time::timeout(std::time::Duration::from_secs(5), s.read(&mut buf))
            .await
            .expect("the first event streams through before the engine finishes")
            .unwrap();
        assert!(n > 0, "{}", String::from_utf8_lossy(&seen));
        seen.extend_from_slice(&buf[..n]);
    }
    go.notify_waiters();
    s.read_to_end(&mut seen).await.unwrap();
    assert!(String::from_utf8_lossy(&seen).contains("data: [DONE]"));
    // Every booking was reported, the streamed one when its stream ended.
    let start = std::time::Instant::now();
    while state.open_bookings() > 0 {
        assert!(start.elapsed() < std::time::Duration::from_secs(5), "bookings reported");
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    tasks.shutdown().await;
}
