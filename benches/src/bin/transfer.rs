//! The transfer backends on loopback: aggregate receive throughput with 1, 4 and 16
//! concurrent 12 MB transfers (each region written by one sender in 64 runs of 192 KiB, as
//! layers x K/V of a small model): tcp with no credential, with a cluster token, and with
//! token and mutual TLS, its same-host shared-memory path, and mooncake; against the ceilings
//! of the same bytes over plain sockets (write, read, discard: no framing, no copy into a
//! region, no verification) and copied with memcpy into a warm buffer (for shm), and
//! the Mooncake wheel writing the same batches to itself, in the same run; and nixl (NIXL's
//! library, UCX over TCP). Then the per-request cost of a small transfer (64 KiB): register,
//! handshake, write, notice, verify, take. First, the CPU two idle nixl agents cost (their
//! progress threads), against the process idle without them.
//!
//! ```text
//! eval "$(scripts/fetch-nixl --env)"
//! cargo run --release -p handoff-benches --bin transfer
//! cargo run --release -p handoff-benches --bin transfer -- --rounds 5
//! cargo run --release -p handoff-benches --bin transfer -- --nixl-only 200   # to profile
//! cargo run --release -p handoff-benches --bin transfer -- --tcp-only 200   # or --shm-only, --mooncake-only
//! ```

use std::io::Write;
use std::time::{Duration, Instant};

use bytes::Bytes;
use handoff_benches::parse_flags;
use handoff_benches::path::process_cpu;
use handoff_core::tls::ClusterTls;
use handoff_core::tls::test_certs::TestCa;
use handoff_core::{Room, Tasks};
use handoff_transfer::{Agent, ConnectRequest, InboxConfig, SenderId, TransferKind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const RUNS: usize = 64;
const RUN: usize = 192 << 10;
const REGION: usize = RUNS * RUN;

/// Mutual TLS for 127.0.0.1 with a fresh CA (the same certificate on both ends).
fn tls() -> ClusterTls {
    TestCa::new().issue().cluster()
}

async fn agents(kind: &TransferKind, token: Option<&str>, tasks: &Tasks) -> (Agent, Agent) {
    let mk = || async {
        let inbox_cfg = InboxConfig { token: token.map(String::from), ..Default::default() };
        kind.start(inbox_cfg, tasks, None).await.expect("agent starts")
    };
    (mk().await, mk().await)
}

/// The tcp backend on loopback; with `shared_memory`, its same-host path.
fn tcp(tls: Option<ClusterTls>, shared_memory: bool) -> TransferKind {
    let bind_ip = std::net::Ipv4Addr::LOCALHOST.into();
    TransferKind::Tcp { bind_ip, advertise_ip: None, tls, shared_memory }
}

/// One region of `len` bytes in runs of at most `RUN`: the receiver's handshake, the write
/// and its verification, as the request path does them (a prefill rank's streamed write,
/// here posted in one part); returns bytes.
async fn one(tx: &Agent, rx: &Agent, data: &[Bytes], len: usize, token: Option<&str>) -> usize {
    let room = Room::mint();
    let s = SenderId::new(0, 0);
    let ranges: Vec<std::ops::Range<u64>> = std::iter::once(0..len as u64).collect();
    let id = rx.inbox().register_region(room, len as u64, [(s, ranges)]).expect("register");
    let req = ConnectRequest {
        room,
        receiver: rx.addr(),
        region: id,
        region_len: len as u64,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 1,
        token: token.map(String::from),
    };
    rx.connect(&tx.addr(), req).await.expect("handshake");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    tx.inbox().accept(room, 1, deadline).await.expect("handshake arrives");
    let pairs: Vec<(Bytes, u64)> = data
        .iter()
        .scan(0u64, |at, b| {
            let off = *at;
            *at += b.len() as u64;
            Some((b.clone(), off))
        })
        .collect();
    let mut w = tx.open_write(&rx.addr(), id, s).await.expect("a write opens");
    w.post(pairs).await.expect("write");
    w.finish(room, 1, 1, 0).await.expect("notice");
    let got = rx.inbox().wait(id, deadline).await.expect("verified");
    got.buf.len()
}

/// Aggregate GB/s of `n` concurrent transfers, `rounds` times each.
async fn handoff_rate(p: &Pair, n: usize, rounds: usize, data: &[Bytes]) -> f64 {
    let started = Instant::now();
    let mut total = 0;
    for _ in 0..rounds {
        let all = (0..n).map(|_| one(&p.tx, &p.rx, data, REGION, p.token));
        total += futures::future::join_all(all).await.into_iter().sum::<usize>();
    }
    total as f64 / started.elapsed().as_secs_f64() / 1e9
}

/// The same bytes copied by `n` threads at once (at most one per core), each into a buffer
/// of its own it reuses: the ceiling of a same-host transfer, which must also land in
/// memory. Warm destinations, written once before the clock starts, so no page faults and
/// no allocation are timed: the ceiling is not lowered by ours, nor moved by the memory the
/// rows before it left behind.
fn memcpy_rate(n: usize, rounds: usize, data: &[Bytes]) -> f64 {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let threads = n.min(cores);
    let per_thread = (n * rounds).div_ceil(threads);
    let mut dsts: Vec<Vec<u8>> = (0..threads).map(|_| vec![1u8; REGION]).collect();
    let started = Instant::now();
    std::thread::scope(|s| {
        for dst in &mut dsts {
            s.spawn(move || {
                for _ in 0..per_thread {
                    let mut at = 0;
                    for b in data {
                        dst[at..at + b.len()].copy_from_slice(b);
                        at += b.len();
                    }
                    std::hint::black_box(&dst);
                }
            });
        }
    });
    (threads * per_thread * REGION) as f64 / started.elapsed().as_secs_f64() / 1e9
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

/// Two agents of one kind, and the token their handshakes carry.
struct Pair {
    label: &'static str,
    tx: Agent,
    rx: Agent,
    token: Option<&'static str>,
}

/// The Mooncake wheel writing 12 MB batches to itself (`benches/peers/mooncake_rate.py`, run
/// with `HANDOFF_PEERS_PYTHON`, which `scripts/fetch-peers` prints).
fn wheel_rate(rounds: usize) -> anyhow::Result<f64> {
    let python = std::env::var("HANDOFF_PEERS_PYTHON").map_err(|_| {
        anyhow::anyhow!(
            "set HANDOFF_PEERS_PYTHON=\"$(scripts/fetch-peers)\" to measure the Mooncake wheel"
        )
    })?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/peers/mooncake_rate.py");
    let out = std::process::Command::new(python).arg(script).arg(rounds.to_string()).output()?;
    anyhow::ensure!(out.status.success(), "the wheel's bench failed");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    v["gbps"].as_f64().ok_or_else(|| anyhow::anyhow!("no gbps in the wheel's report"))
}

/// This process's CPU time (user + system) over `span` of idling, as a fraction of a core.
async fn idle_cpu(span: Duration) -> anyhow::Result<f64> {
    let before = process_cpu();
    tokio::time::sleep(span).await;
    Ok((process_cpu() - before).as_secs_f64() / span.as_secs_f64())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let mut rounds = 3usize;
    let (mut nixl_only, mut tcp_only, mut shm_only) = (0usize, 0usize, 0usize);
    let mut mooncake_only = 0usize;
    parse_flags(|flag, val| {
        match flag {
            "--rounds" => rounds = val.parse()?,
            // For profiling: only this many sequential nixl (tcp, shm, mooncake) transfers, and
            // their rate.
            "--nixl-only" => nixl_only = val.parse()?,
            "--tcp-only" => tcp_only = val.parse()?,
            "--shm-only" => shm_only = val.parse()?,
            "--mooncake-only" => mooncake_only = val.parse()?,
            other => anyhow::bail!("unknown flag {other}"),
        }
        Ok(())
    })?;
    let data: Vec<Bytes> = (0..RUNS).map(|i| Bytes::from(vec![(i * 7 + 1) as u8; RUN])).collect();
    let tasks = Tasks::new();
    let token = Some("bench-token");
    let mooncake = TransferKind::Mooncake {
        bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        advertise_ip: None,
    };
    let nixl =
        TransferKind::Nixl { bind_ip: std::net::Ipv4Addr::LOCALHOST.into(), advertise_ip: None };
    let only = [
        (nixl_only, &nixl, "nixl"),
        (tcp_only, &tcp(None, false), "tcp"),
        (shm_only, &tcp(None, true), "shm"),
        (mooncake_only, &mooncake, "mooncake"),
    ];
    for (only, kind, label) in only {
        if only == 0 {
            continue;
        }
        let (tx, rx) = agents(kind, token, &tasks).await;
        let p = Pair { label, tx, rx, token };
        let rate = handoff_rate(&p, 1, only, &data).await;
        eprintln!("{label}: {only} transfers one at a time, {rate:.2} GB/s");
        tasks.shutdown().await;
        return Ok(());
    }
    let mut pairs = Vec::new();
    for (label, kind, token) in [
        ("tcp", tcp(None, false), None),
        ("tcp + token", tcp(None, false), token),
        ("tcp + token + mTLS", tcp(Some(tls()), false), token),
        ("shm + token", tcp(None, true), token),
        ("mooncake + token", mooncake, token),
    ] {
        let (tx, rx) = agents(&kind, token, &tasks).await;
        pairs.push(Pair { label, tx, rx, token });
    }
    // Idle CPU: the process as it is, then with two nixl agents more.
    let idle = Duration::from_secs(3);
    let without = idle_cpu(idle).await?;
    let (tx, rx) = agents(&nixl, token, &tasks).await;
    let with = idle_cpu(idle).await?;
    pairs.push(Pair { label: "nixl + token", tx, rx, token });
    let wheel = wheel_rate(rounds)?;
    let mut out = handoff_benches::record::Report::new("transfer");
    writeln!(
        out,
        "idle over {idle:?}: process without nixl agents {:.1} % of a core, with two {:.1} % ({:.2} % per agent)\n",
        100.0 * without,
        100.0 * with,
        50.0 * (with - without)
    )?;
    writeln!(
        out,
        "12 MB regions ({RUNS} runs of {} KiB), {rounds} rounds per shape, best of 3, loopback",
        RUN >> 10
    )?;
    let labels: Vec<&str> = pairs.iter().map(|p| p.label).collect();
    writeln!(
        out,
        "| concurrent | plain sockets | memcpy | {} | Mooncake wheel to itself | tcp / sockets | shm / memcpy | mooncake / sockets | nixl / sockets |",
        labels.join(" | ")
    )?;
    writeln!(out, "|---:|---:|---:|{}---:|---:|---:|---:|---:|", "---:|".repeat(labels.len()))?;
    for n in [1usize, 4, 16] {
        // Each variant three times, interleaved; the best of each (the machine is shared).
        let (mut ceiling, mut memcpy) = (0f64, 0f64);
        let mut rates = vec![0f64; pairs.len()];
        for _ in 0..3 {
            ceiling = ceiling.max(socket_rate(n, rounds, &data).await);
            memcpy = memcpy.max(memcpy_rate(n, rounds, &data));
            for (i, p) in pairs.iter().enumerate() {
                rates[i] = rates[i].max(handoff_rate(p, n, rounds, &data).await);
            }
        }
        let cells: Vec<String> = rates.iter().map(|r| format!("{r:.2}")).collect();
        // The wheel's batch call is one transfer: measured for one at a time only.
        let wheel_cell = if n == 1 { format!("{wheel:.2}") } else { "-".into() };
        writeln!(
            out,
            "| {n} | {ceiling:.2} | {memcpy:.2} | {} | {wheel_cell} | {:.2} | {:.2} | {:.2} | {:.2} |",
            cells.join(" | "),
            rates[0] / ceiling,
            rates[3] / memcpy,
            rates[4] / ceiling,
            rates[5] / ceiling
        )?;
    }
    writeln!(out, "(GB/s; every transfer includes the receiver's handshake and the verification)")?;
    // Per request: a 64 KiB region, one run, end to end.
    let small = vec![Bytes::from(vec![3u8; 64 << 10])];
    for p in &pairs {
        let label = p.label;
        let mut took = Vec::new();
        for _ in 0..2000 {
            let t = Instant::now();
            one(&p.tx, &p.rx, &small, 64 << 10, p.token).await;
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
    tasks.shutdown().await;
    out.finish()?;
    Ok(())
}
