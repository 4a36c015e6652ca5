//! Roles started in ways that cannot work refuse to start, saying what to give: before, each
//! ran, said it was ready, and was found by nothing (or waited for a scheduler for ever).

use std::process::Command;

/// `handoff` with `args` and no discovery in its environment: whether it succeeded within
/// the test's bound, and its stderr.
fn run(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .env_remove("HANDOFF_ETCD")
        .env_remove("HANDOFF_NATS")
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > std::time::Duration::from_secs(20) {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("{args:?} still running at 20 s: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_prefill_no_one_can_find_is_refused() {
    let (ok, err) = run(&["prefill", "--engine", "mock", "--grpc-listen", "127.0.0.1:0"]);
    assert!(!ok && err.contains("found by no scheduler or frontend"), "{err}");
}

#[test]
fn a_frontend_with_no_scheduler_to_ask_is_refused() {
    let (ok, err) = run(&["frontend", "--engine", "mock", "--listen", "127.0.0.1:0"]);
    assert!(!ok && err.contains("no scheduler to ask"), "{err}");
}
