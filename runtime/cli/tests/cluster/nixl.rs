//! `handoff up --transfer nixl` as a user runs it: the real model, KV over NIXL (the wheel's
//! library, which scripts/test puts on LD_LIBRARY_PATH with UCX's settings), and a clean exit.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};

/// `handoff up` on ephemeral ports with `extra` flags; returns the child and its HTTP address,
/// once it printed its ready line.
fn up(extra: &[&str]) -> (std::process::Child, String) {
    let model = std::env::var("HANDOFF_MODEL").expect("HANDOFF_MODEL: run scripts/fetch-model");
    let mut args = vec![
        "up",
        "--model",
        &model,
        "--frontend-listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--scheduler-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut http = None;
    loop {
        let mut line = String::new();
        assert!(out.read_line(&mut line).unwrap() > 0, "handoff up exited before it was ready");
        if line.starts_with("frontend") {
            http =
                line.split_whitespace().find_map(|w| w.strip_prefix("http://")).map(String::from);
        }
        if line.starts_with("handoff ready") {
            assert!(line.contains("Nixl"), "{line}");
            break;
        }
    }
    std::thread::spawn(move || std::io::copy(&mut out, &mut std::io::sink()));
    (child, http.expect("the frontend's HTTP address"))
}

async fn post(addr: &str, path: &str, body: Value) -> (u16, Value) {
    use bytes::Bytes;
    use http_body_util::{BodyExt, Full};
    let http = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<Full<Bytes>>();
    let req = hyper::Request::post(format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let resp = http.request(req).await.unwrap();
    let status = resp.status().as_u16();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
}

/// One tp 3 prefill (three ranks, three NIXL agents writing their heads of every page) into
/// the frontend's agent, all in the process `handoff up` starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn up_over_nixl_serves_the_real_model_and_exits_cleanly() {
    let (mut child, http) = up(&["--transfer", "nixl", "--prefills", "1", "--prefill-tp", "3"]);
    let ask = json!({"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 24, "temperature": 0});
    for _ in 0..3 {
        let (status, v) = post(&http, "/v1/chat/completions", ask.clone()).await;
        assert_eq!(status, 200, "{v}");
        let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
        assert!(answer.contains("Paris"), "{answer:?}");
    }
    let (status, v) = post(&http, "/v1/completions", json!({"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 5, "temperature": 0})).await;
    assert_eq!(status, 200, "{v}");
    assert!(v["choices"][0]["text"].as_str().unwrap().contains("Paris"), "{v}");
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let status = exit_within(&mut child, Duration::from_secs(20));
    assert!(status.success(), "handoff up exited with {status} (a crash at exit?)");
}

/// Without UCX_MODULES the wheel's UCX crashes every process at exit: `--transfer nixl`
/// refuses to start instead, saying what to set.
#[test]
fn nixl_without_ucx_modules_is_refused_with_the_fix() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["up", "--engine", "mock", "--transfer", "nixl", "--frontend-listen", "127.0.0.1:0"])
        .args(["--http-listen", "127.0.0.1:0", "--scheduler-listen", "127.0.0.1:0"])
        .env_remove("UCX_MODULES")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let status = exit_within(&mut child, Duration::from_secs(20));
    assert!(!status.success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert!(err.contains("UCX_MODULES=^ib") && err.contains("fetch-nixl"), "{err}");
}

/// The child's exit status, or a failed test (the child killed) if it runs past `limit`.
fn exit_within(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if std::time::Instant::now() >= deadline {
            let _ = child.kill();
            panic!("handoff still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}
