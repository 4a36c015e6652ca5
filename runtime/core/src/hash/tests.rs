use super::*;

#[test]
fn hashes_chain_over_full_pages_only() {
    let toks: Vec<u32> = (0..10).collect();
    let h = block_hashes(&toks, 4);
    assert_eq!(h.len(), 2);
    let first =
        xxh3_64_with_seed(&[0u8, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0], BLOCK_HASH_SEED);
    assert_eq!(h[0], BlockHash(first));
}

#[test]
fn same_page_after_different_prefix_hashes_differently() {
    let a = block_hashes(&[1, 2, 3, 4, 9, 9, 9, 9], 4);
    let b = block_hashes(&[5, 6, 7, 8, 9, 9, 9, 9], 4);
    assert_ne!(a[1], b[1]);
    let c = block_hashes(&[1, 2, 3, 4, 9, 9, 9, 9, 7], 4);
    assert_eq!(a, c, "a shared prefix gives shared hashes");
}
