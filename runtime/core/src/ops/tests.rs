use super::*;

async fn get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ask = format!("GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    s.write_all(ask.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out[9..12].parse().unwrap();
    (code, out.split("\r\n\r\n").nth(1).unwrap_or("").to_owned())
}

#[tokio::test]
async fn serves_metrics_liveness_and_readiness_with_its_reason() {
    let reg = Registry::new();
    let hits = reg.counter("test_hits_total", "hits");
    let ready = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (h, r) = (hits.clone(), ready.clone());
    let ops = Ops::new(reg).on_scrape(move || h.inc()).ready_when(move || {
        if r.load(std::sync::atomic::Ordering::Relaxed) {
            Ok(())
        } else {
            Err("no scheduler reachable".into())
        }
    });
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(l, Arc::new(ops), async move {
        let _ = stopped.await;
    }));
    assert_eq!(get(addr, "/livez").await, (200, "ok".into()));
    let (code, why) = get(addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(why.contains("no scheduler reachable"), "{why}");
    ready.store(true, std::sync::atomic::Ordering::Relaxed);
    assert_eq!(get(addr, "/readyz").await.0, 200);
    let (code, body) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(body.contains("test_hits_total 1"), "{body}");
    assert!(get(addr, "/metrics").await.1.contains("test_hits_total 2"));
    let _ = stop.send(());
    server.await.unwrap().unwrap();
}
