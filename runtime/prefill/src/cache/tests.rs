use handoff_core::block_hashes;
use handoff_engine::{KvShape, MockEngine};

use super::*;

const SHAPE: KvShape = KvShape { layers: 2, kv_heads: 2, head_bytes: 8 };

fn kv(tokens: &[u32]) -> Kv {
    MockEngine::compute_kv(SHAPE, tokens, 0)
}

#[test]
fn lookup_returns_the_longest_cached_prefix_but_leaves_a_token() {
    let mut c = PrefixCache::new(1 << 20, 4);
    let p: Vec<u32> = (0..16).collect();
    let h = block_hashes(&p, 4);
    let d = c.store(&h, &kv(&p));
    assert_eq!(d.stored.len(), 4);
    assert_eq!(d.parent, None, "the run starts the prompt");
    let longer: Vec<u32> = (0..20).collect();
    let hl = block_hashes(&longer, 4);
    let d = c.store(&hl, &kv(&longer));
    assert_eq!((d.parent, d.stored), (Some(h[3]), vec![hl[4]]), "the run hangs under its prefix");
    // A snapshot lists each page after its parent.
    let chain: Vec<_> = (0..5usize).map(|i| (i.checked_sub(1).map(|p| hl[p]), hl[i])).collect();
    assert_eq!(c.blocks(), chain);
    let hit = c.lookup(&h, 16).unwrap();
    assert_eq!(hit.tokens(), 12, "one token must be left to compute");
    assert_eq!(hit, kv(&p).slice_tokens(0..12));
    let other: Vec<u32> = (0..4).chain(100..112).collect();
    assert_eq!(c.lookup(&block_hashes(&other, 4), 16).unwrap().tokens(), 4);
}

#[test]
fn budget_evicts_least_recently_used_pages() {
    let page = SHAPE.token_bytes() * 4;
    let mut c = PrefixCache::new(page * 3, 4);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    let ha = block_hashes(&a, 4);
    c.store(&ha, &kv(&a));
    c.lookup(&ha, 9);
    let d = c.store(&block_hashes(&b, 4), &kv(&b));
    assert_eq!(d.stored.len(), 2);
    assert_eq!(d.removed, vec![ha[1]], "a's tail goes, its head (a shared prefix) stays");
    assert_eq!(c.lookup(&ha, 9).map(|k| k.tokens()), Some(4), "a's first page still serves");
    assert!(c.used_bytes() <= page * 3);
    assert_eq!(c.len(), 3);
}
