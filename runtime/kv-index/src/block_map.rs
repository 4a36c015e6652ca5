//! [`BlockMap`]: the tree's maps keyed by block hash, split into shards that each grow on
//! their own. One map of millions of blocks doubles by moving every entry at once (43 ms at
//! two million blocks, under the scheduler's lock, while every selection waits); a shard
//! holds a thousandth of them, so a store that grows one moves a thousandth, and does it
//! within the cache.

use std::collections::hash_map::Entry;

use handoff_core::BlockHash;

use crate::hasher::FoldMap;

/// log2 of the shard count.
const SHARD_BITS: u32 = 10;

/// A map from block hash to `V`, sharded by the hash's top bits after a multiply (the inner
/// maps index by the folded hash's low bits, so the two choices do not correlate).
#[derive(Debug)]
pub(crate) struct BlockMap<V> {
    shards: Box<[FoldMap<BlockHash, V>]>,
}

impl<V> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap { shards: (0..1 << SHARD_BITS).map(|_| FoldMap::default()).collect() }
    }
}

fn shard_of(h: BlockHash) -> usize {
    (h.0.wrapping_mul(0xD6E8_FEB8_6659_FD93) >> (64 - SHARD_BITS)) as usize
}

impl<V> BlockMap<V> {
    fn shard(&self, h: BlockHash) -> &FoldMap<BlockHash, V> {
        &self.shards[shard_of(h)]
    }

    pub(crate) fn get(&self, h: &BlockHash) -> Option<&V> {
        self.shard(*h).get(h)
    }

    pub(crate) fn get_mut(&mut self, h: &BlockHash) -> Option<&mut V> {
        self.shards[shard_of(*h)].get_mut(h)
    }

    #[cfg(test)]
    pub(crate) fn contains_key(&self, h: &BlockHash) -> bool {
        self.shard(*h).contains_key(h)
    }

    /// Inserts `v` at `h` unless `h` is there; whether it was inserted.
    pub(crate) fn insert_new(&mut self, h: BlockHash, v: V) -> bool {
        match self.shards[shard_of(h)].entry(h) {
            Entry::Vacant(e) => {
                e.insert(v);
                true
            }
            Entry::Occupied(_) => false,
        }
    }

    /// Sets `h` to `v`.
    pub(crate) fn insert(&mut self, h: BlockHash, v: V) {
        self.shards[shard_of(h)].insert(h, v);
    }

    pub(crate) fn remove(&mut self, h: &BlockHash) -> Option<V> {
        self.shards[shard_of(*h)].remove(h)
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len()).sum()
    }

    /// Every entry, in no order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&BlockHash, &V)> {
        self.shards.iter().flat_map(|s| s.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_count_once_whichever_shard_holds_them() {
        let mut m = BlockMap::default();
        let keys: Vec<BlockHash> = (0..5000u64).map(|i| BlockHash(i << 20 | i)).collect();
        for (i, &k) in keys.iter().enumerate() {
            assert!(m.insert_new(k, i));
            assert!(!m.insert_new(k, 0), "a second insert of {k:?} took");
        }
        assert_eq!(m.len(), keys.len());
        m.insert(keys[0], 7);
        assert_eq!((m.len(), m.get(&keys[0])), (keys.len(), Some(&7)));
        assert_eq!(m.remove(&keys[1]), Some(1));
        assert_eq!((m.remove(&keys[1]), m.len()), (None, keys.len() - 1));
        assert!(!m.contains_key(&keys[1]) && m.contains_key(&keys[2]));
        *m.get_mut(&keys[2]).unwrap_or(&mut 0) = 9;
        assert_eq!(m.get(&keys[2]), Some(&9));
        assert_eq!(m.iter().count(), m.len());
        let used = m.shards.iter().filter(|s| !s.is_empty()).count();
        assert!(used > m.shards.len() / 2, "structured keys crowd {used} shards");
    }
}
