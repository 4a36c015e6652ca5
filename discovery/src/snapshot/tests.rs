use super::*;

fn taken(seq: u64, sizes: &[usize]) -> Taken {
    let mut next = 0u64;
    let mut t = Taken { seq, ..Taken::default() };
    for &n in sizes {
        let blocks: Vec<BlockHash> = (0..n as u64).map(|i| BlockHash(next + i)).collect();
        let parents = (0..n).map(|i| i.checked_sub(1).map(|p| blocks[p])).collect();
        next += n as u64;
        t.dp_blocks.push(blocks);
        t.dp_parents.push(parents);
    }
    t
}

fn id() -> InstanceId {
    "p0".parse().unwrap()
}

/// Every page of the newest snapshot, asked for as a scheduler would.
fn all_pages(s: &Snapshots, seq: u64, t: &Taken) -> Vec<KvSnapshot> {
    let first = s.page(SnapshotAsk::default(), seq, || t.clone()).unwrap();
    let mut pages = vec![first];
    while !pages.last().unwrap().is_last() {
        let last = pages.last().unwrap();
        let ask = SnapshotAsk { snapshot: last.snapshot, page: last.page + 1 };
        pages.push(s.page(ask, seq, || panic!("a kept snapshot is not taken again")).unwrap());
    }
    pages
}

#[test]
fn pages_are_bounded_and_concatenate_to_the_whole_snapshot() {
    for (page_blocks, sizes) in [
        (4, vec![10, 0, 3, 4]),
        (5, vec![5, 5]),
        (7, vec![0]),
        (1, vec![3, 1]),
        (100, vec![10, 20]),
        (3, vec![]),
    ] {
        let s = Snapshots::with_page_blocks(id(), page_blocks);
        let t = taken(9, &sizes);
        let pages = all_pages(&s, 9, &t);
        let total: usize = sizes.iter().sum();
        assert_eq!(pages.len(), total.div_ceil(page_blocks).max(1), "{page_blocks} {sizes:?}");
        let mut joined = vec![Vec::new(); sizes.len()];
        let mut parents = vec![Vec::new(); sizes.len()];
        for (k, p) in pages.iter().enumerate() {
            assert_eq!((p.page as usize, p.pages as usize, p.seq), (k, pages.len(), 9));
            assert!(p.len() <= page_blocks);
            assert_eq!(p.dp_blocks.len(), sizes.len());
            for dp in 0..sizes.len() {
                assert_eq!(p.dp_blocks[dp].len(), p.dp_parents[dp].len());
                joined[dp].extend_from_slice(&p.dp_blocks[dp]);
                parents[dp].extend_from_slice(&p.dp_parents[dp]);
            }
        }
        assert_eq!(joined, t.dp_blocks, "{page_blocks} {sizes:?}");
        assert_eq!(parents, t.dp_parents);
    }
}

#[test]
fn a_full_page_of_the_largest_hashes_fits_a_stock_nats_payload() {
    let blocks: Vec<BlockHash> = (0..PAGE_BLOCKS as u64).map(|i| BlockHash(u64::MAX - i)).collect();
    let parents = blocks.iter().map(|b| Some(BlockHash(b.0 - 1))).collect();
    let t =
        Taken { seq: u64::MAX, incarnation: 0, dp_blocks: vec![blocks], dp_parents: vec![parents] };
    let s = Snapshots::new(id());
    let page = s.page(SnapshotAsk::default(), u64::MAX, || t).unwrap();
    let bytes = serde_json::to_vec(&page).unwrap().len();
    assert!(bytes < 1 << 20, "{bytes} bytes");
}

#[test]
fn a_snapshot_is_reused_until_the_caches_change_and_forgotten_when_old() {
    let s = Snapshots::with_page_blocks(id(), 2);
    let first = s.page(SnapshotAsk::default(), 1, || taken(1, &[5])).unwrap();
    let again = s.page(SnapshotAsk::default(), 1, || panic!("not taken again")).unwrap();
    assert_eq!(first.snapshot, again.snapshot);
    // Pages are of the moment the snapshot was taken, whatever came since.
    for seq in 2..=(KEPT as u64) {
        s.page(SnapshotAsk::default(), seq, || taken(seq, &[1])).unwrap();
    }
    let ask = SnapshotAsk { snapshot: first.snapshot, page: 2 };
    let p = s.page(ask, 99, || panic!("a kept snapshot is not taken again")).unwrap();
    assert_eq!((p.seq, p.dp_blocks[0].clone()), (1, vec![BlockHash(4)]));
    assert_eq!(
        s.page(SnapshotAsk { snapshot: first.snapshot, page: 3 }, 99, || unreachable!()),
        Err(PageError::NoPage { snapshot: first.snapshot, page: 3, pages: 3 })
    );
    // One more: the first is forgotten.
    s.page(SnapshotAsk::default(), 50, || taken(50, &[1])).unwrap();
    assert_eq!(s.page(ask, 99, || unreachable!()), Err(PageError::Gone(first.snapshot)));
    assert_eq!(
        s.page(SnapshotAsk { snapshot: 12345, page: 0 }, 99, || unreachable!()),
        Err(PageError::Gone(12345))
    );
}
