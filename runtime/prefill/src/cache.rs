//! The prefix cache of one dp rank: KV pages keyed by their chained block hash, least
//! recently used first out under a byte budget. Because hashes are chained, the longest run
//! of leading prompt hashes present is a reusable prefix. A prompt's pages are touched last
//! page first, so within a prompt the tail is older than the head: eviction takes leaves
//! before the prefixes other prompts share (a prefix without its head is useless).
//!
//! Pages are views of the buffers they came in: a stored prompt's KV is kept whole rather
//! than copied page by page. The budget counts those buffers whole (what the process
//! holds), and after every call a buffer holds at most twice the bytes of its live pages:
//! a prompt whose new pages are half of its KV or less has them copied out, and a buffer
//! that eviction leaves half full or less has its survivors copied into one of their own,
//! unless they are the next pages eviction would take (a distinct prompt's head, right
//! behind its tail) and at most an eighth of the budget: then eviction takes them too. So
//! a hot prefix never pins much more than itself, a distinct prompt is not copied when it
//! goes, and a store may evict up to half a buffer more than it needed. Taking pages from a
//! buffer still more than half full frees nothing yet; those pages are gone all the same.
//!
//! A hash only names a page; a hit is decided by the page's own tokens and by the page it was
//! computed after. Block hashes are 64 bits of xxh3 with a public seed, so two prompts that
//! hash alike can be made on purpose; a cache that trusted them would answer one prompt with
//! another's KV. So each page keeps its tokens and the entry of the page stored before it,
//! and a hit runs only while both match the prompt. A store that finds another prompt's page
//! under one of its hashes (a collision, or a page whose predecessor went and was stored
//! again) puts its own in that place; schedulers are not told, the hash being cached still.
//! The pages computed after the one replaced are then unreachable (their predecessor's entry
//! is gone) until eviction takes them or their own prompt is stored again; meanwhile they
//! count against the budget and schedulers count them as cached.
//! The tokens kept (4 bytes a token, against kilobytes of KV) are not counted in the budget.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;

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

/// Survivors of a buffer that eviction takes too, when they are the next to go: at most
/// this share of the budget (a larger remnant is copied out rather than lost).
const FINISH_SHARE: usize = 8;

/// Names a [`Source`] within one cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
struct SourceId(u64);

/// One cached page.
#[derive(Debug)]
struct Page {
    /// The buffer it is a view of, and its page index there.
    source: SourceId,
    at: usize,
    /// Its LRU tick.
    tick: u64,
    /// The prompt page before it, and its index in the prompt.
    parent: Option<BlockHash>,
    depth: u32,
    /// Its tokens.
    tokens: Box<[u32]>,
    /// Its entry, never reused, and the entry of the page its KV was computed after.
    entry: u64,
    after: Option<u64>,
}

impl Page {
    /// Whether it is the page of `tokens` following the page entered as `after`: what a hit
    /// and a store ask of a page under the prompt's hash.
    fn continues(&self, after: Option<u64>, tokens: &[u32]) -> bool {
        self.after == after && *self.tokens == *tokens
    }
}

/// A buffer pages are views of: a stored prompt's KV, or a copy of some pages.
#[derive(Debug)]
struct Source {
    kv: Kv,
    /// The live page at each page index of `kv`, if any.
    slots: Vec<Option<BlockHash>>,
    live: usize,
    page_bytes: usize,
}

impl Source {
    /// Bytes of its live pages.
    fn live_bytes(&self) -> usize {
        self.live * self.page_bytes
    }

    /// Whether its live pages are half its buffer or less (and not none): due to be copied
    /// out.
    fn due(&self) -> bool {
        self.live > 0 && 2 * self.live_bytes() <= self.kv.byte_len()
    }

    /// What the budget counts for it once it is settled: nothing once empty, its live pages
    /// once they are due to be copied out, else its whole buffer.
    fn charge(&self) -> usize {
        if self.live == 0 {
            0
        } else if self.due() {
            self.live_bytes()
        } else {
            self.kv.byte_len()
        }
    }
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
    sources: HashMap<SourceId, Source>,
    next_source: u64,
    next_entry: u64,
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
            sources: HashMap::new(),
            next_source: 0,
            next_entry: 0,
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

    /// Whether a page hashed `h` is cached (nothing is touched): an estimate of a hit, which
    /// takes the page's tokens too.
    pub fn holds(&self, h: &BlockHash) -> bool {
        self.pages.contains_key(h)
    }

    /// The KV of the longest cached prefix of the prompt `tokens` with block hashes `hashes`
    /// (of its full pages, or of fewer), leaving at least one token to compute.
    pub fn lookup(&mut self, tokens: &[u32], hashes: &[BlockHash]) -> Option<Kv> {
        let max_pages = tokens.len().saturating_sub(1) / self.page_size;
        let mut hit = Vec::new();
        let mut after = None;
        for (h, own) in hashes.iter().zip(tokens.chunks_exact(self.page_size)).take(max_pages) {
            match self.pages.get(h) {
                Some(p) if p.continues(after, own) => after = Some(p.entry),
                _ => break,
            }
            hit.push(*h);
        }
        if hit.is_empty() {
            return None;
        }
        for h in hit.iter().rev() {
            self.touch(*h);
        }
        let pages = hit.iter().map(|h| {
            let p = &self.pages[h];
            (&self.sources[&p.source].kv, p.at)
        });
        let parts = runs(pages, self.page_size);
        Kv::gather(parts[0].0.shape(), &parts).ok()
    }

    /// Stores the full pages of `kv`, the KV of the prompt `tokens` with block hashes
    /// `hashes`, evicting the least recently used pages beyond the budget.
    pub fn store(&mut self, tokens: &[u32], hashes: &[BlockHash], kv: Kv) -> CacheDelta {
        let mut delta = CacheDelta::default();
        let full = hashes.len().min(kv.tokens().min(tokens.len()) / self.page_size);
        if kv.shape().token_bytes() * self.page_size <= self.budget {
            self.add_source(tokens, &hashes[..full], kv, &mut delta);
        }
        // Pages already present get younger; the head newest, so the prompt's own tail goes
        // before its prefix.
        let present = hashes.iter().take_while(|h| self.pages.contains_key(h)).count();
        for h in hashes[..present].iter().rev() {
            self.touch(*h);
        }
        self.evict(&mut delta);
        // A page stored and evicted in the same call is neither.
        let both: HashSet<BlockHash> =
            delta.stored.iter().filter(|h| !self.pages.contains_key(h)).copied().collect();
        if !both.is_empty() {
            delta.stored.retain(|h| !both.contains(h));
            delta.removed.retain(|h| !both.contains(h));
        }
        let first = delta.stored.first().and_then(|f| hashes.iter().position(|h| h == f));
        delta.parent = first.and_then(|i| i.checked_sub(1)).map(|i| hashes[i]);
        delta
    }

    /// Adds the pages of `hashes` not yet present as views of `kv`, in place of another
    /// prompt's page under the same hash (see the module docs), then settles the buffers
    /// touched (so a prompt whose new pages are half its KV or less has just those copied
    /// out).
    fn add_source(&mut self, tokens: &[u32], hashes: &[BlockHash], kv: Kv, delta: &mut CacheDelta) {
        let id = SourceId(self.next_source);
        let mut slots = vec![None; hashes.len()];
        let mut live = 0;
        let mut after = None;
        let mut replaced = Vec::new();
        for ((i, &h), own) in hashes.iter().enumerate().zip(tokens.chunks_exact(self.page_size)) {
            match self.pages.get(&h) {
                Some(p) if p.continues(after, own) => {
                    after = Some(p.entry);
                    continue;
                }
                // The prompt's own hashes repeat (made so): it is stored up to there.
                Some(p) if p.source == id => break,
                Some(_) => replaced.extend(self.unlink(h)),
                None => delta.stored.push(h),
            }
            slots[i] = Some(h);
            live += 1;
            self.tick += 1;
            self.next_entry += 1;
            let page = Page {
                source: id,
                at: i,
                tick: self.tick,
                parent: i.checked_sub(1).map(|j| hashes[j]),
                depth: i as u32,
                tokens: own.into(),
                entry: self.next_entry,
                after,
            };
            after = Some(page.entry);
            self.pages.insert(h, page);
            self.lru.insert(self.tick, h);
        }
        if live > 0 {
            self.next_source += 1;
            let page_bytes = kv.shape().token_bytes() * self.page_size;
            let source = Source { kv, slots, live, page_bytes };
            self.used += source.charge();
            self.sources.insert(id, source);
            replaced.push(id);
        }
        replaced.sort_unstable();
        replaced.dedup();
        for id in replaced {
            self.settle(id);
        }
    }

    /// Takes page `h` out of its buffer and the LRU order, leaving that buffer to be settled:
    /// its id.
    fn unlink(&mut self, h: BlockHash) -> Option<SourceId> {
        let page = self.pages.remove(&h)?;
        self.lru.remove(&page.tick);
        let source = self.sources.get_mut(&page.source)?;
        let before = source.charge();
        source.slots[page.at] = None;
        source.live -= 1;
        self.used = self.used - before + source.charge();
        Some(page.source)
    }

    /// Evicts least recently used pages until the settled buffers fit the budget, and on
    /// through a buffer left due to be copied while its pages are the next to go and few
    /// (see the module docs); then settles the buffers evictions touched: dropped once
    /// empty, their survivors copied out once half full or less.
    fn evict(&mut self, delta: &mut CacheDelta) {
        let mut touched = Vec::new();
        let mut cut = None;
        while self.used > self.budget || cut.is_some_and(|id| self.goes_next(id)) {
            let Some((&tick, &h)) = self.lru.first_key_value() else { break };
            let Some(id) = self.unlink(h) else {
                self.lru.remove(&tick);
                continue;
            };
            let source = &self.sources[&id];
            let few = source.live_bytes() <= self.budget / FINISH_SHARE;
            cut = (source.due() && few).then_some(id);
            touched.push(id);
            delta.removed.push(h);
        }
        touched.sort_unstable();
        touched.dedup();
        for id in touched {
            self.settle(id);
        }
    }

    /// Whether the next page eviction would take is one of source `id`'s.
    fn goes_next(&self, id: SourceId) -> bool {
        let next = self.lru.first_key_value().and_then(|(_, h)| self.pages.get(h));
        next.is_some_and(|p| p.source == id)
    }

    /// Drops source `id` if it has no live page, or copies its live pages into a buffer of
    /// their own if they are half of it or less.
    fn settle(&mut self, id: SourceId) {
        let Some(mut source) = self.sources.remove(&id) else { return };
        if source.live == 0 {
            return;
        }
        if source.due() {
            source.kv = self.live_pages(&source);
            source.slots.retain(Option::is_some);
            for (at, h) in source.slots.iter().flatten().enumerate() {
                if let Some(p) = self.pages.get_mut(h) {
                    p.at = at;
                }
            }
        }
        self.sources.insert(id, source);
    }

    /// A copy of `source`'s live pages, one after another.
    fn live_pages(&self, source: &Source) -> Kv {
        let live = source.slots.iter().enumerate().filter(|(_, s)| s.is_some());
        let parts = runs(live.map(|(i, _)| (&source.kv, i)), self.page_size);
        Kv::gather(source.kv.shape(), &parts).expect("pages within their own KV")
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.pages.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.pages.is_empty()
    }

    /// Bytes held: the buffers pages are views of, whole.
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

/// Pages given as (their buffer, their page index there), in order, as token ranges of
/// their buffers: pages that follow each other in one buffer make one range.
fn runs<'a>(
    pages: impl Iterator<Item = (&'a Kv, usize)>,
    page_size: usize,
) -> Vec<(&'a Kv, Range<usize>)> {
    let mut parts: Vec<(&Kv, Range<usize>)> = Vec::new();
    for (kv, at) in pages {
        let start = at * page_size;
        match parts.last_mut() {
            Some((last, r)) if std::ptr::eq(*last, kv) && r.end == start => r.end += page_size,
            _ => parts.push((kv, start..start + page_size)),
        }
    }
    parts
}

#[cfg(test)]
mod tests;
