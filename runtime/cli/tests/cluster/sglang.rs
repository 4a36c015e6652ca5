//! A handoff frontend decoding for an SGLang prefill server: `handoff scheduler --engine
//! id=..,kind=sglang,url=..,bootstrap=..` routes a request to it, the frontend POSTs it to the
//! server's `/generate` with the bootstrap fields and receives the KV as SGLang's decode, then
//! streams the tokens. The server is `peers/sglang_server.py` in the sglang crate, a MOCK named
//! as such: SGLang 0.5.23's own bootstrap server, KV manager and sender over the real Mooncake
//! wheel, with the KV of each prompt computed beforehand by our engine (no torch here).

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use handoff_engine::{Engine, Sampling};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use handoff_sglang::SglangLayout;
use handoff_smollm::{SmolConfig, SmolLm};

use super::ports::{free_port, on_fresh_ports};
use super::processes::addr_after;
use super::servers::Handoff;

/// The mock SGLang prefill server, killed on drop.
struct MockSglangServer {
    child: Child,
    http: u16,
    bootstrap: u16,
}

impl Drop for MockSglangServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl MockSglangServer {
    fn start(spec: &std::path::Path, env: &[(&str, &str)]) -> Self {
        let python = std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
            panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
        });
        let script =
            format!("{}/../sglang/tests/peers/sglang_server.py", env!("CARGO_MANIFEST_DIR"));
        let dir = spec.parent().expect("the spec is in the server's directory");
        on_fresh_ports("the mock SGLang server", |attempt| {
            let (http, bootstrap) = (free_port(), free_port());
            let log = dir.join(format!("sglang_server.{attempt}.log"));
            let mut child = Command::new(&python)
                .args([&script, &http.to_string(), &bootstrap.to_string()])
                .arg(spec)
                .envs(env.iter().copied())
                .stdout(Stdio::piped())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("the peers' python runs");
            let mut line = String::new();
            BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
            if line.contains("\"http\"") {
                return Ok(MockSglangServer { child, http, bootstrap });
            }
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("{line:?}, stderr {:?}", std::fs::read_to_string(&log).unwrap_or_default()))
        })
    }
}

pub(crate) struct Prompt {
    pub(crate) tokens: Vec<u32>,
    /// Greedy tokens of the engine aggregated: prefill and decode in one process.
    pub(crate) expected: Vec<u32>,
}

/// `text` prefilled by the real model, and the 8 tokens the engine generates from it.
pub(crate) async fn aggregated(m: &SmolLm, text: &str) -> (Prompt, handoff_engine::Prefilled) {
    let tokens = m.tokenize(text).unwrap();
    let p = m.prefill(&tokens, None, &Sampling::default()).await.unwrap();
    let mut expected = vec![p.first_token];
    let mut d = m.decoder(p.kv.clone(), p.first_token, &Sampling::default()).unwrap();
    while expected.len() < 8 {
        expected.push(d.step().await.unwrap());
    }
    (Prompt { tokens, expected }, p)
}

/// Computes `text`'s KV with the real model, writes it in SGLang's pages for the mock server,
/// and the tokens the engine generates from it.
async fn prepare(
    m: &SmolLm,
    text: &str,
    dir: &std::path::Path,
    aux_room_delta: u64,
) -> (Prompt, serde_json::Value) {
    let (prompt, p) = aggregated(m, text).await;
    let layout = SglangLayout::for_kv(p.kv.shape(), 16);
    let file = dir.join(format!("kv-{}.bin", free_port()));
    std::fs::write(&file, layout.pages_from_kv(&p.kv).unwrap()).unwrap();
    let entry = serde_json::json!({
        "input_ids": prompt.tokens, "first_token": p.first_token, "kv_file": file,
        "aux_room_delta": aux_room_delta,
    });
    (prompt, entry)
}

pub(crate) async fn generate(
    client: &mut GenerateClient<tonic::transport::Channel>,
    tokens: &[u32],
) -> Result<(Vec<u32>, u64), tonic::Status> {
    let req = GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: tokens.to_vec() })),
        sampling: Some(SamplingParams { max_tokens: 8, ignore_eos: true, ..Default::default() }),
        deadline_ms: 60_000,
        ..Default::default()
    };
    let mut stream = client.generate(req).await?.into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await? {
        match m.event {
            Some(Event::Chunk(c)) => out.extend(c.token_ids),
            Some(Event::Complete(c)) => {
                let room = c.evidence.map_or(0, |e| e.bootstrap_room);
                return Ok((out, room));
            }
            None => {}
        }
    }
    Err(tonic::Status::internal("stream ended without Complete"))
}

/// The model, and a fresh directory for the mock server's files.
pub(crate) fn model_and_dir() -> (SmolLm, std::path::PathBuf) {
    let path = std::env::var("HANDOFF_MODEL").unwrap_or_else(|_| {
        panic!("HANDOFF_MODEL is not set: run `export HANDOFF_MODEL=\"$(scripts/fetch-model)\"` (scripts/test does)")
    });
    let m = SmolLm::load(&SmolConfig::new(path)).unwrap();
    let dir = std::env::temp_dir().join(format!("handoff-sglang-server-{}", free_port()));
    std::fs::create_dir_all(&dir).unwrap();
    (m, dir)
}

/// Starts the mock server of attention TP `tp` for `prompts`, with `env`.
fn serve(
    m: &SmolLm,
    dir: &std::path::Path,
    tp: usize,
    prompts: &[serde_json::Value],
    env: &[(&str, &str)],
) -> MockSglangServer {
    let s = m.info().shape;
    let spec = serde_json::json!({
        "layers": s.layers, "page_size": 16, "kv_heads": s.kv_heads, "head_bytes": s.head_bytes,
        "tp": tp, "prompts": prompts,
    });
    let spec_file = dir.join("spec.json");
    std::fs::write(&spec_file, spec.to_string()).unwrap();
    MockSglangServer::start(&spec_file, env)
}

/// A scheduler routing to `server` and a frontend asking it: the processes and a client.
async fn cluster(
    server: &MockSglangServer,
) -> (Handoff, Handoff, GenerateClient<tonic::transport::Channel>) {
    let engine = format!(
        "id=sgl-0,kind=sglang,events=tcp://127.0.0.1:{},url=127.0.0.1:{},bootstrap=127.0.0.1:{}",
        free_port(),
        server.http,
        server.bootstrap
    );
    cluster_for(&engine, &[]).await
}

/// A scheduler routing to the engine `--engine engine` and a frontend (with `extra` flags)
/// asking it: the processes and a client.
pub(crate) async fn cluster_for(
    engine: &str,
    extra: &[&str],
) -> (Handoff, Handoff, GenerateClient<tonic::transport::Channel>) {
    let (scheduler, line) =
        Handoff::spawn(&["scheduler", "--listen", "127.0.0.1:0", "--engine", engine]);
    let at = addr_after(&line, "grpc://");
    let mut args = vec!["frontend", "--listen", "127.0.0.1:0", "--http-listen", "127.0.0.1:0"];
    args.extend(["--scheduler", &at]);
    args.extend(extra);
    let (frontend, line) = Handoff::spawn(&args);
    let client =
        GenerateClient::connect(format!("http://{}", addr_after(&line, "grpc://"))).await.unwrap();
    (scheduler, frontend, client)
}

/// Generates `p` and checks it is token for token what the engine generates aggregated:
/// the room it had.
pub(crate) async fn same_tokens(
    client: &mut GenerateClient<tonic::transport::Channel>,
    p: &Prompt,
) -> u64 {
    let (tokens, room) = tokio::time::timeout(Duration::from_secs(90), generate(client, &p.tokens))
        .await
        .expect("answered in time")
        .expect("generated from the prefill server's KV");
    assert_eq!(tokens, p.expected, "token for token what the engine generates aggregated");
    room
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_decodes_what_an_sglang_prefill_server_computed() {
    let (m, dir) = model_and_dir();
    let (paris, a) = prepare(&m, "The capital of France is", &dir, 0).await;
    let (colours, b) =
        prepare(&m, "The three primary colours are red, blue and yellow; mixing two", &dir, 0)
            .await;
    // The metadata row of this one names another room: somebody else's KV.
    let (corrupt, c) = prepare(&m, "def fibonacci(n):", &dir, 1).await;
    let server = serve(&m, &dir, 1, &[a, b, c], &[]);
    let (_scheduler, _frontend, mut client) = cluster(&server).await;

    // Twice the first prompt (the decode registered with the rank once), then another.
    let mut rooms = Vec::new();
    for p in [&paris, &paris, &colours] {
        rooms.push(same_tokens(&mut client, p).await);
    }
    rooms.dedup();
    assert_eq!(rooms.len(), 3, "a fresh room each request: {rooms:?}");

    // A corrupted row fails its request with the reason; the next request is unaffected.
    let err = generate(&mut client, &corrupt.tokens).await.expect_err("a foreign room is refused");
    assert!(err.message().contains("bootstrap_room mismatch"), "{}: {}", err.code(), err.message());
    same_tokens(&mut client, &colours).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A prefill of attention TP 3 (SmolLM2 has 3 KV heads, one per rank): each rank sends its
/// head of every token slot (SGLang's `send_kvcache_slice`) and a metadata row of its own
/// (over Mooncake, or over ZMQ with `env`). One rank's row naming another room fails the
/// request.
async fn decodes_from_a_prefill_of_attention_tp_3(env: &[(&str, &str)]) {
    let (m, dir) = model_and_dir();
    assert_eq!(m.info().shape.kv_heads, 3, "one head per rank");
    let (paris, a) = prepare(&m, "The capital of France is", &dir, 0).await;
    let (colours, b) =
        prepare(&m, "The three primary colours are red, blue and yellow; mixing two", &dir, 0)
            .await;
    let (corrupt, mut c) = prepare(&m, "def fibonacci(n):", &dir, 1).await;
    c["aux_room_rank"] = serde_json::json!(2);
    let server = serve(&m, &dir, 3, &[a, b, c], env);
    let (_scheduler, _frontend, mut client) = cluster(&server).await;

    for p in [&paris, &colours, &paris] {
        same_tokens(&mut client, p).await;
    }
    let err = generate(&mut client, &corrupt.tokens).await.expect_err("rank 2's row is foreign");
    assert!(err.message().contains("bootstrap_room mismatch"), "{}: {}", err.code(), err.message());
    same_tokens(&mut client, &colours).await;
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_decodes_from_an_sglang_prefill_of_attention_tp_3() {
    decodes_from_a_prefill_of_attention_tp_3(&[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tp_3_prefills_metadata_rows_may_come_over_zmq() {
    decodes_from_a_prefill_of_attention_tp_3(&[("SGLANG_MOONCAKE_SEND_AUX_TCP", "1")]).await;
}
