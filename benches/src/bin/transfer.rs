//! The tcp transfer on loopback: aggregate receive throughput with 1, 4 and 16 concurrent
//! 12 MB transfers (each region written by one sender in 64 runs of 192 KiB, as layers x K/V
//! of a small model), with no credential, with a cluster token, and with token and mutual
//! TLS, against the ceiling of the same
//! bytes over plain sockets (write, read, discard: no framing, no copy into a region, no
//! verification) in the same run. Then the per-request cost of a small transfer (64 KiB):
//! register, write, notice, verify, take.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin transfer
//! cargo run --release -p handoff-benches --bin transfer -- --rounds 5
//! ```

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use handoff_benches::parse_flags;
use handoff_core::tls::ClusterTls;
use handoff_core::tls::test_certs::TestCa;
use handoff_core::{Room, Tasks};
use handoff_transfer::tcp::TcpConfig;
use handoff_transfer::{Agent, Inbox, InboxConfig, SenderId, TcpTransfer, WriteRequest};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RUNS: usize = 64;
const RUN: usize = 192 << 10;
const REGION: usize = RUNS * RUN;

/// Mutual TLS for 127.0.0.1 with a fresh CA (the same certificate on both ends).
fn tls() -> ClusterTls {
    TestCa::new().issue().cluster()
}

async fn agents(token: Option<&str>, tls: Option<ClusterTls>, tasks: &Tasks) -> (Agent, Agent) {
    let mk = || async {
        let inbox_cfg = InboxConfig { token: token.map(String::from), ..Default::default() };
        let inbox = Arc::new(Inbox::new(inbox_cfg));
        let cfg =
            TcpConfig { token: token.map(String::from), tls: tls.clone(), ..Default::default() };
        let t = TcpTransfer::bind(
            "127.0.0.1:0".parse().unwrap_or_else(|_| unreachable!()),
            inbox.clone(),
            cfg,
            tasks,
        )
        .await
        .expect("bind");
        Agent::new(Arc::new(t), inbox)
    };
    (mk().await, mk().await)
}

/// One region of `len` bytes in runs of at most `RUN`, written and verified; returns bytes.
async fn one(tx: &Agent, rx: &Agent, data: &[Bytes], len: usize) -> usize {
    let room = Room::mint();
    let s = SenderId::new(0, 0);
    let ranges: Vec<std::ops::Range<u64>> = std::iter::once(0..len as u64).collect();
    let id = rx.inbox().register_region(room, len as u64, [(s, ranges)]).expect("register");
    let pairs: Vec<(Bytes, u64)> = data
        .iter()
        .scan(0u64, |at, b| {
            let off = *at;
            *at += b.len() as u64;
            Some((b.clone(), off))
        })
        .collect();
    let w = WriteRequest::new(id, pairs, room, s, 1, 1, 0);
    tx.post_write(&rx.addr(), w).await.expect("write");
    let got = rx
        .inbox()
        .wait(id, tokio::time::Instant::now() + Duration::from_secs(30))
        .await
        .expect("verified");
    got.buf.len()
}

/// Aggregate GB/s of `n` concurrent transfers, `rounds` times each.
async fn handoff_rate(tx: &Agent, rx: &Agent, n: usize, rounds: usize, data: &[Bytes]) -> f64 {
    let started = Instant::now();
    let mut total = 0;
    for _ in 0..rounds {
        let all = (0..n).map(|_| one(tx, rx, data, REGION));
        total += futures::future::join_all(all).await.into_iter().sum::<usize>();
    }
    total as f64 / started.elapsed().as_secs_f64() / 1e9
}

/// The same bytes over `n` plain sockets at once: the ceiling.
async fn socket_rate(n: usize, rounds: usize, data: &[Bytes]) -> f64 {
    let l = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = l.local_addr().expect("addr");
    let per = rounds * REGION;
    let readers = tokio::spawn(async move {
        let mut all = Vec::new();
        for _ in 0..n {
            let (mut s, _) = l.accept().await.expect("accept");
            all.push(tokio::spawn(async move {
                let mut buf = vec![0u8; 256 << 10];
                let mut got = 0;
                while got < per {
                    let k = s.read(&mut buf).await.expect("read");
                    if k == 0 {
                        break;
                    }
                    got += k;
                }
                let _ = s.write_all(b"k").await;
            }));
        }
        for r in all {
            r.await.expect("reader");
        }
    });
    let started = Instant::now();
    let writers = (0..n).map(|_| async {
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.set_nodelay(true).expect("nodelay");
        for _ in 0..rounds {
            for b in data {
                s.write_all(b).await.expect("write");
            }
        }
        let mut ack = [0u8; 1];
        let _ = s.read(&mut ack).await;
    });
    futures::future::join_all(writers).await;
    let secs = started.elapsed().as_secs_f64();
    readers.await.expect("readers");
    (n * per) as f64 / secs / 1e9
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut rounds = 3usize;
    parse_flags(|flag, val| {
        match flag {
            "--rounds" => rounds = val.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
        Ok(())
    })?;
    let data: Vec<Bytes> = (0..RUNS).map(|i| Bytes::from(vec![(i * 7 + 1) as u8; RUN])).collect();
    let tasks = Tasks::new();
    let (open_tx, open_rx) = agents(None, None, &tasks).await;
    let (tok_tx, tok_rx) = agents(Some("bench-token"), None, &tasks).await;
    let (tls_tx, tls_rx) = agents(Some("bench-token"), Some(tls()), &tasks).await;
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "12 MB regions ({RUNS} runs of {} KiB), {rounds} rounds per shape, best of 3, loopback",
        RUN >> 10
    )?;
    writeln!(
        out,
        "| concurrent | plain sockets GB/s | handoff GB/s | with token GB/s | token + mTLS GB/s | handoff / sockets |"
    )?;
    writeln!(out, "|---:|---:|---:|---:|---:|---:|")?;
    for n in [1usize, 4, 16] {
        // Each variant three times, interleaved; the best of each (the machine is shared).
        let (mut ceiling, mut open, mut tok, mut tls) = (0f64, 0f64, 0f64, 0f64);
        for _ in 0..3 {
            ceiling = ceiling.max(socket_rate(n, rounds, &data).await);
            open = open.max(handoff_rate(&open_tx, &open_rx, n, rounds, &data).await);
            tok = tok.max(handoff_rate(&tok_tx, &tok_rx, n, rounds, &data).await);
            tls = tls.max(handoff_rate(&tls_tx, &tls_rx, n, rounds, &data).await);
        }
        let ratio = open / ceiling;
        writeln!(out, "| {n} | {ceiling:.2} | {open:.2} | {tok:.2} | {tls:.2} | {ratio:.2} |")?;
    }
    // Per request: a 64 KiB region, one run, end to end.
    let small = vec![Bytes::from(vec![3u8; 64 << 10])];
    for (label, tx, rx) in [
        ("no token", &open_tx, &open_rx),
        ("token", &tok_tx, &tok_rx),
        ("token + mTLS", &tls_tx, &tls_rx),
    ] {
        let mut took = Vec::new();
        for _ in 0..2000 {
            let t = Instant::now();
            one(tx, rx, &small, 64 << 10).await;
            took.push(t.elapsed().as_secs_f64() * 1e6);
        }
        took.sort_by(f64::total_cmp);
        writeln!(
            out,
            "64 KiB transfer, {label}: p50 {:.0} us, p99 {:.0} us",
            took[took.len() / 2],
            took[took.len() * 99 / 100]
        )?;
    }
    drop(out);
    tasks.shutdown().await;
    Ok(())
}
