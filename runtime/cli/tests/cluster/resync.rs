//! A resync through a stock nats-server (1 MiB payloads) of an instance holding 200k
//! blocks, while its KV events keep flowing: the scheduler's view ends equal to the
//! instance's. The instance is a fake (its caches are a set of block hashes) answering
//! with the real paged [`Snapshots`]; the real prefill's side is the e2e resync test.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use handoff_core::{BlockHash, InstanceId, Tasks};
use handoff_discovery::events::{kv_subject, liveness_subject, snapshot_subject};
use handoff_discovery::snapshot::Taken;
use handoff_discovery::{
    EventBus, Heartbeat, KvEvent, KvEventKind, MemoryRegistry, NatsBus, Registry, SnapshotAsk,
    Snapshots,
};
use handoff_scheduler::{Scheduler, SchedulerConfig};

use super::discovery::inst;
use super::servers::Server;

/// The fake instance's caches: blocks and the last event number.
#[derive(Default)]
struct FakeCaches {
    blocks: Vec<BlockHash>,
    seq: u64,
}

const BLOCKS: u64 = 200_000;

#[tokio::test]
async fn a_200k_block_instance_resyncs_through_stock_nats_while_events_flow() {
    let nats = Server::nats();
    let tasks = Tasks::new();
    let id: InstanceId = "big".parse().unwrap();
    let registry = Arc::new(MemoryRegistry::new());
    registry.register(inst("big")).await.unwrap();
    let bus: Arc<dyn EventBus> = Arc::new(NatsBus::connect(&nats.url).await.unwrap());
    let scheduler =
        Scheduler::start(SchedulerConfig::default(), registry.clone(), bus.clone(), &tasks)
            .await
            .unwrap();
    let caches = Arc::new(Mutex::new(FakeCaches {
        blocks: (0..BLOCKS).map(|b| BlockHash(b * 7 + 1)).collect(),
        seq: 1000,
    }));

    // Snapshot pages, served as the prefill serves them.
    let mut asks = bus.subscribe(&snapshot_subject(&id)).await.unwrap();
    let (b, c, snapshots) = (bus.clone(), caches.clone(), Snapshots::new(id.clone()));
    let pages_served = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (served, t) = (pages_served.clone(), tasks.clone());
    tasks.spawn(async move {
        loop {
            let m = tokio::select! {
                _ = t.shutdown_requested() => break,
                m = asks.next() => match m { Some(m) => m, None => break },
            };
            let ask: SnapshotAsk = serde_json::from_slice(&m.payload).unwrap_or_default();
            let page = {
                let c = c.lock().unwrap();
                let take = || Taken {
                    seq: c.seq,
                    incarnation: 0,
                    dp_blocks: vec![c.blocks.clone()],
                    dp_parents: vec![vec![None; c.blocks.len()]],
                };
                snapshots.page(ask, c.seq, take)
            };
            let body = page.map(|p| serde_json::to_vec(&p).unwrap()).unwrap_or_default();
            assert!(body.len() < 1 << 20, "a page of {} bytes", body.len());
            served.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            b.publish(m.reply.unwrap(), body.into()).await.unwrap();
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;

    // A heartbeat makes the scheduler resync; events go on meanwhile, and after.
    let beat = Heartbeat {
        dp_queued_tokens: Vec::new(),
        instance: id.clone(),
        queued_tokens: 0,
        running: 0,
        kv_bytes: 0,
        prefill_ns_per_token: 0,
        send_ns_per_token: 0,
    };
    let beat = serde_json::to_vec(&beat).unwrap();
    let state = scheduler.state().clone();
    let started = Instant::now();
    let mut next = BLOCKS * 7 + 1;
    let mut synced_at = None;
    for round in 0..20_000 {
        if round % 200 == 0 {
            bus.publish(liveness_subject(&id), beat.clone().into()).await.unwrap();
        }
        let ev = {
            let mut c = caches.lock().unwrap();
            c.seq += 1;
            let kind = if round % 5 == 4 {
                let at = round * 13 % c.blocks.len();
                let gone = c.blocks.swap_remove(at);
                KvEventKind::Removed { blocks: vec![gone] }
            } else {
                next += 7;
                c.blocks.push(BlockHash(next));
                KvEventKind::Stored { parent: None, blocks: vec![BlockHash(next)] }
            };
            KvEvent { instance: id.clone(), dp_rank: 0, seq: c.seq, incarnation: 0, kind }
        };
        bus.publish(kv_subject(&id), serde_json::to_vec(&ev).unwrap().into()).await.unwrap();
        tokio::time::sleep(Duration::from_micros(500)).await;
        let held = state.indexed_blocks(&id, 0).len();
        if synced_at.is_none() && held as u64 >= BLOCKS {
            synced_at = Some(started.elapsed());
        }
        if synced_at.is_some_and(|t| started.elapsed() > t + Duration::from_millis(500)) {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "no resync after 60 s ({held} blocks)"
        );
    }
    let want: BTreeSet<BlockHash> = caches.lock().unwrap().blocks.iter().copied().collect();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let view: BTreeSet<BlockHash> = state.indexed_blocks(&id, 0).into_iter().collect();
        if view == want {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "scheduler holds {} blocks, the instance {} ({} missing, {} extra)",
            view.len(),
            want.len(),
            want.difference(&view).count(),
            view.difference(&want).count()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pages = pages_served.load(std::sync::atomic::Ordering::Relaxed);
    // One snapshot, no second resync: the events that came during it were replayed.
    let one = (BLOCKS as usize).div_ceil(handoff_discovery::snapshot::PAGE_BLOCKS);
    assert!((one..=one + 1).contains(&pages), "{pages} pages served, one snapshot is {one}");
    eprintln!("resynced {BLOCKS} blocks in {:?} over {pages} pages", synced_at.unwrap());
    tasks.shutdown().await;
}
