//! The JSON API's gate: without the cluster token nothing is read, whatever the body.

use std::sync::Arc;

use handoff_core::Tasks;
use handoff_scheduler::{SchedulerConfig, SchedulerState};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

async fn post(addr: &str, token: Option<&str>, body: &[u8]) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = token.map(|t| format!("authorization: Bearer {t}\r\n")).unwrap_or_default();
    let head = format!(
        "POST /v1/select HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\n{auth}content-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // The server may answer and close before taking the whole body.
    let _ = s.write_all(body).await;
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out).await;
    String::from_utf8_lossy(&out).get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[tokio::test]
async fn the_token_is_checked_before_the_body_is_read() {
    let cfg = SchedulerConfig { token: Some("secret".into()), ..SchedulerConfig::default() };
    let state = Arc::new(SchedulerState::new(cfg));
    let tasks = Tasks::new();
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let t = tasks.clone();
    tasks.spawn(async move {
        handoff_scheduler::http::serve(l, state, 16, async move { t.shutdown_requested().await })
            .await
    });
    let small = br#"{"token_ids": [1, 2, 3]}"#;
    let huge = vec![b' '; 5 << 20];
    assert_eq!(post(&addr, None, small).await, 401);
    assert_eq!(post(&addr, Some("guess"), small).await, 401);
    assert_eq!(post(&addr, None, &huge).await, 401, "refused before the body is read");
    assert_eq!(post(&addr, Some("secret"), small).await, 503, "in: no instance yet");
    assert_eq!(post(&addr, Some("secret"), &huge).await, 413, "a member's body is still bounded");
    tasks.shutdown().await;
}
