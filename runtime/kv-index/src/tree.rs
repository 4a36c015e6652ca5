//! The radix tree under the index. Each node is an edge: a run of chained block hashes held
//! by the same set of workers. A map from every block hash to (node, position) finds any
//! block in one lookup, so a match walks a prompt one *node* at a time: one lookup and a
//! slice comparison per edge, then one pass over that edge's holders. A prefix shared by a
//! thousand workers is walked once, not once per worker per block.
//!
//! Links are a parent id and a child count: enough to delete emptied leaves upward and to
//! merge a node into its only child when both have the same holders. A split keeps the id on
//! the tail so the tail's children keep pointing at it; only the head's map entries move.
//! A stored run whose parent block is unknown starts a detached root; matches still find it
//! through the map (hashes are chained, so a block names its whole prefix).
//!
//! A prompt's first block is stored first in a run with no parent, so a second, smaller map
//! holds just the blocks ever stored that way (while they are in the map): a query's first
//! block is looked up there first, and a miss never touches the big map (at a million
//! blocks, that lookup is a cache miss). Each entry also remembers the root whose edge
//! begins with it, kept as splits and merges move a root's head; a hint that does not check
//! out (the start is not a root's head) falls back to the big map. A run that is not a
//! chain can hide a prompt start inside it; such a start is found again once any worker
//! stores it first.

mod clears;

use handoff_core::BlockHash;

pub(crate) use clears::Cleared;
use clears::Clears;

use crate::block_map::BlockMap;
use crate::run::Run;
use crate::slot_set::SlotSet;

const NIL: u32 = u32::MAX;

#[derive(Debug)]
struct Node {
    /// The edge; empty only while the node is free.
    blocks: Vec<BlockHash>,
    /// Position of `blocks[0]` along the path from this node's root.
    start: u32,
    parent: u32,
    children: u32,
    holders: SlotSet,
}

#[derive(Debug, Clone, Copy)]
struct Loc {
    node: u32,
    pos: u32,
}

/// See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Tree {
    nodes: Vec<Node>,
    free: Vec<u32>,
    map: BlockMap<Loc>,
    /// The blocks in `map` ever stored first in a run with no parent (the possible starts
    /// of a prompt), each with the root whose edge begins with it, or [`NIL`].
    firsts: BlockMap<u32>,
    /// Clears in progress ([`clears`]). While any is, freed ids are not reused.
    clears: Clears,
}

/// How many leading hashes `a` and `b` share: eight at a time while whole chunks match (the
/// common case: a prompt running along an edge), then one at a time.
fn common_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let same = a.chunks_exact(8).zip(b.chunks_exact(8)).take_while(|(x, y)| x == y).count() * 8;
    same + a[same..].iter().zip(&b[same..]).take_while(|(x, y)| x == y).count()
}

impl Tree {
    fn alloc(&mut self, node: Node) -> u32 {
        let reuse = if self.clears.is_empty() { self.free.pop() } else { None };
        match reuse {
            Some(id) => {
                self.nodes[id as usize] = node;
                id
            }
            None => {
                self.nodes.push(node);
                (self.nodes.len() - 1) as u32
            }
        }
    }

    fn node(&self, id: u32) -> &Node {
        &self.nodes[id as usize]
    }

    fn node_mut(&mut self, id: u32) -> &mut Node {
        &mut self.nodes[id as usize]
    }

    /// The node holding `h`, and `h`'s offset in its edge.
    fn find(&self, h: BlockHash) -> Option<(u32, usize)> {
        let loc = self.map.get(&h)?;
        Some((loc.node, (loc.pos - self.node(loc.node).start) as usize))
    }

    /// [`Tree::find`] for a query's first block: `None` at once unless it is a known start,
    /// and straight to its root when the hint checks out.
    fn find_first(&self, h: BlockHash) -> Option<(u32, usize)> {
        let &root = self.firsts.get(&h)?;
        let hinted = self.nodes.get(root as usize);
        match hinted {
            Some(n) if n.start == 0 && n.blocks.first() == Some(&h) => Some((root, 0)),
            _ => self.find(h),
        }
    }

    /// Points the start entry of root `id`'s first block (if it is a start) at `id`.
    fn root_moved(&mut self, id: u32) {
        let n = &self.nodes[id as usize];
        if n.start == 0
            && let Some(first) = n.blocks.first()
            && let Some(root) = self.firsts.get_mut(first)
        {
            *root = id;
        }
    }

    /// Splits `id` before edge offset `k` (0 < k < edge length). The head becomes a new node;
    /// `id` keeps the tail, so its children stay attached. Returns the head.
    fn split(&mut self, id: u32, k: usize) -> u32 {
        let n = self.node_mut(id);
        let head = Node {
            blocks: n.blocks.drain(..k).collect(),
            start: n.start,
            parent: n.parent,
            children: 1,
            holders: n.holders.clone(),
        };
        n.start += k as u32;
        let hid = self.alloc(head);
        self.node_mut(id).parent = hid;
        let Tree { nodes, map, .. } = self;
        for b in &nodes[hid as usize].blocks {
            if let Some(l) = map.get_mut(b) {
                l.node = hid;
            }
        }
        self.root_moved(hid);
        hid
    }

    /// Makes edge offsets `[off, off + n)` of `id` a node of its own; returns it.
    fn isolate(&mut self, mut id: u32, off: usize, n: usize) -> u32 {
        if off > 0 {
            self.split(id, off);
        }
        if n < self.node(id).blocks.len() {
            id = self.split(id, n);
        }
        id
    }

    /// Folds `id`'s parent into it while that parent has no other child and the same holders.
    fn merge_up(&mut self, id: u32) {
        loop {
            let p = self.node(id).parent;
            if p == NIL {
                return;
            }
            let (parent, node) = (self.node(p), self.node(id));
            if parent.children != 1 || parent.holders != node.holders {
                return;
            }
            let parent = std::mem::replace(
                self.node_mut(p),
                Node {
                    blocks: Vec::new(),
                    start: 0,
                    parent: NIL,
                    children: 0,
                    holders: SlotSet::default(),
                },
            );
            self.free.push(p);
            for b in &parent.blocks {
                if let Some(l) = self.map.get_mut(b) {
                    l.node = id;
                }
            }
            let n = self.node_mut(id);
            let mut blocks = parent.blocks;
            blocks.extend_from_slice(&n.blocks);
            n.blocks = blocks;
            n.start = parent.start;
            n.parent = parent.parent;
            self.root_moved(id);
        }
    }

    /// Deletes `id` if nobody holds it and it has no children, then its parent likewise.
    fn prune(&mut self, mut id: u32) {
        while id != NIL {
            let n = self.node(id);
            if n.blocks.is_empty() || !n.holders.is_empty() || n.children > 0 {
                return;
            }
            let parent = n.parent;
            let blocks = std::mem::take(&mut self.node_mut(id).blocks);
            for b in &blocks {
                self.map.remove(b);
                self.firsts.remove(b);
            }
            self.free.push(id);
            if parent != NIL {
                self.node_mut(parent).children -= 1;
            }
            id = parent;
        }
    }

    /// Adds `slot` as a holder of the chained run `blocks`, whose first block follows
    /// `parent` (`None`: it starts a prompt, or the parent is unknown), adding at most
    /// `budget` (block, holder) pairs and keeping at most `max_blocks` blocks in the tree.
    /// Returns the pairs added.
    ///
    /// The second bound is for blocks nobody holds: a node whose holders all evicted it
    /// stays while a child is held, so (block, holder) pairs alone do not bound the tree.
    pub(crate) fn store(
        &mut self,
        slot: u32,
        parent: Option<BlockHash>,
        blocks: &[BlockHash],
        budget: usize,
        max_blocks: usize,
    ) -> usize {
        let (mut added, mut i) = (0, 0);
        let mut prev = parent;
        while i < blocks.len() && added < budget {
            let n = if let Some((id, off)) = self.find(blocks[i]) {
                let node = self.node(id);
                let mut n = common_prefix(&node.blocks[off..], &blocks[i..]);
                if !node.holders.contains(slot) {
                    n = n.min(budget - added);
                    let t = self.isolate(id, off, n);
                    self.node_mut(t).holders.insert(slot);
                    added += n;
                    self.merge_up(t);
                }
                n
            } else {
                let room = (budget - added).min(max_blocks.saturating_sub(self.map.len()));
                if room == 0 {
                    break;
                }
                let n = self.grow(slot, prev, &blocks[i..], room);
                added += n;
                n
            };
            prev = Some(blocks[i + n - 1]);
            i += n;
        }
        // A run with no parent begins a prompt: its first block is a start (if it is held at
        // all, by this worker or, over budget, by another).
        if parent.is_none()
            && let Some(&first) = blocks.first()
            && let Some(loc) = self.map.get(&first)
        {
            let root = if loc.pos == 0 { loc.node } else { NIL };
            self.firsts.insert(first, root);
        }
        added
    }

    /// Places the leading unknown blocks of `blocks` (at least one, at most `room`) after
    /// `prev`: appended to its edge when that edge is a leaf held by `slot` alone (a worker
    /// extending its own sequence), else as a new node under it. Returns how many it took.
    fn grow(
        &mut self,
        slot: u32,
        prev: Option<BlockHash>,
        blocks: &[BlockHash],
        room: usize,
    ) -> usize {
        let at = prev.and_then(|h| self.find(h));
        let (id, appending) = match at {
            Some((id, off)) if off + 1 == self.node(id).blocks.len() => {
                let n = self.node(id);
                if n.children == 0 && n.holders.is_only(slot) {
                    (id, true)
                } else {
                    (self.new_node(slot, id), false)
                }
            }
            Some((id, off)) => {
                let head = self.split(id, off + 1);
                (self.new_node(slot, head), false)
            }
            None => (self.new_node(slot, NIL), false),
        };
        let Tree { nodes, map, .. } = self;
        let node = &mut nodes[id as usize];
        node.blocks.reserve(blocks.len().min(room));
        let before = node.blocks.len();
        for &b in blocks.iter().take(room) {
            if !map.insert_new(b, Loc { node: id, pos: node.start + node.blocks.len() as u32 }) {
                break;
            }
            node.blocks.push(b);
        }
        let n = node.blocks.len() - before;
        if !appending {
            self.merge_up(id);
        }
        n
    }

    /// An empty leaf held by `slot` under `parent` (its edge is filled by the caller).
    fn new_node(&mut self, slot: u32, parent: u32) -> u32 {
        let start = match parent {
            NIL => 0,
            p => {
                let p = self.node_mut(p);
                p.children += 1;
                p.start + p.blocks.len() as u32
            }
        };
        self.alloc(Node {
            blocks: Vec::new(),
            start,
            parent,
            children: 0,
            holders: SlotSet::one(slot),
        })
    }

    /// Drops `slot` as a holder of `blocks`. Returns the (block, holder) pairs removed.
    pub(crate) fn remove(&mut self, slot: u32, blocks: &[BlockHash]) -> usize {
        let (mut removed, mut i) = (0, 0);
        while i < blocks.len() {
            let Some((id, off)) = self.find(blocks[i]) else {
                i += 1;
                continue;
            };
            let node = self.node(id);
            let n = common_prefix(&node.blocks[off..], &blocks[i..]);
            if node.holders.contains(slot) {
                let t = self.isolate(id, off, n);
                self.node_mut(t).holders.remove(slot);
                removed += n;
                if self.node(t).holders.is_empty() {
                    self.prune(t);
                } else {
                    self.merge_up(t);
                }
            }
            i += n;
        }
        removed
    }

    /// The blocks `slot` holds.
    pub(crate) fn blocks(&self, slot: u32) -> Vec<BlockHash> {
        self.nodes
            .iter()
            .filter(|n| n.holders.contains(slot))
            .flat_map(|n| n.blocks.iter().copied())
            .collect()
    }

    /// For each slot, how many leading blocks of `hashes` it holds without a gap, into `run`
    /// (zeroed, one entry per slot).
    pub(crate) fn overlaps(&self, hashes: &[BlockHash], run: &mut Run) {
        let (run, touched) = run.parts_mut();
        let mut i = 0;
        while i < hashes.len() {
            let found = if i == 0 { self.find_first(hashes[0]) } else { self.find(hashes[i]) };
            let Some((id, off)) = found else { break };
            let node = self.node(id);
            let n = common_prefix(&node.blocks[off..], &hashes[i..]);
            let (from, to) = (i as u32, (i + n) as u32);
            let mut extended = false;
            if i == 0 {
                // Every holder of the first node starts a run: these are all the slots the
                // query touches (later nodes only extend them).
                node.holders.for_each(|s| {
                    run[s] = to;
                    touched.push(s as u32);
                    extended = true;
                });
                i += n;
                if !extended {
                    break;
                }
                continue;
            }
            // Branch-free: whether a holder extends is data, not control flow.
            node.holders.for_each(|s| {
                let r = &mut run[s];
                let hit = *r == from;
                *r = if hit { to } else { *r };
                extended |= hit;
            });
            if !extended {
                break;
            }
            i += n;
        }
    }

    /// Blocks in the tree, held or not.
    #[cfg(test)]
    pub(crate) fn block_count(&self) -> usize {
        self.map.len()
    }

    /// Live nodes (for tests of compression).
    #[cfg(test)]
    pub(crate) fn node_count(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Checks the links and the map against the nodes (for tests).
    #[cfg(test)]
    pub(crate) fn check(&self) {
        let mut children = vec![0u32; self.nodes.len()];
        let mut blocks = 0;
        for (id, n) in self.nodes.iter().enumerate() {
            if n.blocks.is_empty() {
                continue;
            }
            blocks += n.blocks.len();
            assert!(!n.holders.is_empty() || n.children > 0, "node {id} is empty and a leaf");
            if n.parent != NIL {
                let p = self.node(n.parent);
                assert!(!p.blocks.is_empty(), "node {id} has a freed parent");
                assert_eq!(p.start + p.blocks.len() as u32, n.start, "node {id} not contiguous");
                children[n.parent as usize] += 1;
            }
            for (k, b) in n.blocks.iter().enumerate() {
                let l = *self.map.get(b).expect("a node's block is in the map");
                assert_eq!((l.node, l.pos), (id as u32, n.start + k as u32), "map of node {id}");
            }
        }
        assert_eq!(blocks, self.map.len(), "map has stray blocks");
        assert!(
            self.firsts.iter().all(|(b, _)| self.map.contains_key(b)),
            "firsts has stray blocks"
        );
        for (b, &root) in self.firsts.iter() {
            // Every start that heads a root points at it (a stale hint would cost a lookup).
            let l = self.map.get(b).expect("a start is in the map");
            if l.pos == 0 {
                assert_eq!(root, l.node, "start {b:?} points elsewhere");
            }
        }
        for (id, n) in self.nodes.iter().enumerate() {
            if !n.blocks.is_empty() {
                assert_eq!(n.children, children[id], "child count of node {id}");
            }
        }
        let _ = self.node_count();
    }
}
