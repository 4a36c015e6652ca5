use handoff_core::block_hashes;

use super::*;

fn cands(n: usize) -> Vec<Candidate> {
    let mut index = handoff_kv_index::KvIndex::default();
    let mut slot = |i: usize| {
        let instance = format!("p{i}").parse().unwrap();
        index.register(&handoff_kv_index::WorkerKey { instance, dp_rank: 0 })
    };
    (0..n)
        .map(|i| Candidate {
            slot: slot(i),
            ring: xxhash_rust::xxh3::xxh3_64(format!("p{i}#0").as_bytes()),
            overlap_blocks: 0,
            queued_tokens: 0,
            in_flight: 0,
            send_tokens: 0,
        })
        .collect()
}

fn req<'a>(c: &'a [Candidate], hashes: &'a [BlockHash], tick: usize) -> Request<'a> {
    Request { candidates: c, prompt_tokens: 256, page_size: 16, hashes, tick }
}

#[test]
fn every_policy_picks_a_candidate_and_none_from_nothing() {
    let c = cands(5);
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    for p in [
        PolicyKind::KvAware,
        PolicyKind::RoundRobin,
        PolicyKind::Random,
        PolicyKind::PowerOfTwo,
        PolicyKind::PrefixHash,
    ] {
        for t in 0..20 {
            assert!(p.pick(&req(&c, &h, t), &PolicyParams::default()).unwrap() < 5);
        }
        assert_eq!(p.pick(&req(&[], &h, 0), &PolicyParams::default()), None);
    }
}

#[test]
fn power_of_two_never_picks_the_most_loaded_of_two() {
    let mut c = cands(2);
    c[0].queued_tokens = 10_000;
    for _ in 0..50 {
        assert_eq!(
            PolicyKind::PowerOfTwo.pick(&req(&c, &[], 0), &PolicyParams::default()),
            Some(1)
        );
    }
}

#[test]
fn prefix_hash_is_sticky_per_prefix_and_sheds_overload() {
    let mut c = cands(8);
    let a = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    let first = PolicyKind::PrefixHash.pick(&req(&c, &a, 0), &PolicyParams::default()).unwrap();
    for t in 1..10 {
        assert_eq!(
            PolicyKind::PrefixHash.pick(&req(&c, &a, t), &PolicyParams::default()),
            Some(first)
        );
    }
    c[first].queued_tokens = 100_000;
    assert_ne!(PolicyKind::PrefixHash.pick(&req(&c, &a, 0), &PolicyParams::default()), Some(first));
}

#[test]
fn kv_aware_with_temperature_still_prefers_the_cached_candidate() {
    let mut c = cands(4);
    c[2].overlap_blocks = 15;
    let params = PolicyParams {
        kv_aware: KvAwareWeights { temperature: 0.1, ..Default::default() },
        ..Default::default()
    };
    let hits = (0..200)
        .filter(|&t| PolicyKind::KvAware.pick(&req(&c, &[], t), &params) == Some(2))
        .count();
    assert!(hits > 180, "{hits}/200");
}

#[test]
fn kv_aware_prices_a_slow_link_like_a_longer_prompt() {
    let mut c = cands(2);
    let h = block_hashes(&(0..256).collect::<Vec<_>>(), 16);
    // Equal but for the link: the one whose KV takes 300 tokens' worth after the compute loses,
    c[0].send_tokens = 300;
    for t in 0..4 {
        assert_eq!(PolicyKind::KvAware.pick(&req(&c, &h, t), &PolicyParams::default()), Some(1));
    }
    // until the other's queue (at half weight) costs more than the slow link.
    c[1].queued_tokens = 700;
    assert_eq!(PolicyKind::KvAware.pick(&req(&c, &h, 0), &PolicyParams::default()), Some(0));
}
