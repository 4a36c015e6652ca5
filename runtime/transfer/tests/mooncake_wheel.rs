//! The mooncake backend against the real Mooncake Transfer Engine wheel
//! (`mooncake-transfer-engine-non-cuda` 0.3.13.post1, CPU, TCP), both ways. The wheel runs
//! in the venv `scripts/fetch-peers` makes; `scripts/test` exports its python as
//! `HANDOFF_PEERS_PYTHON`. Without it these tests fail, never skip.

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use handoff_core::{Room, Tasks};
use handoff_transfer::mooncake::{MooncakeConfig, MooncakeTransfer, peer_conn};
use handoff_transfer::{AgentAddr, Inbox, InboxConfig, SenderId, TransferError, WriteRequest};
use sha2::{Digest, Sha256};
use tokio::net::TcpListener;

fn python() -> String {
    std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
        panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
    })
}

fn helper(script: &str, args: &[String], env: &[(&str, &str)]) -> Child {
    let path = format!("{}/tests/peers/{script}", env!("CARGO_MANIFEST_DIR"));
    Command::new(python())
        .arg(path)
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("the peers' python runs")
}

fn line(out: &mut BufReader<ChildStdout>) -> String {
    let mut l = String::new();
    out.read_line(&mut l).unwrap();
    assert!(!l.is_empty(), "the helper exited early");
    l
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// The initiator helper's source bytes.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + 7) % 251) as u8).collect()
}

async fn agent(tasks: &Tasks) -> MooncakeTransfer {
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let rpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    MooncakeTransfer::serve(rpc, data, None, inbox, MooncakeConfig::default(), tasks).unwrap()
}

const ONE: usize = 1 << 20;
const BLOCK: usize = 8 << 10;
const BLOCKS: usize = 8;

/// The wheel writes into our target: single, batch, refused, and after the refusal.
async fn wheel_writes_into_our_target(env: &[(&str, &str)]) {
    let tasks = Tasks::new();
    let inbox = Arc::new(Inbox::new(InboxConfig::default()));
    let rpc = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mc =
        MooncakeTransfer::serve(rpc, data, None, inbox.clone(), MooncakeConfig::default(), &tasks)
            .unwrap();
    let len = ONE + BLOCK * BLOCKS + 4096;
    let (room, sender) = (Room::mint(), SenderId::new(0, 0));
    let id = inbox
        .register_region(room, len as u64, [(sender, std::iter::once(0..len as u64).collect())])
        .unwrap();
    let base = mc.expose(id, &["127.0.0.1".parse().unwrap()]).unwrap();

    let args = [mc.session().to_owned(), base.to_string(), len.to_string()];
    let mut child = helper("mooncake_initiator.py", &args, env);
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let report = tokio::task::spawn_blocking(move || line(&mut out)).await.unwrap();
    assert!(child.wait().unwrap().success(), "helper: {report}");
    let report: serde_json::Value = serde_json::from_str(&report).unwrap();
    let rc = &report["rc"];
    assert_eq!(rc["probe"], 0, "{report}");
    assert_eq!(rc["write"], 0, "{report}");
    assert_eq!(rc["batch"], 0, "{report}");
    assert_ne!(rc["out_of_range"], 0, "a write across the region's end is refused: {report}");
    assert_eq!(rc["after_refusal"], 0, "{report}");

    // What the wheel wrote, as segments: the notice a handoff sender would have sent.
    let src = pattern(len);
    assert_eq!(report["sha256"], sha(&src), "the helper sent the pattern");
    let tail = ONE + BLOCK * BLOCKS;
    let mut pairs = vec![(Bytes::copy_from_slice(&src[..ONE]), 0u64)];
    for k in 0..BLOCKS {
        let o = ONE + k * BLOCK;
        pairs.push((Bytes::copy_from_slice(&src[o..o + BLOCK]), o as u64));
    }
    pairs.push((Bytes::copy_from_slice(&src[tail..]), tail as u64));
    let notice = WriteRequest::new(id, pairs, room, sender, 1, 1, 0).notice.unwrap();
    inbox.on_notice(id, peer_conn("127.0.0.1".parse().unwrap()), notice).unwrap();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    let got = inbox.wait(id, deadline).await.unwrap();
    assert_eq!(sha(&got.buf), sha(&src), "every byte where the wheel put it");
    tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wheel_writes_into_our_target() {
    wheel_writes_into_our_target(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wheel_writes_into_our_target_one_connection_per_request_and_one_lane() {
    wheel_writes_into_our_target(&[
        ("MC_TCP_ENABLE_CONNECTION_POOL", "0"),
        ("MC_TCP_LANES_PER_PEER", "1"),
    ])
    .await;
}

struct WheelTarget {
    child: Child,
    stdin: ChildStdin,
    out: BufReader<ChildStdout>,
    peer: AgentAddr,
    addr: u64,
    len: usize,
}

impl WheelTarget {
    fn start(len: usize) -> Self {
        let mut child = helper("mooncake_target.py", &[len.to_string()], &[]);
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let stdin = child.stdin.take().unwrap();
        let hello: serde_json::Value = serde_json::from_str(&line(&mut out)).unwrap();
        let session = hello["session"].as_str().unwrap();
        let (ip, port) = session.rsplit_once(':').unwrap();
        let peer = AgentAddr { ip: ip.to_owned(), port: port.parse().unwrap() };
        WheelTarget { child, stdin, out, peer, addr: hello["addr"].as_u64().unwrap(), len }
    }

    fn sha(&mut self) -> String {
        writeln!(self.stdin, "sha").unwrap();
        line(&mut self.out).trim().to_owned()
    }
}

impl Drop for WheelTarget {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn our_initiator_writes_into_the_wheels_target() {
    let tasks = Tasks::new();
    let mc = agent(&tasks).await;
    let mut wheel = tokio::task::spawn_blocking(|| WheelTarget::start(2 * ONE)).await.unwrap();
    let client = mc.initiator();
    client.probe(&wheel.peer).await.unwrap();
    let d = client.descriptor(&wheel.peer, true).await.unwrap();
    assert_eq!(d.tcp_proto_version, 2);
    assert!(d.buffers.iter().any(|b| b.addr == wheel.addr && b.length == wheel.len as u64));

    let src = pattern(wheel.len);
    let mut want = vec![0u8; wheel.len];
    // One write of 1 MiB, then a batch of blocks spread over the lanes.
    client
        .write(&wheel.peer, wheel.addr, &[(Bytes::copy_from_slice(&src[..ONE]), 0)])
        .await
        .unwrap();
    want[..ONE].copy_from_slice(&src[..ONE]);
    let dials = client.dials();
    assert_eq!(dials, 1);
    let batch: Vec<(Bytes, u64)> = (0..16)
        .map(|k| {
            let o = ONE + k * BLOCK;
            (Bytes::copy_from_slice(&src[o..o + BLOCK]), o as u64)
        })
        .collect();
    client.write(&wheel.peer, wheel.addr, &batch).await.unwrap();
    for (b, o) in &batch {
        want[*o as usize..*o as usize + b.len()].copy_from_slice(b);
    }
    assert!(client.dials() <= 4, "lanes reuse pooled connections: {} dials", client.dials());
    let sha_now = {
        let w = &mut wheel;
        tokio::task::block_in_place(|| w.sha())
    };
    assert_eq!(sha_now, sha(&want), "the wheel's buffer holds what we wrote");

    // A write past the buffer's end is refused; the next write goes through.
    let over = client
        .write(&wheel.peer, wheel.addr, &[(Bytes::from_static(&[1; 64]), (wheel.len - 32) as u64)])
        .await;
    assert!(matches!(over, Err(TransferError::Rejected(_) | TransferError::Io { .. })), "{over:?}");
    let last = wheel.len - 4096;
    client
        .write(&wheel.peer, wheel.addr, &[(Bytes::copy_from_slice(&src[last..]), last as u64)])
        .await
        .unwrap();
    want[last..].copy_from_slice(&src[last..]);
    // Connection reuse: sequential single writes share one connection.
    let before = client.dials();
    for k in 0..4 {
        let o = ONE + 16 * BLOCK + k * 64;
        client
            .write(&wheel.peer, wheel.addr, &[(Bytes::copy_from_slice(&src[o..o + 64]), o as u64)])
            .await
            .unwrap();
        want[o..o + 64].copy_from_slice(&src[o..o + 64]);
    }
    assert!(client.dials() <= before + 1, "reused: {} -> {}", before, client.dials());
    let sha_end = tokio::task::block_in_place(|| wheel.sha());
    assert_eq!(sha_end, sha(&want));
    tasks.shutdown().await;
}
