use handoff_core::block_hashes;

use super::*;

fn stored(hashes: Vec<u64>, parent: Option<u64>, tokens: Vec<u32>, block_size: u32) -> Event {
    Event::Stored {
        hashes,
        parent,
        token_ids: tokens,
        block_size,
        lora_name: None,
        namespaced: false,
        spec_kind: None,
        medium: Some("GPU".into()),
        extra_keys: false,
        group_idx: None,
        bigram: false,
    }
}

fn stores(ops: &[IndexOp]) -> Vec<BlockHash> {
    ops.iter()
        .flat_map(|op| match op {
            IndexOp::Store { blocks, .. } => blocks.clone(),
            _ => Vec::new(),
        })
        .collect()
}

#[test]
fn equal_block_sizes_map_one_to_one_and_match_a_requests_hashes() {
    let tokens: Vec<u32> = (1000..1064).collect();
    let mut w = WorkerChains::new(16, 1000);
    let a = w.apply(&stored(vec![11, 12], None, tokens[..32].to_vec(), 16)).unwrap();
    let b = w.apply(&stored(vec![13, 14], Some(12), tokens[32..].to_vec(), 16)).unwrap();
    let want = block_hashes(&tokens, 16);
    assert_eq!(stores(&a), want[..2]);
    assert_eq!(b, vec![IndexOp::Store { parent: Some(want[1]), blocks: want[2..].to_vec() }]);
    // Removing engine block 13 removes exactly our third page.
    let r = w.apply(&Event::Removed { hashes: vec![13], medium: None, group_idx: None }).unwrap();
    assert_eq!(r, vec![IndexOp::Remove { blocks: vec![want[2]] }]);
}

#[test]
fn page_size_one_engines_fill_our_pages_across_events() {
    // SGLang with page size 1: one event per token, each chained to the last.
    let tokens: Vec<u32> = (7..7 + 40).collect();
    let mut w = WorkerChains::new(16, 1000);
    let mut ours = Vec::new();
    let mut parent = None;
    for (i, &t) in tokens.iter().enumerate() {
        let h = (i as i64 - 20) as u64; // signed hashes, as SGLang's
        ours.extend(stores(&w.apply(&stored(vec![h], parent, vec![t], 1)).unwrap()));
        parent = Some(h);
    }
    assert_eq!(ours, block_hashes(&tokens, 16), "two full pages, 8 tokens pending");
    // Evicting token 3's block removes the first page, which holds it.
    let r = w
        .apply(&Event::Removed { hashes: vec![(3i64 - 20) as u64], medium: None, group_idx: None })
        .unwrap();
    assert_eq!(r, vec![IndexOp::Remove { blocks: vec![ours[0]] }]);
}

#[test]
fn coarser_engine_blocks_map_to_many_pages() {
    let tokens: Vec<u32> = (0..64).map(|i| 500 + i * 3).collect();
    let mut w = WorkerChains::new(4, 1000);
    let ops = w.apply(&stored(vec![1, 2, 3, 4], None, tokens.clone(), 16)).unwrap();
    assert_eq!(stores(&ops), block_hashes(&tokens, 4));
    let r = w.apply(&Event::Removed { hashes: vec![2], medium: None, group_idx: None }).unwrap();
    assert_eq!(r, vec![IndexOp::Remove { blocks: block_hashes(&tokens, 4)[4..8].to_vec() }]);
}

#[test]
fn unknown_parents_inconsistent_events_and_inexact_blocks() {
    let mut w = WorkerChains::new(4, 1000);
    let orphan = stored(vec![9], Some(8), vec![1, 2, 3, 4], 4);
    assert_eq!(w.apply(&orphan), Err(ChainError::UnknownParent(8)));
    assert!(matches!(
        w.apply(&stored(vec![9], None, vec![1, 2, 3], 4)),
        Err(ChainError::Inconsistent { .. })
    ));
    let with = |f: &dyn Fn(&mut Event)| {
        let mut e = stored(vec![1], None, vec![1; 4], 4);
        f(&mut e);
        e
    };
    let set = |e: &mut Event, lora: bool, extra: bool, cpu: bool, group: bool| {
        if let Event::Stored { lora_name, extra_keys, medium, group_idx, .. } = e {
            if lora {
                *lora_name = Some("a".into());
            }
            *extra_keys = extra;
            if cpu {
                *medium = Some("CPU".into());
            }
            if group {
                *group_idx = Some(1);
            }
        }
    };
    let salted = |e: &mut Event| {
        if let Event::Stored { namespaced, .. } = e {
            *namespaced = true;
        }
    };
    let windowed = |e: &mut Event| {
        if let Event::Stored { spec_kind, .. } = e {
            *spec_kind = Some("sliding_window".into());
        }
    };
    for inexact in [
        with(&|e| set(e, true, false, false, false)),
        with(&|e| set(e, false, true, false, false)),
        with(&|e| set(e, false, false, true, false)),
        with(&|e| set(e, false, false, false, true)),
        with(&salted),
        with(&windowed),
    ] {
        assert_eq!(w.apply(&inexact).unwrap(), vec![], "{inexact:?}");
    }
    assert_eq!(w.skipped, 6);
    assert!(w.is_empty(), "nothing stored, so children of those blocks are orphans");
    let full = with(&|e| {
        if let Event::Stored { spec_kind, .. } = e {
            *spec_kind = Some("full_attention".into());
        }
    });
    assert_eq!(w.apply(&full).unwrap().len(), 1, "a full attention cache's blocks are exact");
    // Another group's eviction of the same block (a sliding window's) leaves it indexed.
    let evicted = |group_idx| Event::Removed { hashes: vec![1], medium: None, group_idx };
    assert_eq!(w.apply(&evicted(Some(1))).unwrap(), vec![]);
    assert_eq!(w.apply(&evicted(Some(0))).unwrap().len(), 1);
    w.apply(&stored(vec![1], None, vec![1; 4], 4)).unwrap();
    assert_eq!(w.apply(&Event::Cleared).unwrap(), vec![IndexOp::Clear]);
    assert!(w.is_empty());
}

#[test]
fn the_map_is_bounded() {
    let mut w = WorkerChains::new(1, 8);
    for i in 0..8u64 {
        w.apply(&stored(vec![i], None, vec![i as u32], 1)).unwrap();
    }
    let ops = w.apply(&stored(vec![100], None, vec![5], 1)).unwrap();
    assert_eq!(ops[0], IndexOp::Clear, "full: cleared and rebuilt");
    assert_eq!(w.len(), 1);
}

/// A hot prefix whose last page is partial (SGLang, page size 1): each continuation stored
/// after it completes a page its last blocks share. Removing a continuation takes that page
/// out of their lists too, so a thousand continuations come and gone leave them as they were.
#[test]
fn continuations_come_and_gone_leave_a_prefix_as_it_was() {
    let mut w = WorkerChains::new(4, 100_000);
    // Six tokens: one full page and two tokens of the next.
    let prefix: Vec<u32> = (1..=6).collect();
    for (i, &t) in prefix.iter().enumerate() {
        let parent = (i > 0).then_some(i as u64);
        w.apply(&stored(vec![i as u64 + 1], parent, vec![t], 1)).unwrap();
    }
    let shared = |w: &WorkerChains| w.points[&5].pages.len() + w.points[&6].pages.len();
    let before = shared(&w);
    for c in 0..1000u64 {
        let (a, b) = (1_000 + 2 * c, 1_001 + 2 * c);
        w.apply(&stored(vec![a, b], Some(6), vec![100 + c as u32, 7], 1)).unwrap();
        let gone = Event::Removed { hashes: vec![b, a], medium: None, group_idx: None };
        let r = w.apply(&gone).unwrap();
        assert_eq!(stores_removed(&r), 1, "the continuation's page goes");
    }
    assert_eq!(shared(&w), before, "the prefix's blocks kept no page of a continuation gone");
    assert_eq!(w.len(), 6);
}

fn stores_removed(ops: &[IndexOp]) -> usize {
    ops.iter()
        .map(|op| match op {
            IndexOp::Remove { blocks } => blocks.len(),
            _ => 0,
        })
        .sum()
}

/// The index lost the worker's entries (a gap no replay fills) while the engine kept its
/// cache: the next store continuing a hot prefix stores that prefix first, so it matches
/// again (an engine never stores a block it already holds; before, every continuation was
/// refused as unknown and the prefix stayed out of the index while the engine held it).
#[test]
fn a_prefix_the_index_lost_comes_back_with_its_next_continuation() {
    // Engine blocks of 2 tokens, our pages of 4: pages span blocks.
    let tokens: Vec<u32> = (500..520).collect();
    let want = block_hashes(&tokens, 4);
    let mut w = WorkerChains::new(4, 1000);
    // The prefix: 10 tokens in 5 blocks (two full pages, two tokens pending).
    let prefix = w.apply(&stored(vec![1, 2, 3, 4, 5], None, tokens[..10].to_vec(), 2)).unwrap();
    assert_eq!(stores(&prefix), want[..2]);
    w.forget_index(true);
    // A continuation after block 5 (the engine holds 1..5): the prefix first, then its pages.
    let ops = w.apply(&stored(vec![6, 7], Some(5), tokens[10..14].to_vec(), 2)).unwrap();
    assert_eq!(
        ops,
        vec![
            IndexOp::Store { parent: None, blocks: want[..2].to_vec() },
            IndexOp::Store { parent: Some(want[1]), blocks: want[2..3].to_vec() },
        ]
    );
    // Back in the index: the next continuation stores only its own pages.
    let ops = w.apply(&stored(vec![8, 9], Some(7), tokens[14..18].to_vec(), 2)).unwrap();
    assert_eq!(ops, vec![IndexOp::Store { parent: Some(want[2]), blocks: want[3..4].to_vec() }]);
    // Lost again, then a continuation after block 7: blocks 1..7 again, in order.
    w.forget_index(true);
    let ops = w.apply(&stored(vec![10], Some(7), tokens[14..16].to_vec(), 2)).unwrap();
    assert_eq!(ops[0], IndexOp::Store { parent: None, blocks: want[..3].to_vec() });
    // Its continuation, its parent in the index now, stores no prefix.
    assert_eq!(ops[1], IndexOp::Store { parent: Some(want[2]), blocks: want[3..4].to_vec() });
    let ops = w.apply(&stored(vec![11, 12], Some(10), tokens[16..20].to_vec(), 2)).unwrap();
    assert_eq!(ops, vec![IndexOp::Store { parent: Some(want[3]), blocks: want[4..5].to_vec() }]);
}

/// A block whose parent went (removed) is stored again from there: after the page before it.
#[test]
fn a_lost_chain_whose_start_went_is_stored_from_where_it_is_known() {
    let tokens: Vec<u32> = (1..=12).collect();
    let want = block_hashes(&tokens, 4);
    let mut w = WorkerChains::new(4, 1000);
    w.apply(&stored(vec![1, 2, 3], None, tokens.clone(), 4)).unwrap();
    w.apply(&Event::Removed { hashes: vec![1], medium: None, group_idx: None }).unwrap();
    w.forget_index(true);
    let more: Vec<u32> = (13..=16).collect();
    let ops = w.apply(&stored(vec![4], Some(3), more, 4)).unwrap();
    assert_eq!(ops[0], IndexOp::Store { parent: Some(want[0]), blocks: want[1..3].to_vec() });
}

/// vLLM holds identical blocks twice (two requests filled the same tokens, no
/// de-duplication): each copy is stored and removed; the block leaves at its last copy.
#[test]
fn a_block_held_twice_leaves_at_its_last_copy() {
    let tokens: Vec<u32> = (1..=8).collect();
    let want = block_hashes(&tokens, 4);
    let mut w = WorkerChains::new(4, 1000);
    w.apply(&stored(vec![1], None, tokens[..4].to_vec(), 4)).unwrap();
    for _ in 0..2 {
        w.apply(&stored(vec![2], Some(1), tokens[4..].to_vec(), 4)).unwrap();
    }
    let gone = || Event::Removed { hashes: vec![2], medium: None, group_idx: None };
    assert_eq!(w.apply(&gone()).unwrap(), vec![], "one copy left");
    assert_eq!(w.apply(&gone()).unwrap(), vec![IndexOp::Remove { blocks: vec![want[1]] }]);
    assert_eq!(w.apply(&gone()).unwrap(), vec![], "already gone");
}

/// Parents in a cycle (a hostile or broken engine) end the walk back through them.
#[test]
fn a_parent_cycle_ends_the_walk() {
    let mut w = WorkerChains::new(1, 1000);
    w.apply(&stored(vec![1], None, vec![1], 1)).unwrap();
    w.apply(&stored(vec![2], Some(1), vec![2], 1)).unwrap();
    w.apply(&stored(vec![1], Some(2), vec![3], 1)).unwrap();
    w.forget_index(true);
    let ops = w.apply(&stored(vec![3], Some(1), vec![4], 1)).unwrap();
    assert!(!ops.is_empty());
}

/// Events lost, a removal among them: the engine evicted a block, then stored it again. That
/// store is its one copy, not a second: its next removal takes it out of the index (counted
/// as a second copy, the block would have stayed there, a match the engine does not hold).
#[test]
fn a_block_stored_again_after_lost_events_is_one_copy() {
    let tokens: Vec<u32> = (1..=8).collect();
    let want = block_hashes(&tokens, 4);
    let mut w = WorkerChains::new(4, 1000);
    w.apply(&stored(vec![1], None, tokens[..4].to_vec(), 4)).unwrap();
    w.apply(&stored(vec![2], Some(1), tokens[4..].to_vec(), 4)).unwrap();
    // Lost: "removed 2". Then 2 stored again.
    w.forget_index(true);
    w.apply(&stored(vec![2], Some(1), tokens[4..].to_vec(), 4)).unwrap();
    let gone = Event::Removed { hashes: vec![2], medium: None, group_idx: None };
    assert_eq!(w.apply(&gone).unwrap(), vec![IndexOp::Remove { blocks: vec![want[1]] }]);
    // The index cleared for silence (no event lost): copies are still known.
    let mut w = WorkerChains::new(4, 1000);
    w.apply(&stored(vec![1], None, tokens[..4].to_vec(), 4)).unwrap();
    for _ in 0..2 {
        w.apply(&stored(vec![2], Some(1), tokens[4..].to_vec(), 4)).unwrap();
    }
    w.forget_index(false);
    assert_eq!(w.apply(&gone).unwrap(), vec![], "one of two copies left");
}
