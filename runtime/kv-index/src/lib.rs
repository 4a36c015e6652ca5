//! The global KV block index: which (instance, dp rank) holds which blocks, keyed by the
//! chained block hashes of `handoff_core::hash`. Pure data structure, no network; the
//! scheduler feeds it KV events and asks it for each candidate's cached prefix.
//!
//! Because hashes are chained, a block hash names a whole prefix; a worker's overlap with a
//! prompt is the number of leading prompt blocks it holds without a gap.

use std::collections::{HashMap, HashSet};

use handoff_core::{BlockHash, InstanceId};

/// One (instance, dp rank): the unit the scheduler routes to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The instance.
    pub instance: InstanceId,
    /// Its dp rank.
    pub dp_rank: u32,
}

#[derive(Debug)]
struct Worker {
    key: WorkerKey,
    blocks: HashSet<BlockHash>,
}

/// The index (see the crate docs).
#[derive(Debug)]
pub struct KvIndex {
    workers: Vec<Option<Worker>>,
    free: Vec<u32>,
    slots: HashMap<WorkerKey, u32>,
    holders: HashMap<BlockHash, Vec<u32>>,
    entries: usize,
    max_entries: usize,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(50_000_000)
    }
}

impl KvIndex {
    /// An empty index holding at most `max_entries` (block, worker) pairs; stores beyond
    /// that are dropped (the index then underestimates overlap, which only costs a miss).
    pub fn new(max_entries: usize) -> Self {
        KvIndex {
            workers: Vec::new(),
            free: Vec::new(),
            slots: HashMap::new(),
            holders: HashMap::new(),
            entries: 0,
            max_entries,
        }
    }

    fn slot(&mut self, key: &WorkerKey) -> u32 {
        if let Some(&s) = self.slots.get(key) {
            return s;
        }
        let w = Worker { key: key.clone(), blocks: HashSet::new() };
        let s = match self.free.pop() {
            Some(s) => {
                self.workers[s as usize] = Some(w);
                s
            }
            None => {
                self.workers.push(Some(w));
                (self.workers.len() - 1) as u32
            }
        };
        self.slots.insert(key.clone(), s);
        s
    }

    /// Records that `key` now holds `blocks`.
    pub fn store(&mut self, key: &WorkerKey, blocks: &[BlockHash]) {
        let s = self.slot(key);
        let Some(w) = self.workers[s as usize].as_mut() else { return };
        for &b in blocks {
            if self.entries >= self.max_entries {
                break;
            }
            if w.blocks.insert(b) {
                self.holders.entry(b).or_default().push(s);
                self.entries += 1;
            }
        }
    }

    /// Records that `key` evicted `blocks`.
    pub fn remove(&mut self, key: &WorkerKey, blocks: &[BlockHash]) {
        let Some(&s) = self.slots.get(key) else { return };
        let Some(w) = self.workers[s as usize].as_mut() else { return };
        for b in blocks {
            if w.blocks.remove(b) {
                Self::unhold(&mut self.holders, *b, s);
                self.entries -= 1;
            }
        }
    }

    fn unhold(holders: &mut HashMap<BlockHash, Vec<u32>>, b: BlockHash, s: u32) {
        if let Some(v) = holders.get_mut(&b) {
            v.retain(|&x| x != s);
            if v.is_empty() {
                holders.remove(&b);
            }
        }
    }

    /// Forgets everything `key` held (it cleared its cache), keeping it as a worker.
    pub fn clear(&mut self, key: &WorkerKey) {
        let Some(&s) = self.slots.get(key) else { return };
        if let Some(w) = self.workers[s as usize].as_mut() {
            for b in w.blocks.drain() {
                Self::unhold(&mut self.holders, b, s);
                self.entries -= 1;
            }
        }
    }

    /// Drops every dp rank of `instance` (it left).
    pub fn remove_instance(&mut self, instance: &InstanceId) {
        let keys: Vec<WorkerKey> =
            self.slots.keys().filter(|k| &k.instance == instance).cloned().collect();
        for k in keys {
            self.clear(&k);
            if let Some(s) = self.slots.remove(&k) {
                self.workers[s as usize] = None;
                self.free.push(s);
            }
        }
    }

    /// Blocks `key` holds.
    pub fn blocks_of(&self, key: &WorkerKey) -> usize {
        self.slots
            .get(key)
            .and_then(|&s| self.workers[s as usize].as_ref())
            .map_or(0, |w| w.blocks.len())
    }

    /// The blocks `key` holds.
    pub fn blocks(&self, key: &WorkerKey) -> Vec<BlockHash> {
        self.slots
            .get(key)
            .and_then(|&s| self.workers[s as usize].as_ref())
            .map_or_else(Vec::new, |w| w.blocks.iter().copied().collect())
    }

    /// (block, worker) pairs held.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// How many leading blocks of `hashes` each worker holds (see [`Overlaps`]). One pass
    /// over the holders of each prompt block: linear in the (block, worker) pairs touched.
    pub fn overlaps(&self, hashes: &[BlockHash]) -> Overlaps<'_> {
        let mut run = vec![0u32; self.workers.len()];
        for (i, h) in hashes.iter().enumerate() {
            let Some(holders) = self.holders.get(h) else { break };
            let mut extended = false;
            for &w in holders {
                // Extends only a run that reached this block without a gap.
                if run[w as usize] == i as u32 {
                    run[w as usize] = i as u32 + 1;
                    extended = true;
                }
            }
            if !extended {
                break;
            }
        }
        Overlaps { index: self, run }
    }
}

/// The result of [`KvIndex::overlaps`]: leading blocks held, per worker.
#[derive(Debug)]
pub struct Overlaps<'a> {
    index: &'a KvIndex,
    run: Vec<u32>,
}

impl Overlaps<'_> {
    /// Leading blocks `key` holds (0 for unknown workers).
    pub fn get(&self, key: &WorkerKey) -> usize {
        self.index.slots.get(key).map_or(0, |&s| self.run[s as usize] as usize)
    }

    /// Every worker holding at least the first block, with its run.
    pub fn iter(&self) -> impl Iterator<Item = (&WorkerKey, usize)> {
        self.run
            .iter()
            .enumerate()
            .filter(|(_, r)| **r > 0)
            .filter_map(|(s, &r)| self.index.workers[s].as_ref().map(|w| (&w.key, r as usize)))
    }

    /// Workers holding at least the first block.
    pub fn len(&self) -> usize {
        self.iter().count()
    }

    /// Whether no worker holds the first block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests;
