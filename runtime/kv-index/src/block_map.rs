//! [`BlockMap`]: the tree's maps keyed by block hash, split into shards that each grow on
//! their own. One table of millions of blocks doubles, or rehashes away its tombstones, by
//! moving every entry at once, under the scheduler's lock while every selection waits (the
//! churn bench's longest event at 1024 instances: 18-24 ms); a shard holds a 256th of them,
//! so a store that grows one moves a 256th (0.6-0.7 ms there). The price: bulk ingest runs
//! about a fifth slower than into one table. The bound holds for keys nobody steers: block
//! hashes are unkeyed, so a client choosing prompts could crowd one shard (about 256 tries a
//! block) and bring the one table's stall back within it.

use handoff_core::BlockHash;
use hashbrown::HashTable;
use hashbrown::hash_table::Entry;

use crate::hasher::fold;

/// log2 of the shard count.
const SHARD_BITS: u32 = 8;

/// A map from block hash to `V`. The key is hashed once: bits 32 and up pick the shard, and
/// the shard's table takes the same hash (it indexes by the low bits and tags by the top
/// seven, so neither is constant within a shard).
#[derive(Debug)]
pub(crate) struct BlockMap<V> {
    shards: Box<[HashTable<(BlockHash, V)>]>,
    len: usize,
}

impl<V> Default for BlockMap<V> {
    fn default() -> Self {
        BlockMap { shards: (0..1 << SHARD_BITS).map(|_| HashTable::new()).collect(), len: 0 }
    }
}

fn hash(h: BlockHash) -> u64 {
    fold(h.0)
}

fn shard_of(hash: u64) -> usize {
    (hash >> 32) as usize & ((1 << SHARD_BITS) - 1)
}

impl<V> BlockMap<V> {
    fn table(&self, k: u64) -> &HashTable<(BlockHash, V)> {
        &self.shards[shard_of(k)]
    }

    fn table_mut(&mut self, k: u64) -> &mut HashTable<(BlockHash, V)> {
        &mut self.shards[shard_of(k)]
    }

    pub(crate) fn get(&self, h: &BlockHash) -> Option<&V> {
        let k = hash(*h);
        self.table(k).find(k, |e| e.0 == *h).map(|e| &e.1)
    }

    pub(crate) fn get_mut(&mut self, h: &BlockHash) -> Option<&mut V> {
        let k = hash(*h);
        self.table_mut(k).find_mut(k, |e| e.0 == *h).map(|e| &mut e.1)
    }

    #[cfg(test)]
    pub(crate) fn contains_key(&self, h: &BlockHash) -> bool {
        self.get(h).is_some()
    }

    /// Inserts `v` at `h` unless `h` is there; whether it was inserted.
    pub(crate) fn insert_new(&mut self, h: BlockHash, v: V) -> bool {
        let k = hash(h);
        match self.table_mut(k).entry(k, |e| e.0 == h, |e| hash(e.0)) {
            Entry::Vacant(e) => {
                e.insert((h, v));
                self.len += 1;
                true
            }
            Entry::Occupied(_) => false,
        }
    }

    /// Sets `h` to `v`.
    pub(crate) fn insert(&mut self, h: BlockHash, v: V) {
        let k = hash(h);
        match self.table_mut(k).entry(k, |e| e.0 == h, |e| hash(e.0)) {
            Entry::Vacant(e) => {
                e.insert((h, v));
                self.len += 1;
            }
            Entry::Occupied(mut e) => e.get_mut().1 = v,
        }
    }

    pub(crate) fn remove(&mut self, h: &BlockHash) -> Option<V> {
        let k = hash(*h);
        let found = self.table_mut(k).find_entry(k, |e| e.0 == *h).ok()?;
        let v = found.remove().0.1;
        self.len -= 1;
        Some(v)
    }

    /// Entries in the map.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Every entry, in no order.
    #[cfg(test)]
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&BlockHash, &V)> {
        self.shards.iter().flat_map(|s| s.iter().map(|e| (&e.0, &e.1)))
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
        *m.get_mut(&keys[2]).expect("key 2 is in") = 9;
        assert_eq!(m.get(&keys[2]), Some(&9));
        assert_eq!(m.iter().count(), m.len());
        let used = m.shards.iter().filter(|s| !s.is_empty()).count();
        assert!(used > m.shards.len() / 2, "structured keys crowd {used} shards");
        // Within a shard, the bits its table indexes by (low) and tags by (top seven) still
        // vary: the shard is picked from neither.
        let in_first: Vec<u64> = keys
            .iter()
            .map(|&k| hash(k))
            .filter(|&k| shard_of(k) == shard_of(hash(keys[0])))
            .collect();
        let distinct = |f: &dyn Fn(u64) -> u64| {
            in_first.iter().map(|&k| f(k)).collect::<std::collections::HashSet<_>>().len()
        };
        assert!(distinct(&|k| k & 0xf) >= 8, "low bits fixed within a shard");
        assert!(distinct(&|k| k >> 57) >= 8, "tag bits fixed within a shard");
    }
}
