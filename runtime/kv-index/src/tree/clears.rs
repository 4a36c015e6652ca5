//! Clears of slots, a bounded step at a time, in shared passes.
//!
//! A clear drops a slot as a holder from every node: a scan of the whole tree. Slots cleared
//! together (a fleet's resyncs after a bus outage, a rack's instances gone at once) share one
//! pass: each step scans a range of nodes once for every slot riding the pass. A clear begun
//! while a pass runs waits for the next one, with every other clear begun meanwhile, so n
//! clears begun within one pass's time cost two passes, not n (at a thousand instances and
//! millions of nodes, n passes held a scheduler's lock for tens of seconds).
//!
//! A pass's cursor is sound for all its slots: while any clear is in progress freed ids are
//! not reused, so a node holding a riding slot lies at or past the cursor (a split's head is
//! a new id at the end; a merge keeps the child's id, and merges only nodes with the same
//! holders).

use super::Tree;

/// Up to this many slots in a pass, each is tested on every node; more, a node's holders
/// are looked up among them (a step then costs what the nodes' holder sets do).
const FEW_RIDING: usize = 8;

/// A step's work, per node of its budget: a node scanned is one; a (block, holder) pair
/// removed, and a block leaving the tree, one each.
const WORK_PER_NODE: usize = 4;

/// The clears in progress.
#[derive(Debug, Default)]
pub(super) struct Clears {
    /// The pass under way: the next node to scan, and its slots, sorted.
    cursor: u32,
    riding: Vec<u32>,
    /// Slots waiting for the next pass.
    waiting: Vec<u32>,
}

impl Clears {
    pub(super) fn is_empty(&self) -> bool {
        self.riding.is_empty() && self.waiting.is_empty()
    }
}

/// What a step of a clear did for one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cleared {
    pub(crate) slot: u32,
    /// (block, holder) pairs removed.
    pub(crate) removed: usize,
    /// Whether the slot is clear now.
    pub(crate) done: bool,
}

impl Tree {
    /// Begins clearing `slot` (nothing may be stored for it until it is done): it joins the
    /// next pass. Begun already, nothing changes.
    pub(crate) fn begin_clear(&mut self, slot: u32) {
        let c = &mut self.clears;
        if c.riding.binary_search(&slot).is_err() && !c.waiting.contains(&slot) {
            c.waiting.push(slot);
        }
    }

    /// Goes on with the clears begun over at most `budget` nodes, into `out`: each riding
    /// slot that lost something or is done.
    pub(crate) fn clear_step(&mut self, budget: usize, out: &mut Vec<Cleared>) {
        if self.clears.riding.is_empty() {
            let mut next = std::mem::take(&mut self.clears.waiting);
            next.sort_unstable();
            self.clears.riding = next;
            self.clears.cursor = 0;
        }
        if self.clears.riding.is_empty() {
            return;
        }
        let from = self.clears.cursor as usize;
        let end = from.saturating_add(budget.max(1)).min(self.nodes.len());
        let riding = &self.clears.riding;
        let mut removed = vec![0usize; riding.len()];
        let (mut emptied, mut hit) = (Vec::new(), Vec::new());
        // The work of a step is its nodes and the pairs it removes (each emptied node's blocks
        // leave the maps too): a dense stretch, where every node holds riding slots, ends the
        // step sooner, so its lock is held about as long as a sparse one's.
        let (mut to, mut work) = (from, 0usize);
        while to < end && work < budget.max(1) * WORK_PER_NODE {
            let n = &mut self.nodes[to];
            hit.clear();
            if riding.len() <= FEW_RIDING {
                // Each riding slot tested: a node held by a thousand workers is not walked.
                hit.extend((0..riding.len()).filter(|&at| n.holders.contains(riding[at])));
            } else {
                n.holders.for_each(|s| {
                    if let Ok(at) = riding.binary_search(&(s as u32)) {
                        hit.push(at);
                    }
                });
            }
            for &at in &hit {
                n.holders.remove(riding[at]);
                removed[at] += n.blocks.len();
                work += n.blocks.len();
            }
            if !hit.is_empty() && n.holders.is_empty() {
                emptied.push(to as u32);
                work += n.blocks.len();
            }
            work += 1;
            to += 1;
        }
        for id in emptied {
            self.prune(id);
        }
        let done = to >= self.nodes.len();
        for (&slot, &removed) in self.clears.riding.iter().zip(&removed) {
            if removed > 0 || done {
                out.push(Cleared { slot, removed, done });
            }
        }
        if done {
            self.clears.riding.clear();
        } else {
            self.clears.cursor = to as u32;
        }
    }

    /// Finishes the clear of `slot` at once (a scan from where its pass is, or of the whole
    /// tree): the pairs removed, or `None` with no clear of it begun.
    pub(crate) fn finish_clear(&mut self, slot: u32) -> Option<usize> {
        let c = &mut self.clears;
        let from = if let Ok(at) = c.riding.binary_search(&slot) {
            c.riding.remove(at);
            c.cursor as usize
        } else if let Some(at) = c.waiting.iter().position(|&s| s == slot) {
            c.waiting.swap_remove(at);
            0
        } else {
            return None;
        };
        let (mut removed, mut emptied) = (0, Vec::new());
        for (id, n) in self.nodes[from..].iter_mut().enumerate() {
            if n.holders.remove(slot) {
                removed += n.blocks.len();
                if n.holders.is_empty() {
                    emptied.push((from + id) as u32);
                }
            }
        }
        for id in emptied {
            self.prune(id);
        }
        Some(removed)
    }
}
