//! The prefix cache of one dp rank: KV pages keyed by their chained block hash, least
//! recently used first out under a byte budget. Because hashes are chained, the longest run
//! of leading prompt hashes present is a reusable prefix. A prompt's pages are touched last
//! page first, so within a prompt the tail is older than the head: eviction takes leaves
//! before the prefixes other prompts share (a prefix without its head is useless).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use handoff_core::BlockHash;
use handoff_engine::Kv;

/// What a store changed, for KV events.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct CacheDelta {
    /// Pages newly stored, in prompt order.
    pub stored: Vec<BlockHash>,
    /// The prompt's page before the first stored one, if any.
    pub parent: Option<BlockHash>,
    /// Pages evicted.
    pub removed: Vec<BlockHash>,
}

/// One cached page.
#[derive(Debug)]
struct Page {
    kv: Arc<Kv>,
    /// Its LRU tick.
    tick: u64,
    /// The prompt page before it, and its index in the prompt.
    parent: Option<BlockHash>,
    depth: u32,
}

/// A prefix cache (see the module docs).
#[derive(Debug)]
pub struct PrefixCache {
    budget: usize,
    page_size: usize,
    used: usize,
    tick: u64,
    pages: HashMap<BlockHash, Page>,
    lru: BTreeMap<u64, BlockHash>,
}

impl PrefixCache {
    /// An empty cache of `budget` bytes for pages of `page_size` tokens.
    pub fn new(budget: usize, page_size: usize) -> Self {
        PrefixCache {
            budget,
            page_size,
            used: 0,
            tick: 0,
            pages: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    fn touch(&mut self, h: BlockHash) {
        if let Some(p) = self.pages.get_mut(&h) {
            self.lru.remove(&p.tick);
            self.tick += 1;
            p.tick = self.tick;
            self.lru.insert(self.tick, h);
        }
    }

    /// The KV of the longest cached prefix of a prompt of `prompt_len` tokens with block
    /// hashes `hashes`, leaving at least one token to compute.
    pub fn lookup(&mut self, hashes: &[BlockHash], prompt_len: usize) -> Option<Kv> {
        let max_pages = (prompt_len - 1) / self.page_size;
        let hit: Vec<BlockHash> = hashes
            .iter()
            .take(max_pages)
            .take_while(|h| self.pages.contains_key(h))
            .copied()
            .collect();
        if hit.is_empty() {
            return None;
        }
        for h in hit.iter().rev() {
            self.touch(*h);
        }
        let pages: Vec<&Kv> = hit.iter().map(|h| &*self.pages[h].kv).collect();
        Kv::concat(pages[0].shape(), &pages).ok()
    }

    /// Stores the full pages of `kv` (the KV of a prompt with hashes `hashes`), evicting the
    /// least recently used pages beyond the budget.
    pub fn store(&mut self, hashes: &[BlockHash], kv: &Kv) -> CacheDelta {
        let mut delta = CacheDelta::default();
        for (i, &h) in hashes.iter().enumerate() {
            let end = (i + 1) * self.page_size;
            if end > kv.tokens() {
                break;
            }
            if self.pages.contains_key(&h) {
                self.touch(h);
                continue;
            }
            let page = kv.slice_tokens(i * self.page_size..end);
            let size = page.as_bytes().len();
            if size > self.budget {
                break;
            }
            self.tick += 1;
            self.used += size;
            let parent = i.checked_sub(1).map(|j| hashes[j]);
            let page = Page { kv: Arc::new(page), tick: self.tick, parent, depth: i as u32 };
            self.pages.insert(h, page);
            self.lru.insert(self.tick, h);
            delta.stored.push(h);
        }
        // Head newest: the prompt's own tail goes before its prefix.
        let present = hashes.iter().take_while(|h| self.pages.contains_key(h)).count();
        for h in hashes[..present].iter().rev() {
            self.touch(*h);
        }
        while self.used > self.budget {
            let Some((_, h)) = self.lru.pop_first() else { break };
            if let Some(p) = self.pages.remove(&h) {
                self.used -= p.kv.as_bytes().len();
                delta.removed.push(h);
            }
        }
        // A page stored and evicted in the same call is neither.
        let both: Vec<BlockHash> =
            delta.stored.iter().filter(|h| !self.pages.contains_key(h)).copied().collect();
        delta.stored.retain(|h| !both.contains(h));
        delta.removed.retain(|h| !both.contains(h));
        let first = delta.stored.first().and_then(|f| hashes.iter().position(|h| h == f));
        delta.parent = first.and_then(|i| i.checked_sub(1)).map(|i| hashes[i]);
        delta
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Bytes held.
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    /// Every cached block with the prompt page before it, parents before children (by
    /// depth in the prompt), for a snapshot.
    pub fn blocks(&self) -> Vec<(Option<BlockHash>, BlockHash)> {
        let mut all: Vec<(u32, Option<BlockHash>, BlockHash)> =
            self.pages.iter().map(|(h, p)| (p.depth, p.parent, *h)).collect();
        all.sort_unstable_by_key(|(d, _, h)| (*d, *h));
        all.into_iter().map(|(_, parent, h)| (parent, h)).collect()
    }
}

#[cfg(test)]
mod tests;
