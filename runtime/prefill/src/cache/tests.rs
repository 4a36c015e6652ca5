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
    let d = c.store(&p, &h, kv(&p));
    assert_eq!(d.stored.len(), 4);
    assert_eq!(d.parent, None, "the run starts the prompt");
    let longer: Vec<u32> = (0..20).collect();
    let hl = block_hashes(&longer, 4);
    let d = c.store(&longer, &hl, kv(&longer));
    assert_eq!((d.parent, d.stored), (Some(h[3]), vec![hl[4]]), "the run hangs under its prefix");
    // A snapshot lists each page after its parent.
    let chain: Vec<_> = (0..5usize).map(|i| (i.checked_sub(1).map(|p| hl[p]), hl[i])).collect();
    assert_eq!(c.blocks(), chain);
    let hit = c.lookup(&p, &h).unwrap();
    assert_eq!(hit.tokens(), 12, "one token must be left to compute");
    assert_eq!(hit, kv(&p).slice_tokens(0..12));
    let other: Vec<u32> = (0..4).chain(100..112).collect();
    assert_eq!(c.lookup(&other, &block_hashes(&other, 4)).unwrap().tokens(), 4);
}

#[test]
fn budget_evicts_least_recently_used_pages() {
    let page = SHAPE.token_bytes() * 4;
    let mut c = PrefixCache::new(page * 3, 4);
    let a: Vec<u32> = (0..8).collect();
    let b: Vec<u32> = (50..58).collect();
    let ha = block_hashes(&a, 4);
    c.store(&a, &ha, kv(&a));
    let a_on: Vec<u32> = (0..9).collect();
    c.lookup(&a_on, &ha);
    let d = c.store(&b, &block_hashes(&b, 4), kv(&b));
    assert_eq!(d.stored.len(), 2);
    assert_eq!(d.removed, vec![ha[1]], "a's tail goes, its head (a shared prefix) stays");
    assert_eq!(c.lookup(&a_on, &ha).map(|k| k.tokens()), Some(4), "a's first page still serves");
    assert!(c.used_bytes() <= page * 3);
    assert_eq!(c.len(), 3);
}

const PAGE: usize = 4;

fn page_bytes() -> usize {
    SHAPE.token_bytes() * PAGE
}

#[test]
fn a_prompt_is_kept_as_it_came_not_copied() {
    let mut c = PrefixCache::new(1 << 20, PAGE);
    let p: Vec<u32> = (0..18).collect();
    let (h, whole) = (block_hashes(&p, PAGE), kv(&p));
    let at = whole.layer(0).as_ptr();
    c.store(&p, &h, whole);
    let kept: Vec<&Source> = c.sources.values().collect();
    assert_eq!(kept.len(), 1);
    assert_eq!(kept[0].kv.layer(0).as_ptr(), at, "the very buffer the prompt came in");
    assert_eq!(c.used_bytes(), SHAPE.token_bytes() * 18, "counted whole, its partial page too");
    check_books(&c);
    assert_eq!(c.lookup(&p, &h).unwrap(), kv(&p).slice_tokens(0..16));
}

#[test]
fn a_prompt_mostly_cached_has_only_its_new_pages_copied() {
    let mut c = PrefixCache::new(1 << 20, PAGE);
    let p: Vec<u32> = (0..16).collect();
    c.store(&p, &block_hashes(&p, PAGE), kv(&p));
    let before = c.used_bytes();
    let longer: Vec<u32> = (0..22).collect();
    let hl = block_hashes(&longer, PAGE);
    let d = c.store(&longer, &hl, kv(&longer));
    assert_eq!(d.stored, vec![hl[4]]);
    assert_eq!(c.used_bytes() - before, page_bytes(), "one new page of five: a copy of it");
    check_books(&c);
    assert_eq!(c.lookup(&longer, &hl).unwrap(), kv(&longer).slice_tokens(0..20));
}

#[test]
fn a_buffer_eviction_leaves_half_full_keeps_only_its_survivors() {
    let mut c = PrefixCache::new(page_bytes() * 8, PAGE);
    let x: Vec<u32> = (0..16).collect();
    let hx = block_hashes(&x, PAGE);
    c.store(&x, &hx, kv(&x));
    // y shares x's first page; its other three are views of y's own KV, at pages 1-3.
    let y: Vec<u32> = (0..4).chain(100..112).collect();
    let hy = block_hashes(&y, PAGE);
    assert_eq!(c.store(&y, &hy, kv(&y)).stored, hy[1..].to_vec());
    c.lookup(&[&x[..], &[0]].concat(), &hx);
    let z: Vec<u32> = (200..208).collect();
    let d = c.store(&z, &block_hashes(&z, PAGE), kv(&z));
    assert_eq!(d.removed, vec![hy[3]], "y's tail, the least recently used page");
    // y's two survivors were half its buffer: they moved into one of their own.
    assert_eq!(c.used_bytes(), page_bytes() * (4 + 2 + 2));
    let y_kept = &c.sources[&c.pages[&hy[1]].source];
    assert_eq!(y_kept.kv.tokens(), 2 * PAGE);
    check_books(&c);
    assert_eq!(c.lookup(&y, &hy).unwrap(), kv(&y).slice_tokens(0..12), "x's page, then y's two");
}

/// What must hold after every call: the budget counts each buffer whole and is kept, no
/// buffer holds more than twice its live pages, and every page is where its buffer says.
fn check_books(c: &PrefixCache) {
    let mut whole = 0;
    for (id, s) in &c.sources {
        let live: Vec<&BlockHash> = s.slots.iter().flatten().collect();
        assert_eq!(live.len(), s.live);
        assert!(s.live > 0, "an empty buffer is dropped");
        assert!(2 * s.live * s.page_bytes > s.kv.byte_len(), "half full or less: copied");
        for (at, h) in s.slots.iter().enumerate().filter_map(|(i, h)| Some((i, h.as_ref()?))) {
            assert_eq!((c.pages[h].source, c.pages[h].at), (*id, at));
        }
        whole += s.kv.byte_len();
    }
    assert_eq!(c.used_bytes(), whole);
    assert!(c.used_bytes() <= c.budget);
    for (h, p) in &c.pages {
        assert_eq!(c.lru.get(&p.tick), Some(h), "each page under its own tick");
    }
    assert_eq!(c.pages.len(), c.sources.values().map(|s| s.live).sum::<usize>());
    assert_eq!(c.lru.len(), c.pages.len());
}

#[test]
fn over_many_prompts_the_books_balance_and_every_hit_is_the_prompts_own_kv() {
    let mut seed = 0x9e37_79b9_7f4a_7c15_u64;
    let mut next = |n: u64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % n
    };
    let systems: Vec<Vec<u32>> = (0..3).map(|s| (0..16).map(|t| s * 1000 + t).collect()).collect();
    for budget_pages in [3, 7, 20] {
        let mut c = PrefixCache::new(page_bytes() * budget_pages, PAGE);
        let (mut hits, mut evicted) = (0, 0);
        for _ in 0..300 {
            let system = &systems[next(3) as usize];
            let mut p: Vec<u32> = system[..next(17) as usize].to_vec();
            let tail = 1 + next(20) as usize;
            p.extend((0..tail).map(|_| 5000 + next(4) as u32));
            let mut h = block_hashes(&p, PAGE);
            if next(4) == 0 {
                h.truncate(h.len() / 2); // fewer hashes than the KV's full pages
            }
            if let Some(hit) = c.lookup(&p, &h) {
                assert_eq!(hit, kv(&p).slice_tokens(0..hit.tokens()));
                hits += 1;
            }
            evicted += c.store(&p, &h, kv(&p)).removed.len();
            check_books(&c);
        }
        assert!(hits > 50 && evicted > 50, "budget {budget_pages}: {hits} hits, {evicted} out");
    }
}

#[test]
fn a_page_larger_than_the_budget_is_not_stored() {
    let mut c = PrefixCache::new(page_bytes() - 1, PAGE);
    let p: Vec<u32> = (0..8).collect();
    assert_eq!(c.store(&p, &block_hashes(&p, PAGE), kv(&p)), CacheDelta::default());
    assert_eq!((c.len(), c.used_bytes()), (0, 0));
}

#[test]
fn a_prompt_larger_than_the_budget_keeps_its_head() {
    let mut c = PrefixCache::new(page_bytes() * 3, PAGE);
    let p: Vec<u32> = (0..32).collect();
    let h = block_hashes(&p, PAGE);
    let d = c.store(&p, &h, kv(&p));
    assert_eq!((d.stored, d.removed), (h[..3].to_vec(), vec![]), "its tail: stored, evicted");
    assert_eq!(c.used_bytes(), page_bytes() * 3);
    assert_eq!(c.lookup(&p, &h).unwrap(), kv(&p).slice_tokens(0..12));
    check_books(&c);
}

#[test]
fn a_store_that_cuts_a_buffer_at_its_half_frees_that_half_and_copies_the_rest() {
    let mut c = PrefixCache::new(page_bytes() * 8, PAGE);
    let x: Vec<u32> = (0..32).collect();
    let hx = block_hashes(&x, PAGE);
    c.store(&x, &hx, kv(&x));
    let y: Vec<u32> = (100..104).collect();
    let d = c.store(&y, &block_hashes(&y, PAGE), kv(&y));
    // One page was needed; nothing is freed until half of x's buffer is evicted. Its head is
    // next to go, but more than an eighth of the budget: copied, not taken.
    assert_eq!(d.removed, vec![hx[7], hx[6], hx[5], hx[4]]);
    assert_eq!(c.used_bytes(), page_bytes() * 5);
    assert_eq!(c.sources[&c.pages[&hx[0]].source].kv.tokens(), 4 * PAGE, "x's head, copied");
    assert_eq!(c.lookup(&x, &hx).unwrap(), kv(&x).slice_tokens(0..16));
    check_books(&c);
}

#[test]
fn a_distinct_prompt_whose_head_is_next_to_go_and_few_goes_whole() {
    let mut c = PrefixCache::new(page_bytes() * 20, PAGE);
    let prompts: Vec<Vec<u32>> = (0..5).map(|p| (p * 100..p * 100 + 16).collect()).collect();
    for p in &prompts {
        c.store(p, &block_hashes(p, PAGE), kv(p));
    }
    let first = block_hashes(&prompts[0], PAGE);
    let f: Vec<u32> = (900..912).collect();
    let d = c.store(&f, &block_hashes(&f, PAGE), kv(&f));
    // Three pages were needed: the first prompt's tail halves it, and its last page, the
    // next to go and under an eighth of the budget, goes too rather than be copied.
    assert_eq!(d.removed, vec![first[3], first[2], first[1], first[0]]);
    assert_eq!(c.used_bytes(), page_bytes() * 19);
    assert!(c.sources.values().all(|s| s.live * PAGE == s.kv.tokens()), "nothing copied");
    check_books(&c);
}

#[test]
fn a_cut_buffer_whose_head_is_in_use_has_it_copied_not_taken() {
    let mut c = PrefixCache::new(page_bytes() * 20, PAGE);
    let prompts: Vec<Vec<u32>> = (0..5).map(|p| (p * 100..p * 100 + 16).collect()).collect();
    for p in &prompts {
        c.store(p, &block_hashes(p, PAGE), kv(p));
    }
    let first = block_hashes(&prompts[0], PAGE);
    let head_on = &prompts[0][..PAGE + 1];
    assert_eq!(c.lookup(head_on, &first).map(|k| k.tokens()), Some(PAGE), "its head, in use");
    let f: Vec<u32> = (900..912).collect();
    let d = c.store(&f, &block_hashes(&f, PAGE), kv(&f));
    assert_eq!(d.removed, vec![first[3], first[2], first[1]], "nothing past what was needed");
    assert_eq!(c.used_bytes(), page_bytes() * 20);
    assert_eq!(c.sources[&c.pages[&first[0]].source].kv.tokens(), PAGE, "its head, copied");
    check_books(&c);
}

#[test]
fn runs_join_only_neighbouring_pages_of_one_buffer() {
    let (a, b) = (kv(&[1; 16]), kv(&[2; 32]));
    // b's pages 4 and 5 would follow a's page 3 if buffers were not told apart.
    let pages = [(&a, 0), (&a, 1), (&a, 3), (&b, 4), (&b, 5), (&a, 0)];
    let got: Vec<(bool, std::ops::Range<usize>)> =
        runs(pages.into_iter(), PAGE).into_iter().map(|(k, r)| (std::ptr::eq(k, &a), r)).collect();
    assert_eq!(got, vec![(true, 0..8), (true, 12..16), (false, 16..24), (true, 0..4)]);
}

/// KV as a model's is: each token's depends on every token before it.
fn causal_kv(tokens: &[u32]) -> Kv {
    let mixed: Vec<u32> = tokens
        .iter()
        .scan(0u32, |seen, &t| {
            *seen = seen.wrapping_mul(0x9e37_79b1).wrapping_add(t);
            Some(*seen)
        })
        .collect();
    MockEngine::compute_kv(SHAPE, &mixed, 0)
}

#[test]
fn a_prompt_hashing_like_a_cached_one_is_not_served_its_kv() {
    let mut c = PrefixCache::new(1 << 20, PAGE);
    let a: Vec<u32> = (0..12).collect();
    let h = block_hashes(&a, PAGE);
    c.store(&a, &h, causal_kv(&a));
    // b shares a's first page; its hashes are forged to be a's at every page.
    let b: Vec<u32> = (0..4).chain(50..58).collect();
    assert_eq!(c.lookup(&b, &h).map(|k| k.tokens()), Some(PAGE), "only the page b shares");
    let d = c.store(&b, &h, causal_kv(&b));
    assert_eq!(d, CacheDelta::default(), "the hashes were cached and still are: nothing to tell");
    check_books(&c);
    assert_eq!(c.lookup(&b, &h).unwrap(), causal_kv(&b).slice_tokens(0..2 * PAGE));
    assert_eq!(
        c.lookup(&a, &h).unwrap(),
        causal_kv(&a).slice_tokens(0..PAGE),
        "b's took a's place"
    );
}

#[test]
fn a_page_is_served_only_after_the_page_it_was_computed_after() {
    let mut c = PrefixCache::new(1 << 20, PAGE);
    let p: Vec<u32> = (0..8).collect();
    let h = block_hashes(&p, PAGE);
    c.store(&p, &h, causal_kv(&p));
    // r's page hashes like p's first (forged) and takes its place.
    let r: Vec<u32> = (100..104).collect();
    c.store(&r, &h[..1], causal_kv(&r));
    check_books(&c);
    // q is r's page then p's second: from a collision on, the chained hashes are p's.
    let q: Vec<u32> = (100..104).chain(4..8).chain([0]).collect();
    let hit = c.lookup(&q, &h).unwrap();
    assert_eq!(hit, causal_kv(&q).slice_tokens(0..PAGE), "p's second page followed p's first");
}

#[test]
fn a_prompt_whose_hashes_repeat_is_stored_up_to_the_repeat() {
    let mut c = PrefixCache::new(1 << 20, PAGE);
    let p: Vec<u32> = (0..12).collect();
    let h = [BlockHash(1), BlockHash(2), BlockHash(1)];
    assert_eq!(c.store(&p, &h, causal_kv(&p)).stored, h[..2].to_vec());
    check_books(&c);
    assert_eq!(c.lookup(&p, &h).unwrap(), causal_kv(&p).slice_tokens(0..2 * PAGE));
}
