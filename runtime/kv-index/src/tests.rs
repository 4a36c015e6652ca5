use std::collections::{BTreeSet, HashMap, HashSet};

use handoff_core::block_hashes;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use super::*;

fn key(i: &str, dp: u32) -> WorkerKey {
    WorkerKey { instance: i.parse().unwrap(), dp_rank: dp }
}

#[test]
fn overlap_is_the_gapless_leading_run() {
    let mut idx = KvIndex::default();
    let prompt: Vec<u32> = (0..64).collect();
    let h = block_hashes(&prompt, 16);
    idx.store(&key("a", 0), None, &h[..3]);
    idx.store(&key("b", 1), None, &h[..1]);
    idx.store(&key("c", 0), None, &h[1..4]); // no first block: no overlap
    let o = idx.overlaps(&h);
    assert_eq!(o.get(&key("a", 0)), 3);
    assert_eq!(o.get(&key("b", 1)), 1);
    assert_eq!(o.get(&key("c", 0)), 0);
    assert_eq!(o.len(), 2);
    idx.remove(&key("a", 0), &h[1..2]);
    assert_eq!(idx.overlaps(&h).get(&key("a", 0)), 1);
    idx.tree.check();
}

#[test]
fn clear_and_instance_removal_forget_blocks() {
    let mut idx = KvIndex::default();
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    idx.store(&key("a", 0), None, &h);
    idx.store(&key("a", 1), None, &h);
    idx.store(&key("b", 0), None, &h);
    assert_eq!(idx.len(), 12);
    idx.clear(&key("a", 1));
    assert_eq!(idx.blocks_of(&key("a", 1)), 0);
    idx.remove_instance(&"a".parse().unwrap());
    assert_eq!(idx.len(), 4);
    assert_eq!(idx.overlaps(&h).len(), 1);
    idx.store(&key("d", 0), None, &h[..1]);
    assert_eq!(idx.overlaps(&h).get(&key("d", 0)), 1, "slot reuse is clean");
    idx.tree.check();
}

/// A prompt's first block is matched once a run with no parent began with it: one hidden
/// inside a run that is not a chain is missed (for every holder) until any worker stores
/// its prompt so; a full index still notes such a start of blocks it holds.
#[test]
fn a_prompt_start_is_known_once_a_run_with_no_parent_begins_with_it() {
    let mut idx = KvIndex::default();
    let p = block_hashes(&(0..48).collect::<Vec<_>>(), 16);
    let q = block_hashes(&(100..148).collect::<Vec<_>>(), 16);
    // Not a chain: both prompts' blocks in one run; q's start is inside it.
    idx.store(&key("a", 0), None, &[p[0], q[0], p[1], q[1], p[2], q[2]]);
    assert_eq!(idx.overlaps(&p).get(&key("a", 0)), 3);
    assert_eq!(idx.overlaps(&q).get(&key("a", 0)), 0, "a start hidden inside is missed");
    idx.store(&key("b", 0), None, &q[..1]);
    let o = idx.overlaps(&q);
    assert_eq!((o.get(&key("a", 0)), o.get(&key("b", 0))), (3, 1), "known once stored first");
    idx.tree.check();

    let mut full = KvIndex::new(3);
    full.store(&key("a", 0), Some(p[0]), &q[..3]); // q's blocks, under a wrong parent
    assert_eq!(full.overlaps(&q).len(), 0);
    full.store(&key("b", 0), None, &q); // over the budget: adds nothing, names the start
    assert_eq!(full.len(), 3);
    assert_eq!(full.overlaps(&q).get(&key("a", 0)), 3);
    full.tree.check();
}

#[test]
fn entries_are_bounded() {
    let mut idx = KvIndex::new(10);
    let h = block_hashes(&(0..1600).collect::<Vec<_>>(), 16);
    idx.store(&key("a", 0), None, &h);
    assert_eq!(idx.len(), 10);
    idx.store(&key("a", 0), None, &h); // re-storing known blocks changes nothing
    assert_eq!(idx.len(), 10);
    idx.store(&key("b", 0), None, &h);
    assert_eq!(idx.len(), 10);
    idx.tree.check();
}

/// A worker that stores a prompt and then evicts all of it but the last block leaves the
/// evicted blocks in the tree (nobody holds them, but a held child hangs below): they count
/// toward the bound too, so such rounds cannot grow the tree past it.
#[test]
fn blocks_nobody_holds_count_toward_the_bound() {
    let mut idx = KvIndex::new(100);
    for round in 0..1_000u32 {
        let tokens: Vec<u32> = (0..10 * 16).map(|t| round * 1_000 + t).collect();
        let h = block_hashes(&tokens, 16);
        idx.store(&key("a", 0), None, &h);
        idx.remove(&key("a", 0), &h[..9]);
        assert!(idx.tree.block_count() <= 100, "round {round}: {}", idx.tree.block_count());
    }
    assert!(idx.len() <= 100);
    // Once the holder leaves, the blocks above it go too, and the room comes back.
    idx.remove_instance(&"a".parse().unwrap());
    assert_eq!(idx.tree.block_count(), 0);
    let h = block_hashes(&(0..100 * 16).collect::<Vec<_>>(), 16);
    idx.store(&key("b", 0), None, &h);
    assert_eq!(idx.len(), 100);
    idx.tree.check();
}

#[test]
fn shared_prefixes_stay_compressed() {
    let mut idx = KvIndex::default();
    let base: Vec<u32> = (0..32 * 16).collect();
    for w in 0..8u32 {
        let mut tokens = base.clone();
        tokens.extend((0..32 * 16).map(|t| t + 10_000 * (w + 1)));
        // Stored the way a prefill reports: the prompt in pieces, in order.
        let h = block_hashes(&tokens, 16);
        for (i, piece) in h.chunks(5).enumerate() {
            let parent = (i > 0).then(|| h[i * 5 - 1]);
            idx.store(&key(&format!("w{w}"), 0), parent, piece);
        }
    }
    // One shared edge, one edge per worker.
    assert_eq!(idx.tree.node_count(), 9);
    // A worker evicting its tail and storing it again leaves the same shape.
    let mut tokens = base.clone();
    tokens.extend((0..32 * 16).map(|t| t + 10_000));
    let h = block_hashes(&tokens, 16);
    idx.remove(&key("w0", 0), &h[40..]);
    idx.store(&key("w0", 0), Some(h[39]), &h[40..]);
    assert_eq!(idx.tree.node_count(), 9);
    idx.tree.check();
}

/// Chained hashes of bit strings: short alphabets make sequences share prefixes often.
fn universe(rng: &mut StdRng) -> Vec<Vec<BlockHash>> {
    (0..24)
        .map(|_| {
            let len = rng.random_range(1..14);
            let bits: Vec<u32> = (0..len).map(|_| rng.random_range(0..2)).collect();
            block_hashes(&bits, 1)
        })
        .collect()
}

fn model_run(
    model: &HashMap<WorkerKey, HashSet<BlockHash>>,
    k: &WorkerKey,
    p: &[BlockHash],
) -> usize {
    model.get(k).map_or(0, |held| p.iter().take_while(|h| held.contains(h)).count())
}

/// Random stores, removes, clears and departures, checked against plain per-worker sets.
#[test]
fn matches_a_set_model_under_random_operations() {
    for seed in 0..40u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let seqs = universe(&mut rng);
        let workers: Vec<WorkerKey> =
            (0..6).map(|i| key(&format!("i{}", i / 2), (i % 2) as u32)).collect();
        let mut idx = KvIndex::default();
        if seed % 2 == 1 {
            // Workers at slots far apart (idle workers between), so holder sets span words.
            let mut idle = 0;
            for w in &workers {
                for _ in 0..rng.random_range(0..100) {
                    idx.register(&key(&format!("idle{idle}"), 0));
                    idle += 1;
                }
                idx.register(w);
            }
        }
        let mut model: HashMap<WorkerKey, HashSet<BlockHash>> = HashMap::new();
        // Workers whose clear is going on a step at a time, with what they held before.
        let mut clearing: HashMap<WorkerKey, HashSet<BlockHash>> = HashMap::new();
        let mut reused = Run::new();
        for step in 0..400 {
            let w = &workers[rng.random_range(0..workers.len())];
            let seq = &seqs[rng.random_range(0..seqs.len())];
            let a = if rng.random_bool(0.7) { 0 } else { rng.random_range(0..seq.len()) };
            let b = rng.random_range(a + 1..=seq.len());
            let op = rng.random_range(0..20);
            match op {
                0..=10 => {
                    let mut run = seq[a..b].to_vec();
                    if rng.random_bool(0.1) {
                        // Bad input: not a chain (still beginning where the prompt does).
                        run[1..].shuffle(&mut rng);
                    }
                    let parent =
                        if a > 0 && rng.random_bool(0.8) { Some(seq[a - 1]) } else { None };
                    idx.store(w, parent, &run);
                    model.entry(w.clone()).or_default().extend(run);
                }
                11..=16 => {
                    let mut run = seq[a..b].to_vec();
                    if rng.random_bool(0.5) {
                        run.reverse(); // leaf-first eviction order
                    }
                    idx.remove(w, &run);
                    if let Some(m) = model.get_mut(w) {
                        run.iter().for_each(|h| _ = m.remove(h));
                    }
                }
                17 | 18 => {
                    // At once, or a bounded step at a time while everything else goes on.
                    if rng.random_bool(0.5) {
                        idx.clear(w);
                    } else if let Some(slot) = idx.slot(w) {
                        idx.begin_clear_at(slot);
                        let held = model.get(w).into_iter().flatten().copied();
                        clearing.entry(w.clone()).or_default().extend(held);
                    }
                    model.remove(w);
                }
                _ => {
                    if rng.random_bool(0.5) {
                        idx.remove_instance(&w.instance);
                    } else {
                        idx.retire_instance(&w.instance);
                    }
                    model.retain(|k, _| k.instance != w.instance);
                }
            }
            // A store or removal finishes its slot's clear at once.
            if matches!(op, 0..=16) {
                clearing.remove(w);
            }
            for _ in 0..rng.random_range(0..3) {
                if idx.clean_some(rng.random_range(1..8)) {
                    clearing.clear();
                }
            }
            idx.tree.check();
            let total: usize = model.values().map(HashSet::len).sum();
            if idx.is_cleaning() {
                assert!(idx.len() >= total, "seed {seed} step {step}: entries");
            } else {
                assert_eq!(idx.len(), total, "seed {seed} step {step}: entries");
            }
            for k in &workers {
                let want: BTreeSet<_> = model.get(k).into_iter().flatten().copied().collect();
                let got: BTreeSet<_> = idx.blocks(k).into_iter().collect();
                match clearing.get(k) {
                    // Being cleared: what is left is what it held.
                    Some(before) => {
                        assert!(got.iter().all(|b| before.contains(b)), "seed {seed} step {step}")
                    }
                    None => assert_eq!(got, want, "seed {seed} step {step}: blocks of {k:?}"),
                }
                assert_eq!(idx.blocks_of(k), got.len());
            }
            for p in seqs.iter().take(8) {
                let o = idx.overlaps(p);
                // The same query into a run reused since the first step: what earlier queries
                // (hits, misses, on slots since retired) left in it must not show.
                idx.overlaps_into(p, &mut reused);
                for k in workers.iter().filter(|k| !clearing.contains_key(*k)) {
                    let want = model_run(&model, k, p);
                    assert_eq!(o.get(k), want, "seed {seed} step {step}: {k:?}");
                    let at = idx.slot(k).map_or(0, |s| reused.at(s) as usize);
                    assert_eq!(at, want, "seed {seed} step {step}: {k:?} in a reused run");
                }
                let held: usize = reused.held().filter(|(_, r)| *r > 0).count();
                assert_eq!(held, reused.as_slice().iter().filter(|r| **r > 0).count());
            }
        }
    }
}

/// A snapshot's way: every block alone under its parent, parents first (by depth).
#[test]
fn blocks_stored_one_by_one_under_their_parents_compress() {
    let mut idx = KvIndex::default();
    let shared: Vec<u32> = (0..8 * 16).collect();
    let prompts: Vec<Vec<BlockHash>> = (0..3u32)
        .map(|p| {
            let mut t = shared.clone();
            t.extend((0..8 * 16).map(|x| 100_000 * (p + 1) + x));
            block_hashes(&t, 16)
        })
        .collect();
    let mut all: Vec<(usize, Option<BlockHash>, BlockHash)> = prompts
        .iter()
        .flat_map(|h| h.iter().enumerate().map(|(d, b)| (d, d.checked_sub(1).map(|p| h[p]), *b)))
        .collect();
    all.sort_by_key(|(d, _, b)| (*d, *b));
    all.dedup();
    let w = key("a", 0);
    for (_, parent, b) in all {
        idx.store(&w, parent, &[b]);
    }
    // The shared 8 blocks, then one edge per prompt.
    assert_eq!(idx.tree.node_count(), 4);
    for h in &prompts {
        assert_eq!(idx.overlaps(h).get(&w), 16);
    }
    idx.tree.check();
}

/// An index of `workers` workers, each holding its own prompt of 8 blocks after a shared
/// one: `workers + 1` nodes or so.
fn fleet(workers: usize) -> (KvIndex, Vec<Vec<BlockHash>>) {
    let mut idx = KvIndex::default();
    let mut prompts = Vec::new();
    for w in 0..workers {
        let tokens: Vec<u32> =
            (0..64).chain((0..64).map(|t| 1_000 + (w as u32) * 64 + t)).collect();
        let h = block_hashes(&tokens, 8);
        idx.store(&key(&format!("w{w}"), 0), None, &h);
        prompts.push(h);
    }
    (idx, prompts)
}

/// Steps of `budget` nodes until every clear begun is done.
fn steps_to_clean(idx: &mut KvIndex, budget: usize) -> usize {
    let mut steps = 1;
    while !idx.clean_some(budget) {
        steps += 1;
    }
    steps
}

/// Clears begun together share their scans of the tree: a hundred cost what one does (and
/// one begun while a pass runs, a second pass), not a hundred scans. Before, each clear was
/// a scan of the whole tree of its own, one after another: at a thousand instances and
/// millions of nodes, a fleet's resyncs held a scheduler's lock for tens of seconds.
#[test]
fn clears_begun_together_share_one_scan_of_the_tree() {
    let (mut one, _) = fleet(100);
    let slot = one.slot(&key("w0", 0)).unwrap();
    one.begin_clear_at(slot);
    let alone = steps_to_clean(&mut one, 4);
    assert!(alone > 10, "{alone} steps");

    let (mut idx, prompts) = fleet(100);
    for w in 0..99 {
        let slot = idx.slot(&key(&format!("w{w}"), 0)).unwrap();
        idx.begin_clear_at(slot);
    }
    assert!(!idx.clean_some(4));
    // Begun while the pass runs: it waits for the next.
    idx.retire_instance(&"w98".parse().unwrap());
    let late = idx.slot(&key("w99", 0)).unwrap();
    idx.begin_clear_at(late);
    let together = steps_to_clean(&mut idx, 4) + 1;
    // A step's budget counts the pairs it removes too, so a dense pass takes more steps than
    // a sparse one; one after another, the hundred took a hundred times one's steps.
    assert!(together <= 5 * alone, "{together} steps for 100 clears, {alone} for one");
    for (w, p) in prompts.iter().enumerate() {
        assert_eq!(idx.overlaps(p).len(), 0, "w{w} still matched");
        if w < 98 {
            assert_eq!(idx.blocks_of(&key(&format!("w{w}"), 0)), 0);
        }
    }
    assert_eq!(idx.len(), 0);
    idx.tree.check();
}
