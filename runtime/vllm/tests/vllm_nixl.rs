//! vLLM 0.33's own NIXL prefill side (`peers/vllm_nixl_prefill.py`: its handshake listener,
//! metadata encoding and notification-driven freeing, from the wheel, over a real NIXL agent)
//! against this crate's decode over handoff's nixl backend. Needs the peers' venv
//! (`HANDOFF_PEERS_PYTHON`, from scripts/fetch-peers) and NIXL's library with UCX's settings
//! (`eval "$(scripts/fetch-nixl --env)"`); scripts/test sets both. Fails, never skips,
//! without them.

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

use handoff_transfer::nixl::NixlReader;
use handoff_vllm::{VllmError, connect, read_blocks};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

const WAIT: Duration = Duration::from_secs(20);

struct Prefill {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<Value>,
    port: u16,
    report: Value,
}

impl Drop for Prefill {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prefill {
    fn start() -> Self {
        let python = std::env::var("HANDOFF_PEERS_PYTHON").unwrap_or_else(|_| {
            panic!("HANDOFF_PEERS_PYTHON is not set: run `export HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\"` (scripts/test does)")
        });
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/peers/vllm_nixl_prefill.py");
        // A port found free can be taken by a concurrent test before vLLM's listener binds
        // it, and the peer then exits: it is tried again on another, and its stderr shown.
        let mut logs = Vec::new();
        for _ in 0..3 {
            let port =
                std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let mut child = Command::new(&python)
                .args([script, &port.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("the peers' python runs");
            let stdin = child.stdin.take().unwrap();
            let out = BufReader::new(child.stdout.take().unwrap());
            // Drained as it comes (a full pipe would stop the peer), kept for a failure.
            let mut err = child.stderr.take().unwrap();
            let stderr = std::thread::spawn(move || {
                let mut log = String::new();
                let _ = err.read_to_string(&mut log);
                log
            });
            let (tx, lines) = channel();
            std::thread::spawn(move || {
                for line in out.lines().map_while(Result::ok) {
                    if let Ok(v) = serde_json::from_str::<Value>(&line) {
                        let _ = tx.send(v);
                    }
                }
            });
            match lines.recv_timeout(WAIT) {
                Ok(report) => return Prefill { child, stdin, lines, port, report },
                Err(e) => {
                    // Killed first (it may not have exited), so its stderr closes.
                    let _ = child.kill();
                    let _ = child.wait();
                    let log = stderr.join().unwrap_or_default();
                    if e == RecvTimeoutError::Timeout {
                        panic!("vLLM's prefill did not report ready in {WAIT:?}: {log}");
                    }
                    logs.push(log);
                }
            }
        }
        panic!("vLLM's prefill exited before it was ready, three times: {logs:#?}");
    }

    fn send(&mut self, req: &str, blocks: &[u64]) -> Vec<String> {
        let cmd = json!({"cmd": "send", "req": req, "blocks": blocks});
        writeln!(self.stdin, "{cmd}").unwrap();
        let v = self.lines.recv_timeout(WAIT).expect("the prefill lists the blocks' sums");
        assert_eq!(v["req"], req, "{v}");
        v["sha256"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect()
    }

    fn freed(&self) -> Vec<String> {
        let v = self.lines.recv_timeout(WAIT).expect("the prefill frees the request");
        v["freed"].as_array().unwrap().iter().map(|s| s.as_str().unwrap().to_owned()).collect()
    }
}

fn nixl() -> NixlReader {
    NixlReader::start(Duration::from_millis(10)).expect("NIXL's library")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocks_read_from_vllms_prefill_land_in_its_layout_and_free_the_request() {
    let mut p = Prefill::start();
    let nixl = nixl();
    let peer = connect(&nixl, "127.0.0.1", p.port, 0, 0, WAIT).await.unwrap();
    let meta = &peer.handshake.metadata;
    assert_eq!(meta.engine_id, p.report["engine_id"].as_str().unwrap());
    assert_eq!(meta.regions() as u64, p.report["regions"].as_u64().unwrap());
    let block_len = p.report["block_len"].as_u64().unwrap() as usize;
    for (req, ids) in [("req-1", vec![3u64, 4, 5, 17, 40]), ("req-2", vec![63, 0])] {
        let want = p.send(req, &ids);
        let got = read_blocks(&nixl, &peer, req, &ids, 1, 1 << 30, WAIT).await.unwrap();
        let mut sums = Vec::new();
        for r in 0..meta.regions() {
            for i in 0..ids.len() {
                sums.push(format!("{:x}", Sha256::digest(got.block(r, i, block_len))));
            }
        }
        assert_eq!(sums, want, "{req}: every block where vLLM's layout says");
        assert_eq!(p.freed(), vec![req.to_owned()], "vLLM's code frees {req} on our notification");
    }
    // A full prefix hit: nothing to read, the notification alone frees the request.
    p.send("req-3", &[1, 2]);
    let got = read_blocks(&nixl, &peer, "req-3", &[], 1, 1 << 30, WAIT).await.unwrap();
    assert!(got.bytes.is_empty());
    assert_eq!(p.freed(), vec!["req-3".to_owned()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_reads_and_dead_side_channels_are_refused_and_the_peer_keeps_serving() {
    let mut p = Prefill::start();
    let nixl = nixl();
    let peer = connect(&nixl, "127.0.0.1", p.port, 0, 0, WAIT).await.unwrap();
    let too_far = read_blocks(&nixl, &peer, "x", &[64], 1, 1 << 30, WAIT).await.unwrap_err();
    assert!(matches!(&too_far, VllmError::Invalid(m) if m.contains("block 64")), "{too_far}");
    let too_big = read_blocks(&nixl, &peer, "x", &[1, 2], 1, 1000, WAIT).await.unwrap_err();
    assert!(matches!(&too_big, VllmError::TooLarge(m) if m.contains("at most 1000")), "{too_big}");
    // Nothing listens there: a clear error within the timeout.
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let e = connect(&nixl, "127.0.0.1", dead, 0, 0, Duration::from_secs(1)).await.unwrap_err();
    assert!(matches!(e, VllmError::SideChannel { .. }), "{e}");
    // The prefill still serves.
    let want = p.send("req-9", &[7]);
    let got = read_blocks(&nixl, &peer, "req-9", &[7], 1, 1 << 30, WAIT).await.unwrap();
    assert_eq!(
        format!("{:x}", Sha256::digest(got.block(0, 0, got.bytes.len() / want.len()))),
        want[0]
    );
    assert_eq!(p.freed(), vec!["req-9".to_owned()]);
}
