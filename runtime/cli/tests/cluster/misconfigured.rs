//! Roles started in ways that cannot work refuse to start, saying what to give: before, each
//! ran and said it was ready, found by nothing (or waiting for a scheduler for ever, or
//! overwriting another process's registration).

use std::process::Command;

use super::servers::{Handoff, Server};

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

/// Two prefills given one `--id`: the second refuses to start, naming the holder, rather
/// than overwriting its registration (one unroutable, both announcing KV under the id). Once
/// the holder dies without a word, its successor registers as soon as its lease runs out.
#[test]
fn a_second_process_under_a_live_id_is_refused_and_a_dead_ones_is_taken_over() {
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let mut holder = super::servers::prefill(&etcd, &nats, "dup", &["--lease-ttl-secs", "2"]);
    let twin = [
        "prefill",
        "--engine",
        "mock",
        "--id",
        "dup",
        "--bootstrap-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "127.0.0.1:0",
        "--lease-ttl-secs",
        "2",
        "--etcd",
        &etcd.url,
        "--nats",
        &nats.url,
    ];
    let (ok, err) = run(&twin);
    assert!(!ok && err.contains("registered by another live process"), "{err}");
    holder.kill9();
    let (_successor, line) = Handoff::spawn(&twin);
    assert!(line.contains("prefill dup ready"), "{line}");
}
