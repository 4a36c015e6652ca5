//! Engine KV events into the index: batches published on real ZMQ sockets (Rust PUBs
//! speaking vLLM 0.33's frames), followed by `EngineStream`s, mapped by `WorkerChains` and
//! stored in a scheduler's index through `apply_engine_ops`, as `handoff scheduler --engine`
//! does. Prints events and blocks ingested per second with 1 and 8 publishers, selection
//! latency over engine fleets of 8, 128 and 1024 workers, and the time to recover a gap by
//! replay and by clear-and-rebuild.
//!
//! ```text
//! cargo run --release -p handoff-benches --bin engine_events
//! ```

use std::io::Write;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use handoff_core::{Tasks, block_hashes};
use handoff_discovery::{Instance, Role, Topology};
use handoff_kv_events::{EngineEndpoint, EngineStream, IndexOp};
use handoff_scheduler::{Ask, Outcome, SchedulerConfig, SchedulerState};
use rmpv::Value;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

const PAGE: usize = 16;
/// Tokens per published event: 4 blocks of 16.
const EVENT_TOKENS: usize = 64;

fn engine(id: &str) -> Instance {
    Instance {
        id: id.parse().unwrap_or_else(|_| unreachable!()),
        role: Role::Prefill,
        model: "bench".into(),
        bootstrap_addr: String::new(),
        grpc_addr: format!("{id}:8000"),
        topology: Topology { dp: 1, tp: 1, pp: 1, cp: 1 },
        page_size: PAGE as u32,
        version: 1,
        engine: None,
    }
}

/// A batch of one BlockStored of `tokens` (blocks of 16, fresh prompt).
fn stored(first_hash: u64, tokens: &[u32]) -> Bytes {
    let hashes = (0..tokens.len() / PAGE).map(|i| Value::from(first_hash + i as u64)).collect();
    let ev = Value::Map(vec![
        ("type".into(), "BlockStored".into()),
        ("block_hashes".into(), Value::Array(hashes)),
        ("parent_block_hash".into(), Value::Nil),
        ("token_ids".into(), Value::Array(tokens.iter().map(|&t| t.into()).collect())),
        ("block_size".into(), (PAGE as u64).into()),
        ("lora_id".into(), Value::Nil),
        ("medium".into(), "GPU".into()),
        ("lora_name".into(), Value::Nil),
    ]);
    let batch = Value::Array(vec![1.0.into(), Value::Array(vec![ev]), 0.into()]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap_or_else(|_| unreachable!());
    out.into()
}

fn frame(seq: u64, payload: &Bytes) -> ZmqMessage {
    let f = vec![Bytes::from("kv"), Bytes::copy_from_slice(&seq.to_be_bytes()), payload.clone()];
    ZmqMessage::try_from(f).unwrap_or_else(|_| unreachable!())
}

fn tokens(publisher: u64, i: u64) -> Vec<u32> {
    (0..EVENT_TOKENS as u32).map(|t| (publisher as u32) << 24 | (i as u32 * 64 + t)).collect()
}

/// `publishers` engines each publishing `events` batches; returns (seconds, blocks indexed).
async fn ingest(publishers: u64, events: u64) -> anyhow::Result<(f64, usize)> {
    let state = Arc::new(SchedulerState::new(SchedulerConfig::default()));
    let tasks = Tasks::new();
    let applied = Arc::new(AtomicU64::new(0));
    let mut pubs = Vec::new();
    for p in 0..publishers {
        let id = format!("engine-{p}");
        state.add_engine(engine(&id));
        let mut publisher = PubSocket::new();
        let ep = publisher.bind("tcp://127.0.0.1:0").await?.to_string();
        let stream = EngineStream::new(
            EngineEndpoint { events: ep, replay: None, topic: String::new() },
            PAGE,
            1 << 22,
        );
        let (s, a, t) = (state.clone(), applied.clone(), tasks.clone());
        let iid = id.parse()?;
        tasks.spawn(async move {
            let mut epoch = 0;
            let sink = |ops: Vec<IndexOp>| {
                a.fetch_add(1, Ordering::Relaxed);
                s.apply_engine_ops(&iid, 0, &mut epoch, ops)
            };
            stream.run(sink, t.shutdown_requested()).await
        });
        pubs.push(publisher);
    }
    // Joined: a first batch each until it lands.
    for (p, publisher) in pubs.iter_mut().enumerate() {
        let warm = stored(1, &tokens(p as u64, 1_000_000));
        while applied.load(Ordering::Relaxed) < p as u64 + 1 {
            publisher.send(frame(0, &warm)).await?;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let payloads: Vec<Vec<Bytes>> = (0..publishers)
        .map(|p| (0..events).map(|i| stored(10 + i * 8, &tokens(p, i))).collect())
        .collect();
    let base = applied.load(Ordering::Relaxed);
    let started = Instant::now();
    let sends = pubs.iter_mut().zip(&payloads).map(|(publisher, ps)| async move {
        for (i, p) in ps.iter().enumerate() {
            publisher.send(frame(i as u64 + 1, p)).await?;
        }
        Ok::<(), zeromq::ZmqError>(())
    });
    for r in futures::future::join_all(sends).await {
        r?;
    }
    let want = base + publishers * events;
    while applied.load(Ordering::Relaxed) < want && started.elapsed() < Duration::from_secs(60) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let secs = started.elapsed().as_secs_f64();
    let got = applied.load(Ordering::Relaxed) - base;
    anyhow::ensure!(
        got == publishers * events,
        "only {got} of {} batches arrived",
        publishers * events
    );
    let blocks = state.instances().iter().map(|i| i.cached_blocks as usize).sum();
    tasks.shutdown().await;
    Ok((secs, blocks))
}

/// Selection latency over `workers` engines each holding 64 prompts.
fn select_latency(workers: usize) -> (f64, f64) {
    let state = SchedulerState::new(SchedulerConfig::default());
    for w in 0..workers {
        let id = format!("engine-{w}");
        state.add_engine(engine(&id));
        let iid = id.parse().unwrap_or_else(|_| unreachable!());
        for i in 0..64u64 {
            let h = block_hashes(&tokens(w as u64, i), PAGE);
            state.apply_engine_ops(
                &iid,
                0,
                &mut 0,
                vec![IndexOp::Store { parent: None, blocks: h }],
            );
        }
    }
    let mut took = Vec::new();
    for q in 0..5000u64 {
        let h = block_hashes(&tokens(q % workers as u64, q % 64), PAGE);
        let t = Instant::now();
        let sel = state.select(&Ask::new(&h, EVENT_TOKENS as u32));
        took.push(t.elapsed().as_secs_f64() * 1e6);
        if let Ok(sel) = sel {
            state.report(sel.booking, Outcome::Success);
        }
    }
    took.sort_by(f64::total_cmp);
    (took[took.len() / 2], took[took.len() * 99 / 100])
}

/// Time from a gap to a recovered index: by replay (the buffer holds the gap), or by
/// clearing and rebuilding (it does not).
async fn recovery(covered: bool) -> anyhow::Result<f64> {
    let mut publisher = PubSocket::new();
    let events = publisher.bind("tcp://127.0.0.1:0").await?.to_string();
    let mut router = RouterSocket::new();
    let replay = router.bind("tcp://127.0.0.1:0").await?.to_string();
    let buffer: Vec<(u64, Bytes)> =
        (0..100u64).map(|i| (i, stored(10 + i * 8, &tokens(0, i)))).collect();
    let from = if covered { 0 } else { 50 };
    let served: Vec<(u64, Bytes)> = buffer[from..].to_vec();
    let server = tokio::spawn(async move {
        while let Ok(m) = router.recv().await {
            let f = m.into_vec();
            let start = u64::from_be_bytes(f[2].as_ref().try_into().unwrap_or([0; 8]));
            for (seq, p) in served.iter().filter(|(s, _)| *s >= start) {
                let r = vec![
                    f[0].clone(),
                    Bytes::new(),
                    Bytes::from("kv"),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    p.clone(),
                ];
                let _ =
                    router.send(ZmqMessage::try_from(r).unwrap_or_else(|_| unreachable!())).await;
            }
            let end = vec![
                f[0].clone(),
                Bytes::new(),
                Bytes::copy_from_slice(&u64::MAX.to_be_bytes()),
                Bytes::new(),
            ];
            let _ = router.send(ZmqMessage::try_from(end).unwrap_or_else(|_| unreachable!())).await;
        }
    });
    let ops = Arc::new(AtomicU64::new(0));
    let stream = EngineStream::new(
        EngineEndpoint { events, replay: Some(replay), topic: String::new() },
        PAGE,
        1 << 20,
    );
    let tasks = Tasks::new();
    let (o, t) = (ops.clone(), tasks.clone());
    tasks.spawn(async move {
        stream
            .run(
                move |batch: Vec<IndexOp>| {
                    o.fetch_add(batch.len() as u64, Ordering::Relaxed);
                    true
                },
                t.shutdown_requested(),
            )
            .await
    });
    // Seq 0 live until joined, then seq 100: a gap of 1..=99.
    while ops.load(Ordering::Relaxed) == 0 {
        publisher.send(frame(0, &buffer[0].1)).await?;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = ops.load(Ordering::Relaxed);
    let started = Instant::now();
    publisher.send(frame(100, &stored(9999, &tokens(1, 0)))).await?;
    let want = before + if covered { 100 } else { 52 };
    while ops.load(Ordering::Relaxed) < want && started.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let took = started.elapsed().as_secs_f64() * 1e3;
    tasks.shutdown().await;
    server.abort();
    Ok(took)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let mut out = handoff_benches::record::Report::new("engine_events");
    writeln!(
        out,
        "engine KV events (batches of 1 BlockStored, 4 blocks of 16 tokens) into the index"
    )?;
    for publishers in [1u64, 8] {
        let events = 20_000 / publishers;
        let (secs, blocks) = ingest(publishers, events).await?;
        let n = (publishers * events) as f64;
        writeln!(
            out,
            "  {publishers} publisher(s): {:.0} events/s, {:.0} blocks/s ({blocks} blocks indexed)",
            n / secs,
            4.0 * n / secs
        )?;
    }
    for workers in [8usize, 128, 1024] {
        let (p50, p99) = select_latency(workers);
        writeln!(
            out,
            "  selection over {workers} engine workers: p50 {p50:.1} us, p99 {p99:.1} us"
        )?;
    }
    writeln!(out, "  gap of 99 batches recovered by replay: {:.1} ms", recovery(true).await?)?;
    writeln!(
        out,
        "  gap the replay no longer covers, cleared and rebuilt: {:.1} ms",
        recovery(false).await?
    )?;
    out.finish()?;
    Ok(())
}
