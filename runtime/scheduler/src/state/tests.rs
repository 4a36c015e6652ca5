use handoff_core::block_hashes;
use handoff_discovery::{Role, Topology};

use super::*;

fn inst(id: &str, dp: u32) -> Instance {
    Instance {
        id: id.parse().unwrap(),
        role: Role::Prefill,
        model: "mock".into(),
        bootstrap_addr: format!("{id}:1"),
        grpc_addr: format!("{id}:2"),
        topology: Topology { dp, tp: 1, pp: 1, cp: 1 },
        page_size: 16,
        version: 1,
    }
}

fn stored(id: &str, dp_rank: u32, seq: u64, blocks: Vec<BlockHash>) -> KvEvent {
    KvEvent { instance: id.parse().unwrap(), dp_rank, seq, kind: KvEventKind::Stored { blocks } }
}

#[test]
fn kv_aware_goes_where_the_prefix_is_cached() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 2), inst("b", 2)]));
    let prompt: Vec<u32> = (0..256).collect();
    let h = block_hashes(&prompt, 16);
    s.apply_event(stored("b", 1, 1, h[..12].to_vec()));
    for _ in 0..5 {
        let sel = s.select(&h, 256, None, &[]).unwrap();
        assert_eq!((sel.instance.id.as_str(), sel.dp_rank, sel.cached_blocks), ("b", 1, 12));
        s.report(&sel.instance.id, sel.dp_rank, 256);
    }
}

#[test]
fn load_spreads_requests_without_a_cached_prefix() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    let picks: Vec<String> =
        (0..4).map(|_| s.select(&h, 64, None, &[]).unwrap().instance.id.to_string()).collect();
    assert_eq!(picks.iter().filter(|p| *p == "a").count(), 2, "{picks:?}");
}

#[test]
fn exclusion_removal_and_bad_requests() {
    let s = SchedulerState::new(SchedulerConfig::default());
    s.apply_update(Update::Reset(vec![inst("a", 1), inst("b", 1)]));
    let a: InstanceId = "a".parse().unwrap();
    for _ in 0..4 {
        assert_eq!(
            s.select(&[], 10, Some(PolicyKind::RoundRobin), std::slice::from_ref(&a))
                .unwrap()
                .instance
                .id
                .as_str(),
            "b"
        );
    }
    s.apply_update(Update::Remove("b".parse().unwrap()));
    assert!(matches!(s.select(&[], 10, None, &[a]), Err(SchedulerError::NoInstance(_))));
    assert!(matches!(s.select(&[], 0, None, &[]), Err(SchedulerError::Invalid(_))));
    let too_many = vec![BlockHash(1); (1 << 16) + 1];
    assert!(matches!(s.select(&too_many, 10, None, &[]), Err(SchedulerError::Invalid(_))));
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
    s.apply_event(stored("zz", 0, 1, h));
    assert_eq!(s.instances().len(), 1, "events from unknown instances ignored");
}
