//! The real model on the whole path: SmolLM2-135M-Instruct (fetched by scripts/fetch-model;
//! these tests fail, never skip, without it).

use std::sync::{Arc, OnceLock};

use bytes::Bytes;
use handoff::cmd::up::engines;
use handoff::{Cluster, ClusterConfig};
use handoff_engine::{Engine, Sampling};
use handoff_smollm::{SmolConfig, SmolLm};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use super::support::{aggregated, client, direct_attempt, generate};

fn model() -> &'static SmolLm {
    static M: OnceLock<SmolLm> = OnceLock::new();
    M.get_or_init(|| {
        let args = handoff::args::EngineArgs {
            engine: handoff::args::EngineArg::Smollm,
            model: std::env::var_os("HANDOFF_MODEL").map(Into::into),
            model_dir: std::env::var_os("HANDOFF_MODEL_DIR").map(Into::into),
            max_context: 2048,
            mock_prefill_us: 0,
            mock_decode_us: 0,
        };
        let path = args.model_path();
        assert!(path.exists(), "model not found at {}: run scripts/fetch-model", path.display());
        let mut cfg = SmolConfig::new(path);
        cfg.max_context = 2048;
        SmolLm::load(&cfg).expect("model loads")
    })
}

async fn cluster(cfg: ClusterConfig) -> Cluster {
    let base = model();
    Cluster::start(cfg, &|| Ok(Arc::new(base.fork()?) as Arc<dyn Engine>))
        .await
        .expect("cluster starts")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn disaggregated_tp3_to_tp1_equals_aggregated_and_kv_bytes_match() {
    let m = model();
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 3, ..ClusterConfig::ephemeral() }).await;
    let mut cl = client(&c).await;
    for text in
        ["The capital of Japan is", "Rust's ownership model means that", "def fibonacci(n):"]
    {
        let prompt = m.tokenize(text).unwrap();
        let exported = m.prefill(&prompt, None, &Sampling::default()).await.unwrap();
        // The bytes the decode imports, through the tp 3 instance's three ranks.
        let got = direct_attempt(&c, m, 1, &prompt).await;
        assert!(got.kv == exported.kv, "{text:?}: imported KV bytes differ from exported");
        assert_eq!(got.first_token, exported.first_token);
        // Token for token through the frontend.
        let (tokens, _) = generate(&mut cl, &prompt, 12).await.unwrap();
        assert_eq!(tokens, aggregated(m, &prompt, 12).await, "{text:?}");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_prefix_gives_the_same_output() {
    let m = model();
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let mut cl = client(&c).await;
    let system = "You are a careful assistant. Answer briefly and precisely, in one sentence. ";
    let first = m.tokenize(&format!("{system}Question: what is a prefix cache?")).unwrap();
    let second =
        m.tokenize(&format!("{system}Question: why disaggregate prefill and decode?")).unwrap();
    let uncached = aggregated(m, &second, 10).await;
    generate(&mut cl, &first, 2).await.unwrap();
    let (tokens, done) = generate(&mut cl, &second, 10).await.unwrap();
    let cached = done.usage.unwrap().cached_tokens;
    assert!(cached > 0, "the shared system prompt is served from cache");
    assert_eq!(tokens, uncached, "output with {cached} cached tokens equals the uncached run");
    c.shutdown().await;
}

async fn post(addr: std::net::SocketAddr, path: &str, body: Value) -> (u16, String) {
    let http = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_chat_answers_paris_streamed_and_not() {
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let ask = json!({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0});
    let (status, body) = post(c.http_addr, "/v1/chat/completions", ask.clone()).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(answer.contains("Paris"), "{answer:?}");
    assert!(v["usage"]["completion_tokens"].as_u64().unwrap() > 0);
    assert!(matches!(v["choices"][0]["finish_reason"].as_str(), Some("stop" | "length")));

    let mut streamed = ask.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let (status, body) = post(c.http_addr, "/v1/chat/completions", streamed).await;
    assert_eq!(status, 200);
    let events: Vec<&str> = body.split("\n\n").filter(|e| !e.is_empty()).collect();
    assert_eq!(events.last(), Some(&"data: [DONE]"));
    let mut text = String::new();
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    assert_eq!(text, answer, "streamed text equals the non-streamed answer (greedy)");

    let (status, body) = post(c.http_addr, "/v1/completions", json!({"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})).await;
    assert_eq!(status, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "text_completion");
    assert!(v["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{v}");
    c.shutdown().await;
}

/// `engines` (what `handoff up` uses) refuses a missing model with a clear error.
#[test]
fn a_missing_model_is_a_clear_error() {
    let args = handoff::args::EngineArgs {
        engine: handoff::args::EngineArg::Smollm,
        model: Some("/nonexistent/model.gguf".into()),
        model_dir: None,
        max_context: 2048,
        mock_prefill_us: 0,
        mock_decode_us: 0,
    };
    let err = engines(&args).err().expect("refused").to_string();
    assert!(err.contains("scripts/fetch-model"), "{err}");
}
