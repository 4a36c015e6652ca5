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
