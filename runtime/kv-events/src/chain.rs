//! [`WorkerChains`]: one engine worker's stored blocks, mapped onto handoff's chained page
//! hashes (`handoff_core::hash`), so that a request's own hashes match what the engine holds.
//!
//! Engine hashes are never trusted or recomputed: they are handles. For each engine block the
//! map keeps where our chain stands after it (the hash of our last full page, and the tokens
//! after it), and which of our pages hold its tokens. A store continues from its parent's
//! point (or from the empty prefix), appends its tokens, and cuts full pages of our size, so
//! any engine block size works (vLLM's 16, SGLang's 1, ours configurable): a page that spans
//! engine blocks belongs to all of them, and removing any of them removes it (conservative).
//! Blocks we cannot match exactly are not stored at all: LoRA adapters, extra keys
//! (multimodal, cache salts), tiers other than the device, secondary KV groups. Never a false
//! match.
//!
//! The index can lose a worker's entries while the engine keeps its cache (a gap in the
//! events with no replay, a worker silenced for a while): [`WorkerChains::forget_index`]
//! keeps the map and marks every block as not in the index. An engine stores only blocks new
//! to its cache, never a hit again, so a hot prefix would otherwise stay out of the index
//! for as long as the engine holds it: a store continuing a block not in the index first
//! stores the chain it continues (the engine naming a parent holds it). A block the engine
//! holds twice (vLLM does not de-duplicate identical blocks) leaves at its last copy's
//! removal.

use std::collections::HashMap;

use handoff_core::BlockHash;
use handoff_core::hash::chain_page;

use crate::decode::{EngineHash, Event};

/// What the index should do for one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexOp {
    /// Store `blocks` (chained, in order) after `parent`.
    Store {
        /// Our hash of the page before the first block, if any.
        parent: Option<BlockHash>,
        /// Our page hashes.
        blocks: Vec<BlockHash>,
    },
    /// Remove these pages.
    Remove {
        /// Our page hashes.
        blocks: Vec<BlockHash>,
    },
    /// Remove every page of the worker.
    Clear,
}

/// Why an event could not be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChainError {
    /// The event continues a block this map does not know: its prefix tokens are missing,
    /// so our hashes cannot be computed. The worker must be recovered (replay, or clear and
    /// rebuild).
    #[error("parent block {0:#x} is unknown")]
    UnknownParent(EngineHash),
    /// The event's tokens do not fill its blocks.
    #[error("{tokens} tokens for {blocks} blocks of {block_size}")]
    Inconsistent {
        /// Tokens sent.
        tokens: usize,
        /// Blocks named.
        blocks: usize,
        /// Tokens per block.
        block_size: u32,
    },
}

/// Where our chain stands after an engine block, and which of our pages hold its tokens.
#[derive(Debug, Clone, Default)]
struct Point {
    /// Our hash of the last full page.
    last: Option<BlockHash>,
    /// Tokens after it (fewer than a page).
    tail: Vec<u32>,
    /// Engine blocks with tokens in `tail`.
    tail_owners: Vec<EngineHash>,
    /// Our pages holding this block's tokens.
    pages: Vec<BlockHash>,
    /// Earlier blocks that share one of this block's pages (their tokens began it): when
    /// this block goes, its pages leave their lists too, so a hot prefix's last block does
    /// not collect a page for every continuation ever stored after it.
    co_owners: Vec<EngineHash>,
    /// The first `own` of `pages` end in this block (the rest are later blocks' pages this
    /// one's tokens began).
    own: usize,
    /// Our hash of the last full page before this block's own pages.
    before: Option<BlockHash>,
    /// The engine block it continues.
    parent: Option<EngineHash>,
    /// The index epoch its pages were last stored in (see [`WorkerChains::forget_index`]).
    indexed: u64,
    /// How many copies of it the engine holds (stored again without a removal between); 0
    /// after events were lost: held once or not at all, not known (a removal missed).
    copies: u32,
}

/// One worker's engine blocks (see the module docs). Bounded: past `max_blocks` the map is
/// cleared with the worker's index entries, and rebuilt from new events.
#[derive(Debug)]
pub struct WorkerChains {
    page_size: usize,
    max_blocks: usize,
    points: HashMap<EngineHash, Point>,
    /// Bumped when the index loses the worker's entries: points stored in an earlier epoch
    /// are not in the index.
    epoch: u64,
    /// Events skipped because we cannot match them exactly.
    pub skipped: u64,
}

impl WorkerChains {
    /// A worker whose pages are hashed `page_size` tokens at a time (ours), remembering at
    /// most `max_blocks` engine blocks.
    pub fn new(page_size: usize, max_blocks: usize) -> Self {
        assert!(page_size > 0, "page_size must be positive");
        WorkerChains { page_size, max_blocks, points: HashMap::new(), epoch: 0, skipped: 0 }
    }

    /// Engine blocks known.
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether none are.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }

    /// Forgets every block (the worker's index entries must be cleared with it).
    pub fn reset(&mut self) {
        self.points.clear();
    }

    /// The index lost the worker's entries (cleared) while the engine kept its cache: every
    /// block known stays, marked as not in the index, stored there again when a store
    /// continues it. When `events_lost`, removals may have been missed: how many copies of
    /// each block the engine holds is not known (a store of one again is its one copy, a
    /// removal of it its last).
    pub fn forget_index(&mut self, events_lost: bool) {
        self.epoch += 1;
        if events_lost {
            for p in self.points.values_mut() {
                p.copies = 0;
            }
        }
    }

    /// What `event` means for the index.
    pub fn apply(&mut self, event: &Event) -> Result<Vec<IndexOp>, ChainError> {
        match event {
            Event::Stored {
                hashes,
                parent,
                token_ids,
                block_size,
                lora_name,
                namespaced,
                spec_kind,
                medium,
                extra_keys,
                group_idx,
                ..
            } => {
                let exact = lora_name.is_none()
                    && !namespaced
                    && !extra_keys
                    && on_device(medium.as_deref())
                    && group_idx.unwrap_or(0) == 0
                    && full_attention(spec_kind.as_deref());
                if !exact {
                    self.skipped += 1;
                    return Ok(Vec::new());
                }
                self.stored(hashes, *parent, token_ids, *block_size)
            }
            Event::Removed { hashes, medium, group_idx } => {
                // Another group's eviction (a sliding window's, in a hybrid model) says nothing
                // of the main group's copy of the same block.
                if !on_device(medium.as_deref()) || group_idx.unwrap_or(0) != 0 {
                    return Ok(Vec::new());
                }
                let mut blocks = Vec::new();
                for h in hashes {
                    if let Some(p) = self.points.get_mut(h).filter(|p| p.copies > 1) {
                        p.copies -= 1;
                        continue;
                    }
                    let Some(gone) = self.points.remove(h) else { continue };
                    for co in &gone.co_owners {
                        if let Some(p) = self.points.get_mut(co) {
                            p.pages.retain(|page| !gone.pages.contains(page));
                        }
                    }
                    blocks.extend(gone.pages);
                }
                Ok(if blocks.is_empty() { Vec::new() } else { vec![IndexOp::Remove { blocks }] })
            }
            Event::Cleared => {
                self.points.clear();
                Ok(vec![IndexOp::Clear])
            }
            Event::Unknown(_) => {
                self.skipped += 1;
                Ok(Vec::new())
            }
        }
    }

    fn stored(
        &mut self,
        hashes: &[EngineHash],
        parent: Option<EngineHash>,
        tokens: &[u32],
        block_size: u32,
    ) -> Result<Vec<IndexOp>, ChainError> {
        let bs = block_size as usize;
        if hashes.is_empty() || tokens.len() != hashes.len() * bs {
            return Err(ChainError::Inconsistent {
                tokens: tokens.len(),
                blocks: hashes.len(),
                block_size,
            });
        }
        let start = match parent {
            None => Point::default(),
            Some(p) => {
                let known = self.points.get(&p).ok_or(ChainError::UnknownParent(p))?;
                Point { pages: Vec::new(), co_owners: Vec::new(), ..known.clone() }
            }
        };
        let mut ops = Vec::new();
        if self.points.len() + hashes.len() > self.max_blocks {
            self.points.clear();
            ops.push(IndexOp::Clear);
            if parent.is_some() {
                // Its parent went with the rest: rebuilt from the next unparented store.
                return Ok(ops);
            }
        }
        if let Some(p) = parent {
            ops.extend(self.reindex(p));
        }
        let first_parent = start.last;
        let mut at = start;
        let mut new_pages = Vec::new();
        let mut block_parent = parent;
        for (h, block) in hashes.iter().zip(tokens.chunks_exact(bs)) {
            let (mut pages, mut co_owners) = (Vec::new(), Vec::new());
            let before = at.last;
            at.tail_owners.push(*h);
            for &t in block {
                at.tail.push(t);
                if at.tail.len() == self.page_size {
                    let page = chain_page(at.last, &at.tail);
                    at.tail.clear();
                    at.last = Some(page);
                    new_pages.push(page);
                    pages.push(page);
                    // The blocks before this one that had tokens in the page hold it too.
                    for owner in at.tail_owners.drain(..).filter(|o| o != h) {
                        if let Some(p) = self.points.get_mut(&owner)
                            && !p.pages.contains(&page)
                        {
                            p.pages.push(page);
                            co_owners.push(owner);
                        }
                    }
                    at.tail_owners.push(*h);
                }
            }
            if at.tail.is_empty() {
                at.tail_owners.clear();
            }
            let point = Point {
                own: pages.len(),
                pages,
                co_owners,
                before,
                parent: block_parent,
                indexed: self.epoch,
                copies: 1,
                ..at.clone()
            };
            match self.points.get_mut(h) {
                // The same block again (its tokens after the same parent): another copy.
                Some(p) if p.parent == block_parent && p.before == before => {
                    p.copies = p.copies.saturating_add(1);
                    p.indexed = self.epoch;
                }
                _ => {
                    self.points.insert(*h, point);
                }
            }
            block_parent = Some(*h);
        }
        if !new_pages.is_empty() {
            ops.push(IndexOp::Store { parent: first_parent, blocks: new_pages });
        }
        Ok(ops)
    }
}

impl WorkerChains {
    /// Stores `from` and the blocks it continues that are not in the index (this epoch),
    /// up to one that is, or the start of the prompt, or one no longer known: their own
    /// pages, in order, after the page before the first of them. Nothing when `from` is in.
    fn reindex(&mut self, from: EngineHash) -> Option<IndexOp> {
        let mut chain = Vec::new();
        let mut at = Some(from);
        // At most every block once: a parent cycle (a hostile engine's) ends the walk.
        while let Some(h) = at.filter(|_| chain.len() < self.points.len()) {
            match self.points.get(&h) {
                Some(p) if p.indexed != self.epoch => {
                    chain.push(h);
                    at = p.parent;
                }
                _ => break,
            }
        }
        let top = self.points.get(chain.last()?)?.before;
        let mut blocks = Vec::new();
        for h in chain.iter().rev() {
            if let Some(p) = self.points.get_mut(h) {
                blocks.extend_from_slice(&p.pages[..p.own]);
                p.indexed = self.epoch;
                // Continued, so held.
                p.copies = p.copies.max(1);
            }
        }
        (!blocks.is_empty()).then_some(IndexOp::Store { parent: top, blocks })
    }
}

fn on_device(medium: Option<&str>) -> bool {
    matches!(medium, None | Some("GPU"))
}

/// Whether a KV cache of this kind holds every block of a prompt (a sliding window's, say,
/// does not), so its blocks match a request's prefix.
fn full_attention(kind: Option<&str>) -> bool {
    matches!(kind, None | Some("full_attention" | "mla_attention"))
}

#[cfg(test)]
mod tests;
