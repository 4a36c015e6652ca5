use handoff_core::block_hashes;

use super::*;

fn key(i: &str, dp: u32) -> WorkerKey {
    WorkerKey { instance: i.parse().unwrap(), dp_rank: dp }
}

#[test]
fn overlap_is_the_gapless_leading_run() {
    let mut idx = KvIndex::default();
    let prompt: Vec<u32> = (0..64).collect();
    let h = block_hashes(&prompt, 16);
    idx.store(&key("a", 0), &h[..3]);
    idx.store(&key("b", 1), &h[..1]);
    idx.store(&key("c", 0), &h[1..4]); // no first block: no overlap
    let o = idx.overlaps(&h);
    assert_eq!(o.get(&key("a", 0)), 3);
    assert_eq!(o.get(&key("b", 1)), 1);
    assert_eq!(o.get(&key("c", 0)), 0);
    assert_eq!(o.len(), 2);
    idx.remove(&key("a", 0), &h[1..2]);
    assert_eq!(idx.overlaps(&h).get(&key("a", 0)), 1);
}

#[test]
fn clear_and_instance_removal_forget_blocks() {
    let mut idx = KvIndex::default();
    let h = block_hashes(&(0..64).collect::<Vec<_>>(), 16);
    idx.store(&key("a", 0), &h);
    idx.store(&key("a", 1), &h);
    idx.store(&key("b", 0), &h);
    assert_eq!(idx.len(), 12);
    idx.clear(&key("a", 1));
    assert_eq!(idx.blocks_of(&key("a", 1)), 0);
    idx.remove_instance(&"a".parse().unwrap());
    assert_eq!(idx.len(), 4);
    assert_eq!(idx.overlaps(&h).len(), 1);
    idx.store(&key("d", 0), &h[..1]);
    assert_eq!(idx.overlaps(&h).get(&key("d", 0)), 1, "slot reuse is clean");
}

#[test]
fn entries_are_bounded() {
    let mut idx = KvIndex::new(10);
    let h = block_hashes(&(0..1600).collect::<Vec<_>>(), 16);
    idx.store(&key("a", 0), &h);
    assert_eq!(idx.len(), 10);
    idx.store(&key("a", 0), &h); // re-storing known blocks changes nothing
    assert_eq!(idx.len(), 10);
}
