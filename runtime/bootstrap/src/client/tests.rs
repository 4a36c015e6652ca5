use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use super::*;

/// A directory that answers every request with 200 and `body` (at most `calls` of
/// them), then closes: a stand-in for a rogue or broken peer.
async fn answering(body: Vec<u8>, calls: usize) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        for _ in 0..calls {
            let Ok((mut conn, _)) = listener.accept().await else { return };
            let mut req = Vec::new();
            let mut buf = [0u8; 1024];
            while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                match conn.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => req.extend_from_slice(&buf[..n]),
                }
            }
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(&body).await;
        }
    });
    addr
}

fn info(tp: i64, cp: i64, dp: i64, pp: i64) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "attn_tp_size": tp, "attn_cp_size": cp, "dp_size": dp, "pp_size": pp,
        "page_size": 16, "kv_cache_dtype": "auto", "follow_bootstrap_room": true,
    }))
    .unwrap()
}

/// A topology no decode could read from (a rogue directory's 65,536 x 65,536 ranks would
/// have the decode list 2^32 of them) is refused as unusable, before anyone acts on it.
#[tokio::test]
async fn a_topology_past_the_bounds_is_unusable() {
    let client = DirectoryClient::default();
    for (tp, cp, dp, pp, why) in [
        (65_536, 1, 1, 65_536, "out of 1..=1024"),
        (64, 8, 1, 16, "8192 ranks in a dp group"),
        (1, 1, 2048, 1, "out of 1..=1024"),
    ] {
        let addr = answering(info(tp, cp, dp, pp), 1).await;
        match client.server_info(&addr).await {
            Err(e @ ClientError::Unusable { .. }) => assert!(e.to_string().contains(why), "{e}"),
            other => panic!("{tp}/{cp}/{dp}/{pp}: {other:?}"),
        }
    }
    let addr = answering(info(16, 4, 1024, 8), 1).await;
    assert_eq!(client.server_info(&addr).await.unwrap().attn_tp_size, 16);
}

/// An answer longer than any directory's is refused once it passes the bound, not read whole.
#[tokio::test]
async fn an_oversized_answer_is_refused() {
    let client = DirectoryClient::default();
    let addr = answering(vec![b' '; MAX_ANSWER_BYTES + 1], 1).await;
    assert!(matches!(
        client.server_info(&addr).await,
        Err(ClientError::Oversized { limit: MAX_ANSWER_BYTES, .. })
    ));
}

/// A directory that takes connections and never answers (what a peer whose packets the
/// network drops looks like, once connected) fails the call after the kept connection's
/// time and the fresh one's, not at the caller's deadline; one that sends its head and then
/// stalls its body, the same.
#[tokio::test]
async fn a_directory_that_never_answers_fails_the_call_in_time() {
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap().to_string();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            conns.push(conn);
        }
    });
    let (pooled, fresh) = (Duration::from_millis(100), Duration::from_millis(300));
    let client = DirectoryClient::default().with_timeouts(pooled, fresh);
    let since = std::time::Instant::now();
    match client.server_info(&addr).await {
        Err(e @ ClientError::TimedOut { .. }) => assert!(e.to_string().contains(&addr), "{e}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    assert!(since.elapsed() < Duration::from_secs(5), "{:?}", since.elapsed());

    let stalling = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = stalling.local_addr().unwrap().to_string();
    let stalled = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((mut conn, _)) = stalling.accept().await {
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf).await;
            let head =
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{";
            let _ = conn.write_all(head.as_bytes()).await;
            conns.push(conn);
        }
    });
    assert!(matches!(client.server_info(&addr).await, Err(ClientError::TimedOut { .. })));
    held.abort();
    stalled.abort();
}
