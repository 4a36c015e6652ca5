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

async fn engine(name: &'static str, tasks: &Tasks) -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let app = Router::new().route(
        "/v1/completions",
        post(move || async move { format!("{{\"engine\": \"{name}\"}}") }),
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
    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    for (id, url) in [("a", engine("a", &tasks).await), ("b", engine("b", &tasks).await)] {
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
        handoff_examples::router::serve(
            router,
            api_addr,
            async move { t.shutdown_requested().await },
        )
        .await
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
    tasks.shutdown().await;
}
