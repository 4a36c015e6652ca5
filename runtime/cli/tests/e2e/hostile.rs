//! A hostile peer on the cluster network that knows only the tcp transfer frame layout:
//! it sprays forged one-byte write frames at small region ids on the frontend's transfer
//! listener, reconnecting whenever it is cut off. No request fails while it runs, with a
//! cluster token and without one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use handoff::ClusterConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::support::*;

/// A write frame of one byte at offset 0 of `region` from sender 0.
fn forged(region: u64) -> Vec<u8> {
    let mut f = Vec::new();
    f.extend_from_slice(&(1u32 + 16 + 12 + 1).to_le_bytes());
    f.push(2);
    f.extend_from_slice(&region.to_le_bytes());
    f.extend_from_slice(&0u32.to_le_bytes());
    f.extend_from_slice(&1u32.to_le_bytes());
    f.extend_from_slice(&0u64.to_le_bytes());
    f.extend_from_slice(&1u32.to_le_bytes());
    f.push(0xff);
    f
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_write_frames_on_the_transfer_listener_fail_no_request() {
    for token in [Some("cluster-secret"), None] {
        let c = cluster(ClusterConfig {
            prefills: 2,
            token: token.map(String::from),
            ..ClusterConfig::ephemeral()
        })
        .await;
        let target = c.frontend.agent().addr();
        let (stop, connections) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicUsize::new(0)));
        let (st, conns) = (stop.clone(), connections.clone());
        let sprayer = tokio::spawn(async move {
            let spray: Vec<u8> = (0..256u64).flat_map(forged).collect();
            while !st.load(Ordering::Relaxed) {
                let Ok(mut s) = TcpStream::connect((target.ip.as_str(), target.port)).await else {
                    continue;
                };
                conns.fetch_add(1, Ordering::Relaxed);
                let _ = s.write_all(&spray).await;
                // Until the listener hangs up on it.
                let mut sink = [0u8; 4096];
                while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
            }
        });
        let mut cl = client(&c).await;
        for seed in 0..40 {
            let got = generate(&mut cl, &prompt(seed, 64), 4).await;
            assert!(got.is_ok(), "token {token:?}: request {seed} failed: {got:?}");
        }
        stop.store(true, Ordering::Relaxed);
        sprayer.await.unwrap();
        let n = connections.load(Ordering::Relaxed);
        assert!(n > 10, "the sprayer was cut off and came back: {n} connections");
        eprintln!("token {token:?}: 40 requests served while a forger opened {n} connections");
        c.tasks.shutdown().await;
    }
}

#[tokio::test]
async fn the_internal_services_want_the_cluster_token() {
    use handoff_proto::auth;
    use handoff_proto::v1::prefill_client::PrefillClient;
    use handoff_proto::v1::scheduler_client::SchedulerClient;
    use handoff_proto::v1::{ListInstancesRequest, PrefillRequest, TransferHandshake};
    let c = cluster(ClusterConfig {
        token: Some("cluster-secret".into()),
        ..ClusterConfig::ephemeral()
    })
    .await;
    let mut sched = SchedulerClient::connect(format!("http://{}", c.scheduler_addr)).await.unwrap();
    for token in [None, Some("guess")] {
        let e = sched.list_instances(auth::request(ListInstancesRequest {}, token)).await;
        assert_eq!(e.unwrap_err().code(), tonic::Code::Unauthenticated, "scheduler, {token:?}");
    }
    let ok = sched.list_instances(auth::request(ListInstancesRequest {}, Some("cluster-secret")));
    assert_eq!(ok.await.unwrap().into_inner().instances.len(), c.prefills.len());
    let addr = &c.prefills[0].grpc_addr;
    let mut prefill = PrefillClient::connect(format!("http://{addr}")).await.unwrap();
    let req = PrefillRequest { bootstrap_room: 7, token_ids: vec![1, 2, 3], ..Default::default() };
    let e = prefill.prefill(auth::request(req, None)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unauthenticated, "prefill: {e}");
    // Handshakes in the call that no sender could use are refused at once, and say why.
    let hs = |tp_rank, receiver_port| TransferHandshake {
        tp_rank,
        receiver_ip: "127.0.0.1".into(),
        receiver_port,
        region: 1,
        region_len: 4096,
        dst_tp_size: 1,
        ..Default::default()
    };
    let of = |tp_rank, dst_tp_size, dst_tp_rank| TransferHandshake {
        dst_tp_size,
        dst_tp_rank,
        ..hs(tp_rank, 9)
    };
    let (invalid, mismatch) = (tonic::Code::InvalidArgument, tonic::Code::FailedPrecondition);
    for (handshakes, code, why) in [
        (vec![hs(0, 9), hs(7, 9)], mismatch, "tp rank 7 pp rank 0, which this dp rank does not"),
        (vec![hs(0, 9)], invalid, "0 handshakes for tp rank 1 pp rank 0, decode tp 1 needs 1"),
        (vec![hs(0, 0), hs(1, 9)], invalid, "receiver port 0"),
        (vec![hs(0, 70_000), hs(1, 9)], invalid, "receiver port 70000"),
        (vec![hs(0, 9); 4097], invalid, "4097 handshakes, at most 4096"),
        (vec![of(0, 0, 0), of(1, 0, 0)], invalid, "decode tp 0 does not divide"),
        (
            vec![of(0, 4, 0), of(1, 4, 2)],
            invalid,
            "1 handshakes for tp rank 0 pp rank 0, decode tp 4 needs 2",
        ),
        (vec![of(0, 4, 0), of(0, 4, 2)], invalid, "decode rank 2 does not read from tp rank 0"),
        (vec![of(0, 4, 0), of(0, 4, 0)], invalid, "two handshakes of decode rank 0 for tp rank 0"),
        (vec![of(0, 2, 0), of(1, 2, 2)], invalid, "decode rank 2 of tp 2"),
        (
            vec![of(0, 1024, 0)],
            invalid,
            "decode tp 1024 needs 512 handshakes per rank, at most 256",
        ),
    ] {
        let req = PrefillRequest {
            bootstrap_room: 7,
            token_ids: vec![1, 2, 3],
            handshakes,
            ..Default::default()
        };
        let e = prefill.prefill(auth::request(req, Some("cluster-secret"))).await.unwrap_err();
        assert_eq!(e.code(), code, "{why}: {e}");
        assert!(e.message().contains(why), "{why}: {e}");
    }
    // The frontend carries it: requests are served.
    let mut cl = client(&c).await;
    assert!(generate(&mut cl, &prompt(1, 40), 4).await.is_ok());
    c.tasks.shutdown().await;
}

/// A room whose prefill rank finds more handshakes than the decode's tp needs, or two for one
/// decode rank (another receiver claims it, here over the transfer wire with the cluster
/// token), is refused, not sent to each.
#[tokio::test]
async fn a_room_claimed_by_more_receivers_than_its_decode_has_is_refused() {
    use handoff_core::Room;
    use handoff_proto::auth;
    use handoff_proto::v1::PrefillRequest;
    use handoff_proto::v1::prefill_client::PrefillClient;
    use handoff_transfer::{AgentAddr, ConnectRequest, RegionId};
    let token = "cluster-secret";
    let c =
        cluster(ClusterConfig { token: Some(token.into()), ..ClusterConfig::ephemeral() }).await;
    let rank = c.prefills[0].directory.rank(0, 0, 0, 0).unwrap();
    let peer = AgentAddr { ip: rank.rank_ip, port: rank.rank_port };
    let addr = &c.prefills[0].grpc_addr;
    let mut prefill = PrefillClient::connect(format!("http://{addr}")).await.unwrap();
    // The prefill is tp 2. Decode tp 1 needs one handshake a prefill rank: two; decode tp 4
    // needs two: two for the same decode rank.
    for (dst_tp_size, dst_ranks, said) in
        [(1, [0, 0], "2 handshakes for room"), (4, [1, 1], "(1 decode ranks), decode tp 4 needs 2")]
    {
        let room = Room::mint();
        for (region, dst_tp_rank) in [1, 2].into_iter().zip(dst_ranks) {
            let req = ConnectRequest {
                room,
                receiver: c.frontend.agent().addr(),
                region: RegionId(region),
                region_len: 4096,
                dst_tp_size,
                dst_tp_rank,
                tokens: 3,
                token: Some(token.into()),
            };
            c.frontend.agent().connect(&peer, req).await.unwrap();
        }
        let req = PrefillRequest {
            bootstrap_room: room.get(),
            token_ids: vec![1, 2, 3],
            ..Default::default()
        };
        let e = prefill.prefill(auth::request(req, Some(token))).await.unwrap_err();
        // Not the client's fault: the frontend tries again elsewhere, with a fresh room.
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        assert!(e.message().contains(said), "{said}: {e}");
    }
    c.tasks.shutdown().await;
}

/// A client that connects to the public gRPC listener and says nothing (not even HTTP/2's
/// preface, so it is never pinged) loses its connection at the listener's idle time; a
/// client that talks is served.
#[tokio::test]
async fn a_silent_connection_to_the_public_grpc_listener_is_closed() {
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.http.grpc_quiet = std::time::Duration::from_millis(500);
    let c = cluster(cfg).await;
    let mut silent = TcpStream::connect(c.frontend_addr).await.unwrap();
    let closed = async {
        let mut buf = [0u8; 256];
        // The server's own preface may come first; then the end.
        while let Ok(n) = silent.read(&mut buf).await {
            if n == 0 {
                break;
            }
        }
    };
    let within = std::time::Duration::from_secs(20);
    assert!(tokio::time::timeout(within, closed).await.is_ok(), "still open after {within:?}");
    let mut cl = client(&c).await;
    assert!(generate(&mut cl, &prompt(2, 40), 4).await.is_ok());
    c.tasks.shutdown().await;
}

/// One frame of a request body the test sends by hand.
type SentFrame = Result<hyper::body::Frame<bytes::Bytes>, std::io::Error>;
/// An HTTP/2 connection sending bodies by hand.
type Conn = hyper::client::conn::http2::SendRequest<
    http_body_util::StreamBody<futures::channel::mpsc::Receiver<SentFrame>>,
>;

/// A Generate request over its own HTTP/2 stream of `conn` whose message declares 1 MiB and
/// brings only `sent` bytes of it; the returned sender keeps the body open. Its answer's
/// `grpc-status`, when one comes.
async fn unfinished_generate(
    conn: &mut Conn,
    sent: usize,
) -> (futures::channel::mpsc::Sender<SentFrame>, tokio::task::JoinHandle<Option<String>>) {
    let (mut tx, rx) = futures::channel::mpsc::channel(4);
    let req = hyper::Request::post("http://frontend/handoff.v1.Generate/Generate")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(http_body_util::StreamBody::new(rx))
        .unwrap();
    let mut msg = vec![0u8];
    msg.extend_from_slice(&(1u32 << 20).to_be_bytes());
    msg.resize(5 + sent, 0x0a);
    use futures::SinkExt;
    tx.send(Ok(hyper::body::Frame::data(msg.into()))).await.unwrap();
    let answer = conn.send_request(req);
    let status = tokio::spawn(async move {
        let r = answer.await.ok()?;
        Some(r.headers().get("grpc-status")?.to_str().ok()?.to_owned())
    });
    (tx, status)
}

/// Unfinished Generate messages hold at most the listener's budget: past it, the next is
/// refused (`RESOURCE_EXHAUSTED`) while small requests are still served; one that does not
/// come whole within the body time is cut off (`DEADLINE_EXCEEDED`), giving its bytes back.
#[tokio::test]
async fn unfinished_grpc_messages_hold_at_most_the_budget() {
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.http.receiving_bytes = 256 << 10;
    // Long enough for the first to be held while the rest is sent, on a loaded machine.
    cfg.frontend.http.body_timeout = std::time::Duration::from_secs(10);
    let c = cluster(cfg).await;
    let io = hyper_util::rt::TokioIo::new(TcpStream::connect(c.frontend_addr).await.unwrap());
    let (mut conn, driver) =
        hyper::client::conn::http2::handshake(hyper_util::rt::TokioExecutor::new(), io)
            .await
            .unwrap();
    let _driving = tokio::spawn(driver);
    let (_held, first) = unfinished_generate(&mut conn, 200 << 10).await;
    let mut cl = client(&c).await;
    assert!(generate(&mut cl, &prompt(3, 40), 4).await.is_ok(), "a small request refused");
    let (_second_body, second) = unfinished_generate(&mut conn, 100 << 10).await;
    let within = std::time::Duration::from_secs(30);
    let second = tokio::time::timeout(within, second).await.expect("no answer").unwrap();
    assert_eq!(second.as_deref(), Some("8"), "past the budget: RESOURCE_EXHAUSTED");
    let first = tokio::time::timeout(within, first).await.expect("no answer").unwrap();
    assert_eq!(first.as_deref(), Some("4"), "past its time: DEADLINE_EXCEEDED");
    let (_third_body, third) = unfinished_generate(&mut conn, 200 << 10).await;
    let third = tokio::time::timeout(within, third).await.expect("no answer").unwrap();
    assert_eq!(third.as_deref(), Some("4"), "the first's bytes were given back");
    c.tasks.shutdown().await;
}

/// The HTTP API's request bodies share the same kind of budget: a body whose bytes would
/// pass it is refused with 429 and `Retry-After`, not buffered.
#[tokio::test]
async fn an_http_body_past_the_receiving_budget_is_refused() {
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.http.receiving_bytes = 64 << 10;
    let c = cluster(cfg).await;
    let mut s = TcpStream::connect(c.http_addr).await.unwrap();
    let len = 200 << 10;
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
         content-length: {len}\r\n\r\n"
    );
    s.write_all(head.as_bytes()).await.unwrap();
    // The server may answer, and stop reading, before all of it is sent.
    let _ = s.write_all(&vec![b' '; len]).await;
    let mut answer = Vec::new();
    let within = std::time::Duration::from_secs(20);
    let _ = tokio::time::timeout(within, s.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 429"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("retry-after: 1"), "{answer}");
    c.tasks.shutdown().await;
}
