//! The global KV block index: which (instance, dp rank) holds which blocks, keyed by the
//! chained block hashes of `handoff_core::hash`. Pure data structure, no network; the
//! scheduler feeds it KV events and asks it for each candidate's cached prefix.
//!
//! Because hashes are chained, a block hash names a whole prefix; a worker's overlap with a
//! prompt is the number of leading prompt blocks it holds without a gap.
//!
//! Workers live in dense *slots* (reused after a worker leaves), so callers can keep their
//! own per-worker state in plain vectors and read a match result by slot. Blocks live in a
//! compressed radix tree ([`tree`]) whose edges carry the set of slots holding them.

mod block_map;
mod hasher;
mod run;
mod slot_set;
mod tree;

use std::collections::HashMap;

use handoff_core::{BlockHash, InstanceId};

use crate::tree::Tree;

pub use crate::hasher::{FoldHasher, FoldMap};
pub use crate::run::Run;

/// One (instance, dp rank): the unit the scheduler routes to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkerKey {
    /// The instance.
    pub instance: InstanceId,
    /// Its dp rank.
    pub dp_rank: u32,
}

/// A worker's dense id in the index, valid until its instance is removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Slot(u32);

impl Slot {
    /// The slot as a vector index.
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// The index (see the crate docs).
#[derive(Debug)]
pub struct KvIndex {
    tree: Tree,
    keys: Vec<Option<WorkerKey>>,
    /// Blocks held, per slot.
    held: Vec<usize>,
    free: Vec<u32>,
    slots: HashMap<WorkerKey, u32>,
    /// Slots being cleared a step at a time ([`KvIndex::clean_some`]), and whether each is
    /// retired (its worker left: the slot is reused once clear).
    clearing: HashMap<u32, bool>,
    /// What the last step of the clears did (kept for its allocation).
    cleared: Vec<tree::Cleared>,
    entries: usize,
    max_entries: usize,
    /// Clears a store or removal finished at once.
    forced_clears: u64,
}

impl Default for KvIndex {
    fn default() -> Self {
        Self::new(50_000_000)
    }
}

impl KvIndex {
    /// An empty index holding at most `max_entries` (block, worker) pairs, and at most as
    /// many blocks in its tree (counting blocks nobody holds that stay above held ones);
    /// stores beyond that are dropped (the index then underestimates overlap, which only
    /// costs a miss).
    pub fn new(max_entries: usize) -> Self {
        KvIndex {
            tree: Tree::default(),
            keys: Vec::new(),
            held: Vec::new(),
            free: Vec::new(),
            slots: HashMap::new(),
            clearing: HashMap::new(),
            cleared: Vec::new(),
            entries: 0,
            max_entries,
            forced_clears: 0,
        }
    }

    /// The slot of `key`, allocating one if it has none.
    pub fn register(&mut self, key: &WorkerKey) -> Slot {
        if let Some(&s) = self.slots.get(key) {
            return Slot(s);
        }
        let s = match self.free.pop() {
            Some(s) => {
                self.keys[s as usize] = Some(key.clone());
                s
            }
            None => {
                self.keys.push(Some(key.clone()));
                self.held.push(0);
                (self.keys.len() - 1) as u32
            }
        };
        self.slots.insert(key.clone(), s);
        Slot(s)
    }

    /// The slot at vector index `i` (whether or not a worker holds it now).
    pub fn slot_at(&self, i: usize) -> Slot {
        Slot(i as u32)
    }

    /// The slot of `key`, if it has one.
    pub fn slot(&self, key: &WorkerKey) -> Option<Slot> {
        self.slots.get(key).map(|&s| Slot(s))
    }

    /// The worker in `slot`.
    pub fn key(&self, slot: Slot) -> Option<&WorkerKey> {
        self.keys.get(slot.index()).and_then(Option::as_ref)
    }

    /// One past the highest slot ever handed out: the length of per-slot vectors.
    pub fn slot_capacity(&self) -> usize {
        self.keys.len()
    }

    /// Records that `key` now holds the chained run `blocks`, whose first block follows
    /// `parent` (`None` when it starts a prompt or is not known). Any list is accepted; a
    /// chained run with its parent keeps the tree compressed. A prompt's first block is
    /// matched only once some run with no parent has begun with it, so blocks of several
    /// prompts in one list (not a chain) are stored one at a time.
    pub fn store(&mut self, key: &WorkerKey, parent: Option<BlockHash>, blocks: &[BlockHash]) {
        let slot = self.register(key);
        self.store_at(slot, parent, blocks);
    }

    /// [`KvIndex::store`] by slot.
    pub fn store_at(&mut self, slot: Slot, parent: Option<BlockHash>, blocks: &[BlockHash]) {
        if self.key(slot).is_none() {
            return;
        }
        self.finish_clear_forced(slot);
        let budget = self.max_entries.saturating_sub(self.entries);
        let added = self.tree.store(slot.0, parent, blocks, budget, self.max_entries);
        self.entries += added;
        self.held[slot.index()] += added;
    }

    /// Records that `key` evicted `blocks`.
    pub fn remove(&mut self, key: &WorkerKey, blocks: &[BlockHash]) {
        if let Some(slot) = self.slot(key) {
            self.remove_at(slot, blocks);
        }
    }

    /// [`KvIndex::remove`] by slot.
    pub fn remove_at(&mut self, slot: Slot, blocks: &[BlockHash]) {
        if self.key(slot).is_none() {
            return;
        }
        self.finish_clear_forced(slot);
        let removed = self.tree.remove(slot.0, blocks);
        self.entries -= removed;
        self.held[slot.index()] -= removed;
    }

    /// Forgets everything `key` held (it cleared its cache), keeping its slot.
    pub fn clear(&mut self, key: &WorkerKey) {
        if let Some(slot) = self.slot(key) {
            self.clear_at(slot);
        }
    }

    /// [`KvIndex::clear`] by slot.
    pub fn clear_at(&mut self, slot: Slot) {
        self.begin_clear_at(slot);
        self.finish_clear(slot);
    }

    /// Starts clearing `slot`, to be finished by [`KvIndex::clean_some`] a bounded step at a
    /// time (or at once by a store or removal for it). Meanwhile it still matches what is
    /// left of it.
    pub fn begin_clear_at(&mut self, slot: Slot) {
        if self.held_at(slot) > 0 && !self.clearing.contains_key(&slot.0) {
            self.clearing.insert(slot.0, false);
            self.tree.begin_clear(slot.0);
        }
    }

    /// Finishes any clear of `slot` at once; whether there was one.
    fn finish_clear(&mut self, slot: Slot) -> bool {
        let Some(retired) = self.clearing.remove(&slot.0) else { return false };
        let removed = self.tree.finish_clear(slot.0).unwrap_or(0);
        self.cleared(slot.0, removed, retired);
        true
    }

    /// [`KvIndex::finish_clear`] for a store or removal into a slot still being cleared,
    /// which must not let the clear's later steps wipe what it adds.
    fn finish_clear_forced(&mut self, slot: Slot) {
        if self.finish_clear(slot) {
            self.forced_clears += 1;
        }
    }

    /// How many clears a store or removal has finished at once: each a scan of the whole
    /// tree from the clear's cursor, in one call. A caller that finishes its clears with
    /// [`KvIndex::clean_some`] before changing the cleared slot again keeps this at zero.
    pub fn forced_clears(&self) -> u64 {
        self.forced_clears
    }

    fn cleared(&mut self, slot: u32, removed: usize, retired: bool) {
        self.entries -= removed;
        self.held[slot as usize] -= removed;
        if retired {
            self.free.push(slot);
        }
    }

    /// Goes on with the clears begun, over at most `budget` tree nodes. Returns whether
    /// none is left. Clears begun together share their scans (see the tree's `clears`).
    pub fn clean_some(&mut self, budget: usize) -> bool {
        if self.clearing.is_empty() {
            return true;
        }
        let mut cleared = std::mem::take(&mut self.cleared);
        self.tree.clear_step(budget, &mut cleared);
        for c in cleared.drain(..) {
            let retired = if c.done {
                self.clearing.remove(&c.slot).unwrap_or(false)
            } else {
                self.clearing.get(&c.slot).copied().unwrap_or(false)
            };
            self.cleared(c.slot, c.removed, retired && c.done);
        }
        self.cleared = cleared;
        self.clearing.is_empty()
    }

    /// Whether clears begun are still going on.
    pub fn is_cleaning(&self) -> bool {
        !self.clearing.is_empty()
    }

    fn slots_of(&self, instance: &InstanceId) -> Vec<Slot> {
        self.slots.iter().filter(|(k, _)| &k.instance == instance).map(|(_, &s)| Slot(s)).collect()
    }

    /// Forgets everything every dp rank of `instance` held, keeping their slots.
    pub fn clear_instance(&mut self, instance: &InstanceId) {
        for slot in self.slots_of(instance) {
            self.clear_at(slot);
        }
    }

    /// Drops every dp rank of `instance` (it left); their slots are reused.
    pub fn remove_instance(&mut self, instance: &InstanceId) {
        let slots = self.slots_of(instance);
        self.retire_instance(instance);
        for slot in slots {
            self.finish_clear(slot);
        }
    }

    /// Drops every dp rank of `instance` (it left) at once from matches by key; what they
    /// held is cleared by [`KvIndex::clean_some`], and their slots are reused after that.
    pub fn retire_instance(&mut self, instance: &InstanceId) {
        for slot in self.slots_of(instance) {
            if let Some(key) = self.keys[slot.index()].take() {
                self.slots.remove(&key);
            }
            let held = self.held_at(slot) > 0;
            match self.clearing.get_mut(&slot.0) {
                Some(retired) => *retired = true,
                None if held => {
                    self.clearing.insert(slot.0, true);
                    self.tree.begin_clear(slot.0);
                }
                None => self.free.push(slot.0),
            }
        }
    }

    /// Blocks `key` holds.
    pub fn blocks_of(&self, key: &WorkerKey) -> usize {
        self.slot(key).map_or(0, |s| self.held_at(s))
    }

    /// Blocks the worker in `slot` holds.
    pub fn held_at(&self, slot: Slot) -> usize {
        self.held.get(slot.index()).copied().unwrap_or(0)
    }

    /// The blocks `key` holds.
    pub fn blocks(&self, key: &WorkerKey) -> Vec<BlockHash> {
        self.slot(key).map_or_else(Vec::new, |s| self.tree.blocks(s.0))
    }

    /// (block, worker) pairs held.
    pub fn len(&self) -> usize {
        self.entries
    }

    /// Whether the index is empty.
    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// How many leading blocks of `hashes` each worker holds (see [`Overlaps`]).
    pub fn overlaps(&self, hashes: &[BlockHash]) -> Overlaps<'_> {
        let mut run = Run::new();
        self.overlaps_into(hashes, &mut run);
        Overlaps { index: self, run }
    }

    /// [`KvIndex::overlaps`] into a caller's [`Run`]: afterwards it holds the leading
    /// blocks held by the worker in each slot below [`KvIndex::slot_capacity`]. One map
    /// lookup and one pass over the holders per tree edge the prompt crosses, plus a reset
    /// of the slots the previous query into `run` touched.
    pub fn overlaps_into(&self, hashes: &[BlockHash], run: &mut Run) {
        run.reset(self.keys.len());
        self.tree.overlaps(hashes, run);
    }
}

/// The result of [`KvIndex::overlaps`]: leading blocks held, per worker.
#[derive(Debug)]
pub struct Overlaps<'a> {
    index: &'a KvIndex,
    run: Run,
}

impl Overlaps<'_> {
    /// Leading blocks `key` holds (0 for unknown workers).
    pub fn get(&self, key: &WorkerKey) -> usize {
        self.index.slot(key).map_or(0, |s| self.at(s))
    }

    /// Leading blocks the worker in `slot` holds.
    pub fn at(&self, slot: Slot) -> usize {
        self.run.at(slot) as usize
    }

    /// Every worker holding at least the first block, with its run.
    pub fn iter(&self) -> impl Iterator<Item = (&WorkerKey, usize)> {
        self.run
            .held()
            .filter_map(|(s, r)| self.index.keys[s.index()].as_ref().map(|k| (k, r as usize)))
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
