//! SGLang 0.5.23's own prefill-side sender (`MooncakeKVManager`, `MooncakeKVSender` and its
//! bootstrap server, from the wheel, run on CPU buffers with the stubs in
//! `peers/sgl_shim.py`) sends a request's KV through the real Mooncake wheel to our
//! [`SglangReceiver`]. The venv comes from `scripts/fetch-peers`; `scripts/test` exports its
//! python as `HANDOFF_PEERS_PYTHON`. Without it these tests fail, never skip.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use handoff_core::{Room, Tasks};
use handoff_engine::KvShape;
use handoff_sglang::{SglangError, SglangLayout, SglangReceiver};
use handoff_transfer::InboxConfig;
use sha2::{Digest, Sha256};
use tokio::time::Instant;

struct Prefill {
    child: Child,
    boot: String,
    report: serde_json::Value,
}

impl Drop for Prefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Most bootstrap ports tried: another process may bind the one picked before SGLang does.
const PORT_TRIES: usize = 5;

/// Starts SGLang's prefill for `room`, writing `aux_room` in its metadata row; with `spec`,
/// the pages of a real model's KV. A port taken before SGLang binds it is given up for
/// another.
fn prefill(room: u64, aux_room: u64, env: &[(&str, &str)], spec: Option<&str>) -> Prefill {
    for _ in 0..PORT_TRIES {
        match start_prefill(free_port(), room, aux_room, env, spec) {
            Started::Ready(p) => return p,
            Started::PortTaken(_) => continue,
        }
    }
    panic!("SGLang's bootstrap port was taken {PORT_TRIES} times in a row");
}

/// How SGLang's prefill started.
enum Started {
    /// Serving its bootstrap directory, with its report.
    Ready(Prefill),
    /// Its bootstrap port was taken: it reported so and exits.
    PortTaken(Prefill),
}

/// Starts SGLang's prefill (see [`prefill`]) with its bootstrap directory on `port`.
fn start_prefill(
    port: u16,
    room: u64,
    aux_room: u64,
    env: &[(&str, &str)],
    spec: Option<&str>,
) -> Started {
    let python = std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
        panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
    });
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/sglang_prefill.py");
    let mut child = Command::new(python)
        .args([script, &port.to_string(), &room.to_string(), &aux_room.to_string()])
        .args(spec)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the peers' python runs");
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert!(!line.is_empty(), "SGLang's prefill exited before it was ready");
    let report: serde_json::Value = serde_json::from_str(&line).unwrap();
    let taken = report.get("port_taken").is_some();
    let p = Prefill { child, boot: format!("127.0.0.1:{port}"), report };
    if taken { Started::PortTaken(p) } else { Started::Ready(p) }
}

fn layout(report: &serde_json::Value) -> SglangLayout {
    let n = |k: &str| report[k].as_u64().unwrap() as usize;
    SglangLayout {
        layers: n("layers"),
        page_size: n("page_size"),
        kv_heads: n("kv_heads"),
        head_bytes: n("head_bytes"),
        aux_row_bytes: report["aux_row_bytes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as usize)
            .collect(),
    }
}

fn sha(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// 60 prompt tokens: 4 pages of 16.
const TOKENS: usize = 60;

async fn receive(
    p: &Prefill,
    room: u64,
    tokens: usize,
) -> (Result<handoff_sglang::SglangKv, SglangError>, SglangLayout, Tasks) {
    receive_as(p, room, tokens, layout(&p.report)).await
}

/// As [`receive`], with the decode's layout `l`.
async fn receive_as(
    p: &Prefill,
    room: u64,
    tokens: usize,
    l: SglangLayout,
) -> (Result<handoff_sglang::SglangKv, SglangError>, SglangLayout, Tasks) {
    let tasks = Tasks::new();
    let rx = SglangReceiver::start(
        l.clone(),
        [127, 0, 0, 1].into(),
        None,
        InboxConfig::default(),
        &tasks,
    )
    .await
    .unwrap();
    let shape = KvShape { layers: l.layers, kv_heads: l.kv_heads, head_bytes: l.head_bytes };
    let deadline = Instant::now() + Duration::from_secs(30);
    let got = rx.receive(&p.boot, Room::try_from(room).unwrap(), tokens, shape, deadline).await;
    (got, l, tasks)
}

async fn every_page_arrives(env: &[(&str, &str)]) {
    let room = 0x0123_4567_89ab_cdef;
    let mut p = prefill(room, room, env, None);
    let (got, l, tasks) = receive(&p, room, TOKENS).await;
    let got = got.expect("received and verified");
    assert_eq!(got.first_token, 31337);
    let item = l.item_len();
    for (i, &off) in got.layout.kv.iter().enumerate() {
        let pages = &got.raw[off as usize..off as usize + got.layout.pages * item];
        assert_eq!(
            sha(pages),
            p.report["sha256"][i],
            "buffer {i}: every byte where SGLang's layout says"
        );
    }
    // The engine's KV: token 17 of layer 1's V, head 1 is row 1 of the second page.
    let row = l.kv_heads * l.head_bytes;
    let v1 = got.layout.kv[3] as usize;
    let src = v1 + 17 * row + l.head_bytes;
    assert_eq!(
        &got.kv.run(1, 1, 1)[17 * l.head_bytes..18 * l.head_bytes],
        &got.raw[src..src + l.head_bytes]
    );
    let status = tokio::task::spawn_blocking(move || p.child.wait().unwrap()).await.unwrap();
    assert!(status.success(), "SGLang's sender reached Success");
    tasks.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sglangs_sender_delivers_every_page_to_our_receiver() {
    every_page_arrives(&[]).await;
}

#[test]
fn a_taken_bootstrap_port_is_reported_and_not_served() {
    let holder = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = holder.local_addr().unwrap().port();
    let Started::PortTaken(mut p) = start_prefill(port, 7, 7, &[], None) else {
        panic!("SGLang's prefill reported ready on a port another process holds");
    };
    assert_eq!(p.report["port_taken"], port);
    assert_eq!(p.child.wait().unwrap().code(), Some(75));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_metadata_row_may_come_over_zmq() {
    every_page_arrives(&[("SGLANG_MOONCAKE_SEND_AUX_TCP", "1")]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metadata_row_naming_another_room_is_refused() {
    let room = 0x0123_4567_89ab_cdef;
    let p = prefill(room, room + 1, &[], None);
    let (got, _, tasks) = receive(&p, room, TOKENS).await;
    match got {
        Err(SglangError::RoomMismatch { expected, got }) => {
            assert_eq!((expected, got), (room, room + 1));
        }
        other => panic!("expected a room mismatch, got {other:?}"),
    }
    tasks.shutdown().await;
}

/// A prefill whose KV elements are half the size of ours (bf16 against our f32) fills half
/// of each page: the request fails when the prefill reports success, naming the gap and the
/// likely cause, not at its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_of_another_element_size_fail_at_once_with_the_reason() {
    let room = 0x0123_4567_89ab_cdef;
    let p = prefill(room, room, &[], None);
    let mut ours = layout(&p.report);
    ours.head_bytes *= 2;
    let (got, _, tasks) = receive_as(&p, room, TOKENS, ours).await;
    let err = got.expect_err("half-filled pages are refused");
    assert!(matches!(err, SglangError::Transfer(_)), "the transfer's failure: {err}");
    let err = err.to_string();
    assert!(err.contains("gap") && err.contains("--dtype float32"), "{err}");
    tasks.shutdown().await;
}

/// The real model: SmolLM2's KV for a prompt, computed by our engine, laid out in SGLang's
/// pages in SGLang's prefill, sent by SGLang's sender, received and converted back: the same
/// bytes, and the same tokens decoded from them as from the engine's own KV.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_models_kv_through_sglangs_sender_decodes_the_same_tokens() {
    use handoff_engine::{Engine, Sampling};
    let path = std::env::var("HANDOFF_MODEL").unwrap_or_else(|_| {
        panic!("HANDOFF_MODEL is not set: run `export HANDOFF_MODEL=\"$(scripts/fetch-model)\"` (scripts/test does)")
    });
    let engine = handoff_smollm::SmolLm::load(&handoff_smollm::SmolConfig::new(path)).unwrap();
    let prompt = engine
        .tokenize("The three primary colours are red, blue and yellow; mixing two of them gives")
        .unwrap();
    let exported = engine.prefill(&prompt, None, &Sampling::default()).await.unwrap();
    let shape = exported.kv.shape();
    let l = SglangLayout::for_kv(shape, 16);
    let pages = l.pages_from_kv(&exported.kv).unwrap();
    let dir = std::env::temp_dir().join(format!("handoff-sglang-kv-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    let (kv_file, spec_file) = (dir.join("kv.bin"), dir.join("spec.json"));
    std::fs::write(&kv_file, &pages).unwrap();
    let spec = serde_json::json!({
        "layers": l.layers, "page_size": l.page_size, "kv_heads": l.kv_heads,
        "head_bytes": l.head_bytes, "pages": l.request(prompt.len()).unwrap().pages,
        "first_token": exported.first_token, "kv_file": kv_file,
    });
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    let room = Room::mint().get();
    let p = prefill(room, room, &[], spec_file.to_str());
    let (got, _, tasks) = receive(&p, room, prompt.len()).await;
    let _ = std::fs::remove_dir_all(&dir);
    let got = got.expect("received and verified");
    assert!(got.kv == exported.kv, "the engine's KV, byte for byte");
    assert_eq!(got.first_token, exported.first_token);
    let decode = |kv| {
        let mut d = engine.decoder(kv, exported.first_token, &Sampling::default()).unwrap();
        async move {
            let mut out = Vec::new();
            for _ in 0..8 {
                out.push(d.step().await.unwrap());
            }
            out
        }
    };
    let theirs = decode(got.kv).await;
    assert_eq!(theirs, decode(exported.kv.clone()).await);
    eprintln!("decoded from SGLang's pages: {:?}", engine.detokenize(&theirs));
    tasks.shutdown().await;
}
