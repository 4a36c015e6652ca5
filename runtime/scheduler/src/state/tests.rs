use handoff_core::{BlockHash, block_hashes};
use handoff_discovery::{Heartbeat, KvEvent, KvEventKind, KvSnapshot, Role, Topology};

use super::*;
use crate::SchedulerError;

pub(super) fn inst(id: &str, dp: u32) -> Instance {
    Instance {
        bootstrap_addr: format!("{id}:1"),
        grpc_addr: format!("{id}:2"),
        topology: Topology { dp, tp: 1, pp: 1, cp: 1 },
        ..Instance::fixture(id.parse().unwrap(), Role::Prefill)
    }
}

fn stored(id: &str, dp_rank: u32, seq: u64, blocks: Vec<BlockHash>) -> KvEvent {
    KvEvent {
        instance: id.parse().unwrap(),
        dp_rank,
        seq,
        incarnation: 0,
        kind: KvEventKind::Stored { parent: None, blocks },
    }
}

#[test]
fn kv_aware_goes_where_the_prefix_is_cached() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 2), inst("b", 2)]));
    let prompt: Vec<u32> = (0..256).collect();
    let h = block_hashes(&prompt, 16);
    s.apply_event(stored("b", 1, 1, h[..12].to_vec()));
    for _ in 0..5 {
        let sel = s.select(&Ask::new(&h, 256)).unwrap();
        assert_eq!((sel.instance.id.as_str(), sel.dp_rank, sel.cached_blocks), ("b", 1, 12));
        s.report(sel.booking, Outcome::Success);
    }
}

#[test]
fn load_spreads_requests_without_a_cached_prefix() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    // Unrelated prompts: nothing cached or pending draws them anywhere.
    let h = |i: u32| block_hashes(&(64 * i..64 * (i + 1)).collect::<Vec<_>>(), 16);
    let picks: Vec<String> =
        (0..4).map(|i| s.select(&Ask::new(&h(i), 64)).unwrap().instance.id.to_string()).collect();
    assert_eq!(picks.iter().filter(|p| *p == "a").count(), 2, "{picks:?}");
}

#[test]
fn exclusion_removal_and_bad_requests() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let a: InstanceId = "a".parse().unwrap();
    for _ in 0..4 {
        assert_eq!(
            s.select(&Ask {
                policy: Some(PolicyKind::RoundRobin),
                exclude: std::slice::from_ref(&a),
                ..Ask::new(&[], 10)
            })
            .unwrap()
            .instance
            .id
            .as_str(),
            "b"
        );
    }
    s.apply_update(Update::Remove("b".parse().unwrap()));
    assert!(matches!(
        s.select(&Ask { exclude: &[a], ..Ask::new(&[], 10) }),
        Err(SchedulerError::NoInstance(_))
    ));
    assert!(matches!(s.select(&Ask::new(&[], 0)), Err(SchedulerError::Invalid(_))));
    let too_many = vec![BlockHash(1); (1 << 16) + 1];
    assert!(matches!(s.select(&Ask::new(&too_many, 10)), Err(SchedulerError::Invalid(_))));
}

#[test]
fn instances_speaking_a_protocol_the_caller_cannot_drive_are_not_chosen() {
    use crate::{Protocol, Protocols};
    let s = SchedulerState::new(SchedulerConfig::default());
    let engine = |id: &str, kind: &str, boot: &str| Instance {
        engine: Some(Box::new(handoff_discovery::EngineEndpoints {
            kind: kind.into(),
            ..Default::default()
        })),
        bootstrap_addr: boot.into(),
        ..inst(id, 1)
    };
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    assert!(s.add_engine(engine("v", "vllm", "")));
    assert!(s.add_engine(engine("g", "sglang", "g:8998")));
    let frontend: Protocols = Protocols::from_names(&["handoff".into(), "sglang".into()]).unwrap();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..12 {
        let ask =
            Ask { policy: Some(PolicyKind::RoundRobin), protocols: frontend, ..Ask::new(&[], 10) };
        let sel = s.select(&ask).unwrap();
        seen.insert((sel.instance.id.to_string(), Protocol::of(&sel.instance).name()));
    }
    let want = [("a".to_owned(), "handoff"), ("g".to_owned(), "sglang")];
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), want, "never the vLLM engine");
    let only = Ask { protocols: Protocol::Engine.into(), ..Ask::new(&[], 10) };
    assert_eq!(s.select(&only).unwrap().instance.id.as_str(), "v");
    s.remove_engine(&"v".parse().unwrap());
    assert!(matches!(s.select(&only), Err(SchedulerError::NoInstance(_))));
}

#[test]
fn removed_or_restarted_instances_lose_their_index() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1)]));
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    s.apply_event(stored("a", 0, 1, h.clone()));
    assert_eq!(s.instances()[0].cached_blocks, 4);
    let mut again = inst("a", 1);
    again.version = 2;
    s.apply_update(Update::Add(again));
    assert_eq!(s.instances()[0].cached_blocks, 0);
    s.apply_event(stored("a", 5, 1, h.clone()));
    assert_eq!(s.instances()[0].cached_blocks, 0, "dp rank out of range ignored");
    s.apply_event(stored("a", 0, 2, h.clone()));
    assert_eq!(s.instances()[0].cached_blocks, 4, "the next event is in sequence, not a gap");
    s.apply_event(stored("zz", 0, 1, h));
    assert_eq!(s.instances().len(), 1, "events from unknown instances ignored");
}

/// A registration of no dp ranks or of more than a scheduler takes is ignored (billions of
/// slots made under the lock, before); a reset listing an instance's same version with a new
/// topology starts it over as an update would (before, its slots stayed the old ones and the
/// new ranks' events were refused).
#[test]
fn registrations_out_of_bounds_are_ignored_and_a_reset_may_change_the_topology() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Add(inst("huge", 4_000_000_000)));
    s.apply_update(Update::Add(inst("none", 0)));
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("huge", MAX_PREFILL_DP + 1)]));
    let known: Vec<String> = s.instances().iter().map(|i| i.instance.id.to_string()).collect();
    assert_eq!(known, ["a"]);
    s.apply_update(Update::Reset(vec![inst("a", 2)]));
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    s.apply_event(stored("a", 1, 1, h));
    assert_eq!(s.instances()[0].cached_blocks, 4, "dp rank 1 is known");
}

/// Books a request on `on`, the other instances excluded.
pub(super) fn book(s: &SchedulerState, on: &str, others: &[InstanceId]) -> Selection {
    let sel = s
        .select(&Ask { policy: Some(PolicyKind::RoundRobin), exclude: others, ..Ask::new(&[], 10) })
        .unwrap();
    assert_eq!(sel.instance.id.as_str(), on);
    sel
}

/// Sweeps `s` as the scheduler does, every 250 ms (a twelfth of the default 3 s timeout:
/// a longer gap is this process stopped), after `from_ms` from `t0` up to `to_ms`; the
/// instances they took out.
pub(super) fn sweeps_from(
    s: &SchedulerState,
    t0: Instant,
    from_ms: u64,
    to_ms: u64,
) -> Vec<InstanceId> {
    let (mut ms, mut swept) = (from_ms, Vec::new());
    while ms < to_ms {
        ms = (ms + 250).min(to_ms);
        swept.extend(s.sweep_at(t0 + std::time::Duration::from_millis(ms)));
    }
    swept
}

#[test]
fn silence_from_everyone_is_the_bus_not_the_fleet() {
    use std::time::{Duration, Instant};
    let cfg =
        SchedulerConfig { liveness_timeout: Duration::from_secs(3), ..SchedulerConfig::default() };
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let hb = |id: &str| Heartbeat::fixture(id.parse().unwrap());
    let t0 = Instant::now();
    let at = |ms: u64| t0 + Duration::from_millis(ms);
    for id in ["a", "b"] {
        assert!(s.heartbeat_at(&hb(id), at(0)), "first heartbeat asks for a snapshot");
        s.apply_snapshot(KvSnapshot {
            instance: id.parse().unwrap(),
            seq: 0,
            incarnation: 0,
            dp_blocks: vec![vec![]],
            dp_parents: vec![],
            snapshot: 0,
            page: 0,
            pages: 1,
        });
    }
    // a dies; b keeps beating every second.
    for sec in 1..=4 {
        s.heartbeat_at(&hb("b"), at(sec * 1000));
        let swept = s.sweep_at(at(sec * 1000 + 100));
        if sec < 3 {
            assert!(swept.is_empty(), "a is not stale yet at {sec} s");
        } else if sec == 3 {
            assert_eq!(swept, vec!["a".parse::<InstanceId>().unwrap()], "a out after 3 s");
        }
    }
    // The bus stops: last beats were a second apart, then nothing from anyone.
    assert!(s.heartbeat_at(&hb("a"), at(5000)), "a resumes: resync asked");
    s.apply_snapshot(KvSnapshot {
        instance: "a".parse().unwrap(),
        seq: 0,
        incarnation: 0,
        dp_blocks: vec![vec![]],
        dp_parents: vec![],
        snapshot: 0,
        page: 0,
        pages: 1,
    });
    s.heartbeat_at(&hb("b"), at(5900));
    let sweeps = |from: u64, to: u64| sweeps_from(&s, t0, from, to);
    for (from, to) in [(4100, 8100), (8100, 12_000), (12_000, 30_000)] {
        assert!(sweeps(from, to).is_empty(), "nobody swept while everyone is quiet ({to} ms)");
    }
    assert_eq!(s.instances().iter().filter(|i| i.routable).count(), 2, "both still routed");
    // Beats resume, b's first: a (whose connection to the bus may come back seconds later)
    // has a full timeout from then; it died meanwhile, so it is swept after that.
    assert!(sweeps(30_000, 31_000).is_empty());
    s.heartbeat_at(&hb("b"), at(31_000));
    assert!(sweeps(31_000, 32_000).is_empty());
    s.heartbeat_at(&hb("b"), at(32_000));
    assert!(sweeps(32_000, 32_100).is_empty(), "a swept before its beats could resume");
    assert!(sweeps(32_100, 33_000).is_empty());
    s.heartbeat_at(&hb("b"), at(33_000));
    assert!(sweeps(33_000, 34_000).is_empty());
    s.heartbeat_at(&hb("b"), at(34_000));
    assert_eq!(sweeps(34_000, 34_100), vec!["a".parse::<InstanceId>().unwrap()]);
    assert!(s.heartbeat_at(&hb("a"), at(34_200)), "a back: routed again after a resync");
}

#[test]
fn queued_load_is_the_uncached_work_and_reports_take_it_off() {
    let mut cfg = SchedulerConfig::default();
    cfg.params.kv_aware.load = 1.0;
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    // Prompts sharing 12 blocks, each with 4 of its own.
    let prompt = |i: u32| {
        let tokens: Vec<u32> = (0..192).chain((0..64).map(|t| 1000 * (i + 1) + t)).collect();
        block_hashes(&tokens, 16)
    };
    s.apply_event(stored("a", 0, 1, prompt(0)[..12].to_vec()));
    // Each request queues 64 uncached tokens on a, not 256: a stays cheaper than cold b
    // (256 to compute) until its queue reaches 192.
    let picks: Vec<_> = (1..4).map(|i| s.select(&Ask::new(&prompt(i), 256)).unwrap()).collect();
    assert!(picks.iter().all(|p| p.instance.id.as_str() == "a" && p.cached_blocks == 12));
    let full = s.select(&Ask::new(&prompt(4), 256)).unwrap();
    assert_eq!(full.instance.id.as_str(), "b", "a is full");
    for p in &picks {
        s.report(p.booking, Outcome::Success);
    }
    assert_eq!(s.select(&Ask::new(&prompt(5), 256)).unwrap().instance.id.as_str(), "a", "drained");
}

#[test]
fn a_routed_prefix_draws_the_next_request_until_reported() {
    let mut cfg = SchedulerConfig::default();
    cfg.params.kv_aware.load = 0.5;
    let s = SchedulerState::new(cfg);
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    let first = s.select(&Ask::new(&h, 256)).unwrap();
    assert_eq!(first.cached_blocks, 0);
    // Nothing is stored yet, but the prompt is on its way to `first`: the same prefix is
    // cheaper there (behind it) than computed cold on the idle instance.
    let second = s.select(&Ask::new(&h, 256)).unwrap();
    assert_eq!((second.instance.id.clone(), second.cached_blocks), (first.instance.id.clone(), 16));
    for sel in [&first, &second] {
        s.report(sel.booking, Outcome::Success);
    }
    assert_eq!(s.lock().pending.blocks(), 0, "reported prompts are no longer pending");
    // A departed instance takes its pending prompts along.
    let third = s.select(&Ask::new(&h, 256)).unwrap();
    assert_eq!(third.cached_blocks, 0, "nothing pending draws it any more");
    assert_eq!(s.lock().pending.blocks(), 16);
    s.apply_update(Update::Remove(third.instance.id));
    assert_eq!(s.lock().pending.blocks(), 0);
}

#[test]
fn a_snapshot_with_parents_rebuilds_the_index() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    let parents = (0..h.len()).map(|i| i.checked_sub(1).map(|p| h[p])).collect();
    s.apply_snapshot(KvSnapshot {
        instance: "b".parse().unwrap(),
        seq: 3,
        incarnation: 0,
        dp_blocks: vec![h.clone()],
        dp_parents: vec![parents],
        snapshot: 0,
        page: 0,
        pages: 1,
    });
    let sel = s.select(&Ask::new(&h, 256)).unwrap();
    assert_eq!((sel.instance.id.as_str(), sel.cached_blocks), ("b", 16));
    // A snapshot without parents (an older sender) indexes the same blocks.
    s.apply_snapshot(KvSnapshot {
        instance: "a".parse().unwrap(),
        seq: 1,
        incarnation: 0,
        dp_blocks: vec![h[..8].to_vec()],
        dp_parents: vec![],
        snapshot: 0,
        page: 0,
        pages: 1,
    });
    assert_eq!(s.indexed_blocks(&"a".parse().unwrap(), 0).len(), 8);
}

#[test]
fn engine_instances_survive_resets_take_their_own_ops_and_go_silent_like_others() {
    use handoff_kv_events::IndexOp;
    let s = SchedulerState::new(SchedulerConfig::default());
    let t0 = Instant::now();
    s.add_engine_at(inst("vllm-a", 2), t0);
    s.apply_update(Update::Reset(vec![inst("p", 1)]));
    assert!(s.is_engine(&"vllm-a".parse().unwrap()));
    let prompt: Vec<u32> = (0..128).collect();
    let h = block_hashes(&prompt, 16);
    let id: InstanceId = "vllm-a".parse().unwrap();
    let mut epoch = 0;
    let stored =
        |blocks: &[BlockHash]| vec![IndexOp::Store { parent: None, blocks: blocks.to_vec() }];
    assert!(s.apply_engine_ops(&id, 1, &mut epoch, stored(&h[..6])));
    let sel = s.select(&Ask::new(&h, 128)).unwrap();
    assert_eq!((sel.instance.id.as_str(), sel.dp_rank, sel.cached_blocks), ("vllm-a", 1, 6));
    s.report(sel.booking, Outcome::Success);
    // A heartbeat never comes: silent past the liveness timeout (someone else is heard).
    let later = t0 + s.config().liveness_timeout * 2;
    let hb = Heartbeat::fixture("p".parse().unwrap());
    s.heartbeat_at(&hb, later);
    assert_eq!(s.sweep_at(later), vec![id.clone()]);
    assert!(s.indexed_blocks(&id, 1).is_empty(), "its entries go with it");
    // Heard again (an event or its health probe): back, and never asked for a snapshot.
    s.engine_heard_at(&id, later);
    assert!(s.instances().iter().any(|i| i.instance.id == id && i.routable));
    // Its stream learns its entries went: nothing applied this once, the block map restarts.
    assert!(!s.apply_engine_ops(&id, 0, &mut epoch, stored(&h[..2])));
    assert!(s.indexed_blocks(&id, 0).is_empty());
    assert!(s.apply_engine_ops(&id, 0, &mut epoch, stored(&h[..2])));
    assert_eq!(s.indexed_blocks(&id, 0), h[..2].to_vec());
}

/// A clear and the stores after it in one batch (an adapter's block map overflowed): the
/// clear is finished a step per hold of the lock, not at once by the next store.
#[test]
fn an_engine_batch_that_clears_then_stores_finishes_the_clear_in_steps() {
    use handoff_kv_events::IndexOp;
    let s = SchedulerState::new(SchedulerConfig::default());
    s.add_engine_at(inst("sglang-a", 1), Instant::now());
    let id: InstanceId = "sglang-a".parse().unwrap();
    let h = block_hashes(&(0..4096).collect::<Vec<u32>>(), 16);
    let mut epoch = 0;
    let ops = vec![
        IndexOp::Store { parent: None, blocks: h[..128].to_vec() },
        IndexOp::Clear,
        IndexOp::Store { parent: None, blocks: h[..4].to_vec() },
        IndexOp::Remove { blocks: h[3..4].to_vec() },
    ];
    assert!(s.apply_engine_ops(&id, 0, &mut epoch, ops));
    assert_eq!(s.indexed_blocks(&id, 0), h[..3].to_vec());
    assert_eq!(s.lock().index.forced_clears(), 0);
}

#[test]
fn engine_and_prefill_ids_never_take_each_others_place() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Add(inst("p", 1)));
    assert!(!s.add_engine(inst("p", 2)), "a prefill's id is taken");
    assert!(!s.is_engine(&"p".parse().unwrap()));
    assert!(s.add_engine(inst("e", 2)));
    assert!(!s.add_engine(inst("e", 1)), "so is another engine's");
    // The prefill watch cannot replace or drop the engine, nor the engine watch the prefill.
    s.apply_update(Update::Add(inst("e", 1)));
    s.apply_update(Update::Remove("e".parse().unwrap()));
    s.apply_update(Update::Reset(vec![inst("p", 1), inst("e", 1)]));
    let all = s.instances();
    let e = all.iter().find(|i| i.instance.id.as_str() == "e").expect("the engine stays");
    assert_eq!(e.instance.topology.dp, 2, "as the engine registered it");
    assert!(s.is_engine(&"e".parse().unwrap()));
    s.remove_engine(&"p".parse().unwrap());
    assert!(s.instances().iter().any(|i| i.instance.id.as_str() == "p"), "not an engine: kept");
    s.remove_engine(&"e".parse().unwrap());
    assert!(!s.instances().iter().any(|i| i.instance.id.as_str() == "e"));
}

/// An instance whose KV measurably takes long after its compute (a slow link, as its
/// heartbeats say) is not chosen while an equal one is free.
#[test]
fn a_slow_link_heard_in_heartbeats_moves_requests_away() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let beat = |id: &str, send_ns: u64| Heartbeat {
        prefill_ns_per_token: 1_000,
        send_ns_per_token: send_ns,
        ..Heartbeat::fixture(id.parse().unwrap())
    };
    // Who six selections of a `tokens`-token prompt go to, each reported at once.
    let picks = |tokens: u32| -> std::collections::BTreeSet<String> {
        (0..6)
            .map(|_| {
                let sel = s.select(&Ask::new(&[], tokens)).unwrap();
                s.report(sel.booking, Outcome::Success);
                sel.instance.id.to_string()
            })
            .collect()
    };
    let b_only = std::collections::BTreeSet::from(["b".to_owned()]);
    s.heartbeat(&beat("a", 80_000)); // 80 us per token after the compute: 80 tokens' worth each
    s.heartbeat(&beat("b", 500));
    assert_eq!(picks(1000), b_only);
    // A 20-token prompt: a's KV takes 1.6 ms, b's 10 us. Within the noise: both take turns.
    assert_eq!(picks(20).len(), 2, "a difference under the noise is not charged");
    // 30 tokens: 2.4 ms, past b's 15 us and the noise: b only.
    assert_eq!(picks(30), b_only);
    // Both links slow, a's 1.8x b's: 9 ms against 5 ms for 1000 tokens, past b's plus the
    // noise allowance but within twice b's, which is noise too.
    s.heartbeat(&beat("a", 9_000));
    s.heartbeat(&beat("b", 5_000));
    assert_eq!(picks(1000).len(), 2, "within twice the best is not charged");
    s.heartbeat(&beat("a", 700)); // the link recovered
    s.heartbeat(&beat("b", 500));
    assert_eq!(picks(1000).len(), 2, "both chosen again");
}

/// A scheduler that did not run for longer than the liveness timeout (a paused VM) counts
/// liveness from when it runs again: its engines are not silenced at once on resume, only
/// if they stay silent a whole timeout after it.
#[test]
fn a_scheduler_stopped_past_the_timeout_silences_no_engine_on_resume() {
    let s = SchedulerState::new(SchedulerConfig::default());
    let t0 = Instant::now();
    let timeout = s.config().liveness_timeout;
    let id: InstanceId = "vllm-a".parse().unwrap();
    s.add_engine_at(inst("vllm-a", 1), t0);
    let every = timeout / 12;
    for i in 0..6 {
        assert!(s.sweep_at(t0 + every * i).is_empty());
    }
    let resumed = t0 + every * 5 + timeout * 4;
    assert!(s.sweep_at(resumed).is_empty(), "silenced on resume");
    assert!(s.instances().iter().any(|i| i.instance.id == id && i.routable));
    let mut at = resumed;
    while at < resumed + timeout {
        at += every;
        assert!(s.sweep_at(at).is_empty(), "silenced before a whole timeout from the resume");
    }
    at += every;
    assert_eq!(s.sweep_at(at), vec![id], "silent a whole timeout after it");
}
