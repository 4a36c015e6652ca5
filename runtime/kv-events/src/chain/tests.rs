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
