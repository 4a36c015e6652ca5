//! A decode that goes silent mid-transfer (its host dead or cut off: no reset reaches the
//! prefill, nor the cancellation of its call) does not hold the prefill's KV past the
//! request's deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use handoff::ClusterConfig;
use handoff_transfer::{Fault, FaultSwitch};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::support::*;

/// A TCP proxy that forwards until frozen, then passes nothing while holding both sides
/// open: a partition, as each end sees it.
struct Freezer {
    addr: String,
    frozen: Arc<AtomicBool>,
}

impl Freezer {
    async fn to(upstream: &str) -> Self {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let frozen = Arc::new(AtomicBool::new(false));
        let (up, f) = (upstream.to_owned(), frozen.clone());
        tokio::spawn(async move {
            while let Ok((down, _)) = l.accept().await {
                let up = TcpStream::connect(&up).await.unwrap();
                let ((dr, dw), (ur, uw)) = (down.into_split(), up.into_split());
                tokio::spawn(Self::pass(dr, uw, f.clone()));
                tokio::spawn(Self::pass(ur, dw, f.clone()));
            }
        });
        Freezer { addr, frozen }
    }

    async fn pass(
        mut from: tokio::net::tcp::OwnedReadHalf,
        mut to: tokio::net::tcp::OwnedWriteHalf,
        frozen: Arc<AtomicBool>,
    ) {
        let mut buf = vec![0u8; 64 << 10];
        while let Ok(n) = from.read(&mut buf).await {
            if n == 0 || frozen.load(Ordering::SeqCst) {
                break;
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        // Frozen (or closed): the far side is held open, told nothing.
        let _held = (from, to);
        std::future::pending::<()>().await;
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// The decode goes silent while the prefill sends (its writes never complete, and the call's
/// cancellation never arrives): the prefill gives the request up 2 s past its deadline,
/// counted as `send_deadline`. Before, it held the request and its KV until the connection died
/// (a minute or more), for each request that decode had in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_decode_does_not_hold_the_prefills_kv_past_the_deadline() {
    let switch = FaultSwitch::new();
    let cfg = ClusterConfig {
        prefills: 1,
        prefill_tp: 1,
        faults: vec![Some(switch.clone())],
        ..ClusterConfig::ephemeral()
    };
    let c = cluster(cfg).await;
    switch.arm(Fault::Stalled, usize::MAX);
    let proxy = Freezer::to(&c.prefills[0].grpc_addr).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
    let tokens = prompt(1, 64);
    let attempt = {
        let (c, proxy_addr, tokens) = (&c, proxy.addr.clone(), tokens.clone());
        async move {
            let kind = handoff_transfer::TransferKind::loopback();
            try_direct_attempt_via(c, &*engine(), 1, &tokens, kind, &proxy_addr, deadline).await
        }
    };
    let given_up = async {
        let since = Instant::now();
        while c.prefills[0].running() == 0 {
            assert!(since.elapsed() < Duration::from_secs(5), "the request reaches the prefill");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        proxy.freeze();
        loop {
            let scrape = c.prefills[0].ops().scrape();
            if scrape.contains("handoff_prefill_requests_total{result=\"send_deadline\"} 1\n") {
                break;
            }
            assert!(since.elapsed() < Duration::from_secs(20), "still held: {scrape}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // The attempt fails at its deadline (nothing arrives), then waits for its call's task,
    // which the frozen connection holds: not waited for once the prefill has given up.
    tokio::pin!(given_up);
    let gave_up = tokio::select! {
        got = attempt => {
            assert!(got.is_err(), "nothing can arrive");
            false
        }
        () = &mut given_up => true,
    };
    if !gave_up {
        given_up.await;
    }
    assert_eq!(c.prefills[0].running(), 0);
    // Not shut down: the frozen connection would hold the prefill's server for its grace
    // (10 s); the runtime's end drops it all.
}
