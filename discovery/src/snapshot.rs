//! [`Snapshots`]: an instance's KV snapshots, taken whole and served in pages. A scheduler
//! resyncing asks for page 0 (a new snapshot is taken, or the newest reused if nothing has
//! changed since), then for the next pages by the snapshot's id; every page of one snapshot
//! is of the same moment. The few newest snapshots are kept, so schedulers resyncing at the
//! same time do not cost one copy each, and the memory they hold is bounded.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use handoff_core::{BlockHash, InstanceId};

use crate::events::{KvSnapshot, SnapshotAsk};

/// Blocks per page: a block and its parent are at most 42 bytes of JSON, so a full page
/// stays under 700 KiB, within nats-server's default 1 MiB payload limit.
pub const PAGE_BLOCKS: usize = 16_384;

/// Snapshots kept at once: as many scheduler replicas can page through their own at the
/// same time (more, resyncing under traffic, evict each other's and retry at their next
/// trigger).
const KEPT: usize = 8;

/// Everything the caches held at one moment: per dp rank, blocks (parents first) and their
/// parents.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Taken {
    /// The last KV event number it includes.
    pub seq: u64,
    /// The process that numbered the events ([`KvEvent::incarnation`](crate::KvEvent)).
    pub incarnation: u64,
    /// Blocks per dp rank, parents before children.
    pub dp_blocks: Vec<Vec<BlockHash>>,
    /// Each block's parent, parallel to `dp_blocks`.
    pub dp_parents: Vec<Vec<Option<BlockHash>>>,
}

#[derive(Debug)]
struct Kept {
    id: u64,
    taken: Taken,
    /// (dp rank, offset) where each page starts.
    starts: Vec<(usize, usize)>,
}

impl Kept {
    fn new(id: u64, taken: Taken, page_blocks: usize) -> Self {
        let mut starts = vec![(0, 0)];
        let mut room = page_blocks;
        for (dp, blocks) in taken.dp_blocks.iter().enumerate() {
            let mut at = 0;
            while blocks.len() - at > room {
                at += room;
                starts.push((dp, at));
                room = page_blocks;
            }
            room -= blocks.len() - at;
        }
        Kept { id, taken, starts }
    }

    fn page(&self, instance: &InstanceId, page: u32) -> Option<KvSnapshot> {
        let k = page as usize;
        let &(from_dp, from) = self.starts.get(k)?;
        let (to_dp, to) = self.starts.get(k + 1).copied().unwrap_or((usize::MAX, 0));
        let mut dp_blocks = Vec::with_capacity(self.taken.dp_blocks.len());
        let mut dp_parents = Vec::with_capacity(self.taken.dp_blocks.len());
        for (dp, blocks) in self.taken.dp_blocks.iter().enumerate() {
            let lo = if dp < from_dp {
                blocks.len()
            } else if dp == from_dp {
                from
            } else {
                0
            };
            let hi = if dp < to_dp {
                blocks.len()
            } else if dp == to_dp {
                to
            } else {
                0
            };
            let range = lo..hi.max(lo);
            dp_blocks.push(blocks[range.clone()].to_vec());
            let parents = self.taken.dp_parents.get(dp).filter(|p| p.len() == blocks.len());
            dp_parents.push(parents.map_or_else(Vec::new, |p| p[range].to_vec()));
        }
        Some(KvSnapshot {
            instance: instance.clone(),
            seq: self.taken.seq,
            incarnation: self.taken.incarnation,
            dp_blocks,
            dp_parents,
            snapshot: self.id,
            page,
            pages: self.starts.len() as u32,
        })
    }
}

/// An instance's recent snapshots (see the module docs).
#[derive(Debug)]
pub struct Snapshots {
    instance: InstanceId,
    page_blocks: usize,
    kept: Mutex<(u64, VecDeque<Arc<Kept>>)>,
}

/// Why a page was not served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageError {
    /// The snapshot is no longer kept (or never was): start again from page 0.
    #[error("snapshot {0} is no longer kept; ask for a new one")]
    Gone(u64),
    /// The snapshot has no such page.
    #[error("snapshot {snapshot} has {pages} pages, not page {page}")]
    NoPage {
        /// The snapshot.
        snapshot: u64,
        /// The page asked for.
        page: u32,
        /// Its pages.
        pages: u32,
    },
}

impl Snapshots {
    /// Snapshots of `instance`, in pages of [`PAGE_BLOCKS`].
    pub fn new(instance: InstanceId) -> Self {
        Self::with_page_blocks(instance, PAGE_BLOCKS)
    }

    /// Snapshots in pages of `page_blocks` blocks (at least 1).
    pub fn with_page_blocks(instance: InstanceId, page_blocks: usize) -> Self {
        Snapshots { instance, page_blocks: page_blocks.max(1), kept: Mutex::default() }
    }

    /// Answers `ask`: page 0 of a new snapshot (taken with `take`, unless the newest kept
    /// one is as of `seq` already), or the asked page of a kept one.
    pub fn page(
        &self,
        ask: SnapshotAsk,
        seq: u64,
        take: impl FnOnce() -> Taken,
    ) -> Result<KvSnapshot, PageError> {
        let kept = if ask.snapshot == 0 {
            self.newest_as_of(seq).unwrap_or_else(|| self.keep(take()))
        } else {
            self.find(ask.snapshot).ok_or(PageError::Gone(ask.snapshot))?
        };
        let page = if ask.snapshot == 0 { 0 } else { ask.page };
        kept.page(&self.instance, page).ok_or(PageError::NoPage {
            snapshot: kept.id,
            page,
            pages: kept.starts.len() as u32,
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, VecDeque<Arc<Kept>>)> {
        self.kept.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn newest_as_of(&self, seq: u64) -> Option<Arc<Kept>> {
        self.lock().1.back().filter(|k| k.taken.seq == seq).cloned()
    }

    fn find(&self, id: u64) -> Option<Arc<Kept>> {
        self.lock().1.iter().find(|k| k.id == id).cloned()
    }

    fn keep(&self, taken: Taken) -> Arc<Kept> {
        let mut kept = self.lock();
        kept.0 += 1;
        let k = Arc::new(Kept::new(kept.0, taken, self.page_blocks));
        kept.1.push_back(k.clone());
        while kept.1.len() > KEPT {
            kept.1.pop_front();
        }
        k
    }
}

#[cfg(test)]
mod tests;
