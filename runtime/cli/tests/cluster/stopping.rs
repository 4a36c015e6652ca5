//! A stop told while a role is still starting (waiting for etcd here) is honoured: the
//! process ends at once and cleanly. Before, the signal handler was installed only once the
//! role was ready; in a container, where the binary is PID 1, the kernel dropped the signal,
//! and the role went on to register and serve until its pod's grace ran out.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `handoff` with `args`, waits for it to say it waits for etcd, sends SIGTERM, and
/// returns whether it exited with success and what it logged.
fn stopped_while_waiting_for_etcd(args: &[&str]) -> (bool, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(args)
        .args(["--etcd", "http://127.0.0.1:1", "--nats", "nats://127.0.0.1:1"])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut logged = String::new();
    // Registering waits for etcd; following it (the frontend's schedulers) keeps retrying.
    while !logged.contains("etcd not reached; waiting for it")
        && !logged.contains("etcd watch lost")
    {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("{args:?} ended before waiting for etcd: {logged}");
        }
        logged.push_str(&line);
    }
    let pid = child.id().to_string();
    assert!(Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    let started = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if started.elapsed() > Duration::from_secs(20) {
            child.kill().unwrap();
            panic!("{args:?} still running 20 s after SIGTERM: {logged}");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut err, &mut rest);
    logged.push_str(&rest);
    (status.success(), logged)
}

#[test]
fn every_role_told_to_stop_while_it_waits_for_etcd_stops_cleanly() {
    let roles: [&[&str]; 4] = [
        &["prefill", "--engine", "mock", "--grpc-listen", "127.0.0.1:0"],
        &["scheduler", "--listen", "127.0.0.1:0"],
        &[
            "frontend",
            "--engine",
            "mock",
            "--listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
        &[
            "up",
            "--engine",
            "mock",
            "--frontend-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ],
    ];
    for args in roles {
        let (ok, logged) = stopped_while_waiting_for_etcd(args);
        assert!(ok && logged.contains("told to stop while starting"), "{args:?}: {logged}");
    }
}

/// An idle prefill told to stop still answers (as draining) for a few seconds before its
/// listeners close, so a scheduler replica that has not seen it leave yet sends frontends to
/// a refusal they pass over, not to a closed port they count as its fault. Before, its drain
/// was over at once, and its ports closed with it.
#[test]
fn an_idle_prefill_told_to_stop_answers_a_while_before_closing() {
    let (etcd, nats) = (super::servers::Server::etcd(), super::servers::Server::nats());
    let (mut p, ready) = super::servers::prefill_ready(&etcd, &nats, "quiet", &[]);
    let grpc = ready.split("grpc://").nth(1).unwrap().split_whitespace().next().unwrap().to_owned();
    let told = Instant::now();
    assert!(
        Command::new("kill").args(["-TERM", &p.child.id().to_string()]).status().unwrap().success()
    );
    while told.elapsed() < Duration::from_millis(2_500) {
        let reached =
            std::net::TcpStream::connect_timeout(&grpc.parse().unwrap(), Duration::from_secs(1));
        assert!(reached.is_ok(), "{grpc} closed {:?} after SIGTERM", told.elapsed());
        std::thread::sleep(Duration::from_millis(100));
    }
    let status = p.child.wait().unwrap();
    assert!(status.success(), "{status}");
}
