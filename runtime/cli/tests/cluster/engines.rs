//! `handoff scheduler --engine ...`: an engine instance followed through its KV events (a
//! publisher speaking vLLM 0.33's frames, played by a Rust PUB socket) is chosen for the
//! prompts it holds, with their cached blocks, over the Scheduler gRPC API.

use std::time::Duration;

use bytes::Bytes;
use handoff_core::block_hashes;
use handoff_proto::v1::SelectPrefillRequest;
use handoff_proto::v1::scheduler_client::SchedulerClient;
use rmpv::Value;
use zeromq::{PubSocket, Socket, SocketSend, ZmqMessage};

use super::ports::{free_port, on_fresh_ports};
use super::processes::addr_after;
use super::servers::Handoff;

fn stored(hash: u64, parent: Option<u64>, tokens: &[u32], block: u32) -> Bytes {
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        (
            "block_hashes".into(),
            Value::Array(
                tokens
                    .chunks(block as usize)
                    .enumerate()
                    .map(|(i, _)| (hash + i as u64).into())
                    .collect(),
            ),
        ),
        ("parent_block_hash".into(), parent.map_or(Value::Nil, Value::from)),
        ("token_ids".into(), Value::Array(tokens.iter().map(|&t| t.into()).collect())),
        ("block_size".into(), block.into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let batch = Value::Array(vec![1.0.into(), Value::Array(vec![ev]), 0.into()]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out.into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduler_routes_to_an_engine_by_its_kv_events() {
    // Port 0: the socket's own bind picks the port, so no other process can take it between
    // a pick and the bind.
    let mut publisher = PubSocket::new();
    let port = match publisher.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("a tcp bind gave {other}"),
    };
    let spec = format!("id=vllm-a,events=tcp://127.0.0.1:{port},url=127.0.0.1:8000,model=m");
    let (_s, line) = Handoff::spawn(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--engine",
        &spec,
    ]);
    let addr = addr_after(&line, "grpc://");
    let http = addr_after(&line, "http://");
    let mut client = SchedulerClient::connect(format!("http://{addr}")).await.unwrap();

    // vLLM blocks of 32 tokens; our pages of 16: 4 engine blocks hold 8 of our pages.
    let prompt: Vec<u32> = (4000..4128).collect();
    let hashes: Vec<u64> = block_hashes(&prompt, 16).into_iter().map(|h| h.0).collect();
    let payload = stored(77, None, &prompt, 32);
    let ask = || SelectPrefillRequest {
        block_hashes: hashes.clone(),
        prompt_tokens: prompt.len() as u32,
        ..Default::default()
    };
    let mut chosen = None;
    for seq in 0..100u64 {
        // Published until the subscriber has joined (seq 0 first, then the same blocks again).
        let frames =
            vec![Bytes::from("kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
        publisher.send(ZmqMessage::try_from(frames).unwrap()).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
        let sel = client.select_prefill(ask()).await.unwrap().into_inner();
        if sel.cached_blocks == 8 {
            chosen = Some(sel);
            break;
        }
    }
    let sel = chosen.expect("the engine's blocks reached the index");
    assert_eq!((sel.instance_id.as_str(), sel.prefill_addr.as_str()), ("vllm-a", "127.0.0.1:8000"));

    // The same over JSON, for routers that don't speak gRPC: the scheduler hashes the tokens.
    let (status, got) = post(&http, "/v1/select", &serde_json::json!({"token_ids": prompt})).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(
        (got["instance_id"].as_str(), got["url"].as_str()),
        (Some("vllm-a"), Some("127.0.0.1:8000"))
    );
    assert_eq!(got["cached_blocks"], 8);
    let report = serde_json::json!({"booking_id": got["booking_id"], "outcome": "success"});
    let (status, closed) = post(&http, "/v1/report", &report).await;
    assert_eq!((status, closed["closed"].as_bool()), (200, Some(true)));
    for bad in [
        serde_json::json!({}),
        serde_json::json!({"token_ids": [1], "colour": 1}),
        serde_json::json!({"block_hashes": [1]}),
    ] {
        let (status, got) = post(&http, "/v1/select", &bad).await;
        assert!(status == 400 && got["error"].is_string(), "{bad}: {status} {got}");
    }
}

/// A JSON POST over HTTP/1.1: the status and the JSON body.
async fn post(addr: &str, path: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nhost: h\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).await.unwrap();
    s.write_all(body.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let status = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let json = out.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or_default();
    (status, serde_json::from_str(json).unwrap_or(serde_json::Value::Null))
}

/// An engine's own publisher (`peers/{sglang,vllm}_publisher.py` in the sglang crate),
/// driven line by line, on ports it picked: dp rank r publishes on `port + r`, its replay
/// socket on `replay + r`.
struct EnginePublisher {
    child: std::process::Child,
    stdin: std::process::ChildStdin,
    out: std::io::BufReader<std::process::ChildStdout>,
    port: u16,
    replay: u16,
}

impl EnginePublisher {
    /// Starts `script` with `dp` dp ranks on free ports. Another process can take a port
    /// between its pick and the script's bind (or hold `port + r`, never checked): the script
    /// then says `port_taken` and other ports are tried (`on_fresh_ports`).
    fn start(script: &str, dp: u16) -> Self {
        on_fresh_ports(script, |_| {
            // The two ranges of dp ports must not overlap.
            let (port, mut replay) = (free_port(), free_port());
            while replay.abs_diff(port) < dp {
                replay = free_port();
            }
            Self::try_start(script, port, replay, dp)
                .ok_or_else(|| format!("a port was taken: {port}+, {replay}+"))
        })
    }

    /// `script` on `port` and `replay`; `None` when it found a port taken.
    fn try_start(script: &str, port: u16, replay: u16, dp: u16) -> Option<Self> {
        use std::io::BufRead;
        let python = std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
            panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
        });
        let script = format!("{}/../sglang/tests/peers/{script}", env!("CARGO_MANIFEST_DIR"));
        // Its stderr goes with the test's output (nextest shows it when the test fails).
        let mut child = std::process::Command::new(python)
            .args([&script, &port.to_string(), &replay.to_string(), &dp.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::inherit())
            .spawn()
            .expect("the peers' python runs");
        let stdin = child.stdin.take().unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        if line.trim() == "ready" {
            return Some(EnginePublisher { child, stdin, out, port, replay });
        }
        let taken = serde_json::from_str::<serde_json::Value>(&line)
            .is_ok_and(|report| report["port_taken"] == true);
        if taken {
            let status = child.wait().expect("the publisher exits");
            assert_eq!(status.code(), Some(75), "{script} reported a taken port");
            return None;
        }
        // Anything else: it may be waiting on stdin, so it is stopped, not waited for.
        drop(stdin);
        let _ = child.kill();
        let status = child.wait().expect("the publisher exits");
        panic!("{script} did not start ({status}): {line:?}")
    }

    fn send(&mut self, cmd: serde_json::Value) {
        use std::io::{BufRead, Write};
        writeln!(self.stdin, "{cmd}").unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ok", "{cmd}");
    }
}

impl Drop for EnginePublisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port another process holds (here dp rank 1's, `port + 1`, which no pick checks) is
/// reported by the publisher, which exits rather than serve (the report names no port: any of
/// the four in use reads the same); `start` then comes up on ports of its own.
#[test]
fn a_publishers_taken_port_is_reported_and_not_served() {
    let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let taken = held.local_addr().unwrap().port();
    let mut replay = free_port();
    while replay.abs_diff(taken) < 3 {
        replay = free_port();
    }
    for script in ["sglang_publisher.py", "vllm_publisher.py"] {
        let started = EnginePublisher::try_start(script, taken - 1, replay, 2);
        assert!(started.is_none(), "{script} started with port {taken} held");
    }
    drop(held);
    let p = EnginePublisher::start("sglang_publisher.py", 2);
    assert!(p.replay.abs_diff(p.port) >= 2, "ports {} and {}", p.port, p.replay);
}

/// SGLang's page-size-1 stores: one event of `tokens.len()` blocks with signed hashes; the
/// hash of token `i`'s block.
fn sglang_store(dp: u32, first_hash: i64, tokens: &[u32]) -> serde_json::Value {
    let hashes: Vec<i64> = (0..tokens.len() as i64).map(|i| first_hash - i).collect();
    serde_json::json!({"dp": dp, "stored": {"hashes": hashes, "parent": null, "tokens": tokens, "block_size": 1}})
}

fn sglang_block_of(first_hash: i64, token: usize) -> serde_json::Value {
    serde_json::json!(first_hash - token as i64)
}

/// vLLM's stores: blocks of 16 with unsigned hashes.
fn vllm_store(dp: u32, first_hash: i64, tokens: &[u32]) -> serde_json::Value {
    let hashes: Vec<u64> =
        (0..tokens.len() as u64 / 16).map(|i| first_hash.unsigned_abs() * 1000 + i).collect();
    serde_json::json!({"dp": dp, "stored": {"hashes": hashes, "parent": null, "tokens": tokens, "block_size": 16}})
}

fn vllm_block_of(first_hash: i64, token: usize) -> serde_json::Value {
    serde_json::json!(first_hash.unsigned_abs() * 1000 + token as u64 / 16)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_own_publisher_drives_routing_with_replay_removal_and_clear() {
    drive("sglang_publisher.py", sglang_store, sglang_block_of).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllms_own_publisher_drives_routing_with_replay_removal_and_clear() {
    drive("vllm_publisher.py", vllm_store, vllm_block_of).await;
}

/// An engine's own publisher, two dp ranks: a store published before the scheduler listens
/// (recovered through the engine's replay socket), a live one, a removal and a clear.
async fn drive(
    script: &str,
    store: fn(u32, i64, &[u32]) -> serde_json::Value,
    block_of: fn(i64, usize) -> serde_json::Value,
) {
    let mut sgl = tokio::task::block_in_place(|| EnginePublisher::start(script, 2));
    let (port, replay) = (sgl.port, sgl.replay);
    let a: Vec<u32> = (100..164).collect();
    let b: Vec<u32> = (700..764).collect();
    // Published before the scheduler listens: recovered only through SGLang's replay socket.
    tokio::task::block_in_place(|| sgl.send(store(1, -10, &a)));

    let spec = format!(
        "id=sgl-a,events=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay},dp=2,url=127.0.0.1:30000"
    );
    let (_s, line) = Handoff::spawn(&[
        "scheduler",
        "--listen",
        "127.0.0.1:0",
        "--ops-listen",
        "127.0.0.1:0",
        "--engine",
        &spec,
    ]);
    let addr = addr_after(&line, "grpc://");
    let ops = addr_after(&line, "ops http://");
    let client = SchedulerClient::connect(format!("http://{addr}")).await.unwrap();
    let select = |tokens: Vec<u32>| {
        let mut client = client.clone();
        async move {
            let hashes = block_hashes(&tokens, 16).into_iter().map(|h| h.0).collect();
            let ask = SelectPrefillRequest {
                block_hashes: hashes,
                prompt_tokens: 64,
                ..Default::default()
            };
            client.select_prefill(ask).await.unwrap().into_inner()
        }
    };
    // B goes live on dp 1 until the subscriber has joined; its first message triggers the
    // replay that brings A. (Watched through ListInstances: a selection would count the
    // prompt as on its way to where it sent it.)
    let indexed = |client: &SchedulerClient<tonic::transport::Channel>| {
        let mut client = client.clone();
        async move {
            let all = client.list_instances(handoff_proto::v1::ListInstancesRequest {}).await;
            all.unwrap().into_inner().instances.iter().map(|i| i.cached_blocks).sum::<u64>()
        }
    };
    let mut seen = 0;
    for i in 0..60 {
        tokio::task::block_in_place(|| sgl.send(store(1, -1000 - 100 * i, &b)));
        seen = indexed(&client).await;
        if seen >= 8 {
            break;
        }
    }
    assert_eq!(seen, 8, "A (replayed) and B (live), 4 pages each");
    let (sa, sb) = (select(a.clone()).await, select(b.clone()).await);
    assert_eq!((sa.instance_id.as_str(), sa.dp_rank, sa.cached_blocks), ("sgl-a", 1, 4));
    assert_eq!((sb.dp_rank, sb.cached_blocks), (1, 4));
    // Removing the block holding A's 10th token removes our first page of A.
    let removed = serde_json::json!({"dp": 1, "removed": [block_of(-10, 9)]});
    tokio::task::block_in_place(|| sgl.send(removed));
    let mut left = seen;
    for _ in 0..40 {
        left = indexed(&client).await;
        if left < seen {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 7, "the page holding the removed block goes, nothing else");
    tokio::task::block_in_place(|| sgl.send(serde_json::json!({"dp": 1, "cleared": true})));
    for _ in 0..40 {
        left = indexed(&client).await;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(left, 0, "a clear reaches the index");
    // What an operator sees of the stream: batches applied and replayed, and the lag.
    let scrape = super::operations::http_get(&ops, "/metrics").await.1;
    let batches = |kind: &str| {
        let series = format!(
            "handoff_scheduler_engine_event_batches_total{{engine=\"sgl-a\",dp_rank=\"1\",kind=\"{kind}\"}} "
        );
        let line = scrape.lines().find(|l| l.starts_with(&series));
        line.and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok()).unwrap_or(0.0)
    };
    assert!(batches("applied") >= 4.0, "{scrape}");
    assert!(batches("replayed") >= 1.0, "A came through the replay socket: {scrape}");
    let lag = "handoff_scheduler_engine_event_lag_seconds{engine=\"sgl-a\",dp_rank=\"1\"} ";
    let lag: f64 = scrape.lines().find_map(|l| l.strip_prefix(lag)?.parse().ok()).unwrap();
    assert!((0.0..60.0).contains(&lag), "lag {lag}");
}

/// An engine registered in etcd (`handoff register-engine`, as a sidecar would run it) is
/// followed by a scheduler that was given no `--engine`, and leaves routing, its index
/// entries with it, when its registration goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_engine_registered_in_etcd_is_followed_until_its_registration_goes() {
    let etcd = super::servers::Server::etcd();
    let nats = super::servers::Server::nats();
    let mut vllm = tokio::task::block_in_place(|| EnginePublisher::start("vllm_publisher.py", 1));
    let (port, replay) = (vllm.port, vllm.replay);
    let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let (_s, line) = Handoff::spawn(&[&["scheduler", "--listen", "127.0.0.1:0"][..], &d].concat());
    let client =
        SchedulerClient::connect(format!("http://{}", addr_after(&line, "grpc://"))).await.unwrap();
    let spec = format!(
        "id=vllm-r,kind=vllm,events=tcp://127.0.0.1:{port},replay=tcp://127.0.0.1:{replay},url=127.0.0.1:30000"
    );
    let (mut registration, line) =
        Handoff::spawn(&[&["register-engine", "--engine", &spec][..], &d].concat());
    assert_eq!(line.trim(), "engine vllm-r registered");
    let listed = |client: &SchedulerClient<tonic::transport::Channel>| {
        let mut client = client.clone();
        async move {
            let all = client.list_instances(handoff_proto::v1::ListInstancesRequest {}).await;
            let all = all.unwrap().into_inner().instances;
            all.into_iter().find(|i| i.instance_id == "vllm-r").map(|i| i.cached_blocks)
        }
    };
    let a: Vec<u32> = (300..364).collect();
    let mut blocks = None;
    for i in 0..100 {
        if listed(&client).await.is_some() {
            tokio::task::block_in_place(|| vllm.send(vllm_store(0, -20 - i, &a)));
        }
        blocks = listed(&client).await;
        if blocks == Some(4) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(blocks, Some(4), "the registered engine is followed: A's 4 pages indexed");
    let hashes = block_hashes(&a, 16).into_iter().map(|h| h.0).collect();
    let ask =
        SelectPrefillRequest { block_hashes: hashes, prompt_tokens: 64, ..Default::default() };
    let sel = client.clone().select_prefill(ask).await.unwrap().into_inner();
    assert_eq!(
        (sel.instance_id.as_str(), sel.cached_blocks, sel.prefill_addr.as_str()),
        ("vllm-r", 4, "127.0.0.1:30000")
    );

    let pid = registration.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let _ = registration.child.wait();
    for _ in 0..100 {
        blocks = listed(&client).await;
        if blocks.is_none() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(blocks, None, "deregistered: out of the scheduler's instances");
}
