//! A handoff frontend decoding for a vLLM prefill server: `handoff scheduler --engine
//! id=..,kind=vllm,url=..,side=..` routes a request to it, the frontend (`--drive-vllm`) POSTs
//! it to the server's `/v1/completions` with `kv_transfer_params`, READs the blocks over NIXL
//! as vLLM's decode does, notifying each rank so it frees them, and streams the tokens. The
//! server is `peers/vllm_server.py` in the vllm crate, a MOCK named as such: vLLM 0.33's own
//! NIXL connector code (side channel, metadata, notification-driven freeing) over real NIXL
//! agents, with the KV of each prompt computed beforehand by our engine (no torch here).
//! Needs NIXL's library and UCX's settings in the environment, as scripts/test sets them.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use handoff_engine::Engine;
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_smollm::SmolLm;
use serde_json::{Value, json};

use super::ports::{free_port, on_fresh_ports};
use super::servers::Handoff;
use super::sglang::{Prompt, aggregated, cluster_for, generate, model_and_dir, same_tokens};

/// The mock vLLM prefill server, killed on drop.
struct MockVllmServer {
    child: Child,
    http: u16,
    side: u16,
}

impl Drop for MockVllmServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MockVllmServer {
    /// Serves `prompts` from a cache of `tp` ranks laid out `layout`.
    fn start(
        m: &SmolLm,
        dir: &std::path::Path,
        tp: usize,
        layout: &str,
        prompts: &[Value],
    ) -> Self {
        let python = std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
            panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
        });
        let s = m.info().shape;
        let spec = json!({
            "layers": s.layers, "kv_heads": s.kv_heads, "head_bytes": s.head_bytes,
            "block_size": 16, "num_blocks": 64, "layout": layout, "tp": tp, "prompts": prompts,
        });
        let spec_file = dir.join("spec.json");
        std::fs::write(&spec_file, spec.to_string()).unwrap();
        let script = format!("{}/../vllm/tests/peers/vllm_server.py", env!("CARGO_MANIFEST_DIR"));
        on_fresh_ports("the mock vLLM server", |attempt| {
            let (http, side) = (free_port(), free_port());
            let log = dir.join(format!("vllm_server.{attempt}.log"));
            let mut child = Command::new(&python)
                .args([&script, &http.to_string(), &side.to_string()])
                .arg(&spec_file)
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("the peers' python runs");
            // NIXL logs to stdout too: the server's line is the JSON one.
            let ready = BufReader::new(child.stdout.take().unwrap())
                .lines()
                .map_while(Result::ok)
                .find(|l| l.starts_with("{\"http\""));
            if ready.is_some() {
                return Ok(MockVllmServer { child, http, side });
            }
            let _ = child.kill();
            let _ = child.wait();
            Err(std::fs::read_to_string(&log).unwrap_or_default())
        })
    }

    /// What `/stats` says: the requests whose blocks are held, those freed, free blocks.
    fn stats(&self) -> Value {
        let mut s = std::net::TcpStream::connect(("127.0.0.1", self.http)).unwrap();
        s.write_all(b"GET /stats HTTP/1.0\r\n\r\n").unwrap();
        let mut text = String::new();
        s.read_to_string(&mut text).unwrap();
        serde_json::from_str(text.split("\r\n\r\n").nth(1).unwrap()).unwrap()
    }

    /// Waits until only `stuck` requests hold blocks (vLLM's code frees one on the decode's
    /// notification, polled every millisecond); `/stats` then.
    async fn settled(&self, stuck: usize) -> Value {
        for _ in 0..400 {
            let s = self.stats();
            if s["held"].as_array().is_some_and(|h| h.len() == stuck) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        panic!("blocks still held after 10 s: {}", self.stats());
    }
}

/// `text`'s KV computed by the real model, written in the canonical layout for the mock,
/// which answers for it with `lie` in its `kv_transfer_params`.
async fn prepare(m: &SmolLm, text: &str, dir: &std::path::Path, lie: Value) -> (Prompt, Value) {
    let (prompt, p) = aggregated(m, text).await;
    let file = dir.join(format!("kv-{}.bin", free_port()));
    std::fs::write(&file, p.kv.layers().concat()).unwrap();
    let entry = json!({"input_ids": prompt.tokens, "kv_file": file, "answer": lie});
    (prompt, entry)
}

/// A scheduler routing to `server` and a frontend driving vLLM prefills: the processes and a
/// client.
async fn cluster(
    server: &MockVllmServer,
) -> (Handoff, Handoff, GenerateClient<tonic::transport::Channel>) {
    let engine = format!(
        "id=vllm-0,kind=vllm,events=tcp://127.0.0.1:{},url=127.0.0.1:{},side=127.0.0.1:{}",
        free_port(),
        server.http,
        server.side
    );
    cluster_for(&engine, &["--drive-vllm"]).await
}

/// Prompts of 6, 17 and 32 tokens: a partial block, one past a block, whole blocks.
const TEXTS: [&str; 3] = [
    "The capital of France is",
    "The three primary colours are red, blue and yellow; mixing two of them gives",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who every morning went out in his little boat",
];

async fn decodes_from_a_vllm_prefill(tp: usize, layout: &str) {
    let (m, dir) = model_and_dir();
    let mut prompts = Vec::new();
    let mut entries = Vec::new();
    for text in TEXTS {
        let (p, e) = prepare(&m, text, &dir, json!({})).await;
        prompts.push(p);
        entries.push(e);
    }
    // Two lying answers: blocks beyond the cache, and somebody else's request.
    let (beyond, e) =
        prepare(&m, "def fibonacci(n):", &dir, json!({"remote_block_ids": [[99, 98]]})).await;
    entries.push(e);
    let foreign = json!({"remote_request_id": "cmpl-someone-else-0-1a2b3c4d"});
    let (theirs, e) = prepare(&m, "Hello, my name is", &dir, foreign).await;
    entries.push(e);
    let server = MockVllmServer::start(&m, &dir, tp, layout, &entries);
    let (_scheduler, _frontend, mut client) = cluster(&server).await;

    // The first prompt twice (its ranks handshaken once), then the others.
    let mut rooms = Vec::new();
    for p in [&prompts[0], &prompts[0], &prompts[1], &prompts[2]] {
        rooms.push(same_tokens(&mut client, p).await);
    }
    rooms.dedup();
    assert_eq!(rooms.len(), 4, "a fresh room each request: {rooms:?}");
    let stats = server.settled(0).await;
    assert_eq!(stats["freed"].as_array().unwrap().len(), 4, "vLLM's code freed each: {stats}");
    assert_eq!(stats["free_blocks"], 64, "every block back: {stats}");
    for (freed, room) in stats["freed"].as_array().unwrap().iter().zip(&rooms) {
        let id = freed.as_str().unwrap();
        assert!(id.starts_with(&format!("cmpl-handoff-room-{room}-")), "{id} for room {room}");
        // Each read told every rank its blocks were still wanted (vLLM's heartbeat, which
        // its code parses): at once, then every 5 s while it runs.
        for (rank, beats) in stats["heartbeats"].as_array().unwrap().iter().enumerate() {
            let beats = beats.as_array().unwrap().iter().filter(|b| *b == freed).count();
            assert!(beats >= 1, "{id}: no heartbeat to rank {rank}: {stats}");
        }
        assert_eq!(stats["heartbeats"].as_array().unwrap().len(), tp);
    }

    // A prompt the server refuses fails its request with the server's reason; the next
    // request is unaffected.
    let (other, _) = aggregated(&m, "A prompt the server was never given").await;
    let err = generate(&mut client, &other.tokens).await.expect_err("the mock refuses it");
    assert_eq!(err.code(), tonic::Code::InvalidArgument, "{err:?}");
    assert!(err.message().contains("only the prompts in its SPEC"), "{}", err.message());
    same_tokens(&mut client, &prompts[1]).await;
    server.settled(0).await;

    // Blocks beyond the cache are not read; the prefill is still told it may free the real
    // ones at once, not when its lease runs out.
    let err = generate(&mut client, &beyond.tokens).await.expect_err("blocks beyond the cache");
    assert!(err.message().contains("block 99 of a cache of 64"), "{}", err.message());
    server.settled(0).await;
    // An answer for another request is refused before anything is read or notified: its
    // blocks wait for vLLM's lease.
    let err = generate(&mut client, &theirs.tokens).await.expect_err("another request's KV");
    assert!(err.message().contains("is not for request"), "{}", err.message());
    same_tokens(&mut client, &prompts[2]).await;
    let stats = server.settled(1).await;
    assert_eq!(stats["free_blocks"], 63, "only the refused answer's block held: {stats}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_decodes_what_a_vllm_prefill_server_computed() {
    decodes_from_a_vllm_prefill(1, "LBHNC").await;
}

/// SmolLM2 has 3 KV heads: at TP 3 each rank holds one, and the decode reads every rank
/// (`LBNHC` blocks this time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_decodes_from_a_vllm_prefill_of_tp_3() {
    decodes_from_a_vllm_prefill(3, "LBNHC").await;
}

/// Without UCX_MODULES the wheel's UCX crashes the process at exit: `--drive-vllm` refuses
/// to start instead, saying what to set.
#[test]
fn driving_vllm_without_ucx_modules_is_refused_with_the_fix() {
    let out = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["frontend", "--engine", "mock", "--scheduler", "127.0.0.1:1", "--drive-vllm"])
        .env_remove("UCX_MODULES")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--drive-vllm needs UCX_MODULES") && err.contains("fetch-nixl"), "{err}");
}
