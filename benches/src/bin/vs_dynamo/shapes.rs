//! What both indexes hold and what they are asked.
//!
//! Two stored shapes: today's (each of W instances stores 16 sequences of 64 blocks that all
//! share a 32-block prefix) and many distinct prompts (256 sequences of 16 blocks per
//! instance, nothing shared: 4,096 prompts at W = 16, 131,072 at W = 512). Three query
//! shapes over either: a full hit (a stored sequence), a partial hit (its first three
//! quarters, then blocks nobody holds) and a miss (nothing anybody holds). Query `q` asks
//! about instance `q % W`'s sequence `(q / W) % per_worker`, so the queries walk every prompt.

use handoff_core::BlockHash;
use handoff_discovery::{KvEvent, KvEventKind};

/// What every instance stores.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Stored {
    pub(crate) name: &'static str,
    /// Sequences per instance.
    pub(crate) per_worker: u64,
    /// Blocks per sequence.
    pub(crate) depth: u64,
    /// Leading blocks every sequence shares.
    pub(crate) prefix: u64,
}

/// Today's shape: a shared system prompt.
pub(crate) const SHARED: Stored =
    Stored { name: "shared prefix", per_worker: 16, depth: 64, prefix: 32 };
/// Thousands of distinct prompts, no prefix shared.
pub(crate) const DISTINCT: Stored =
    Stored { name: "distinct prompts", per_worker: 256, depth: 16, prefix: 0 };

/// What a query asks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ask {
    Hit,
    Partial,
    Miss,
}

impl Ask {
    pub(crate) const ALL: [Ask; 3] = [Ask::Hit, Ask::Partial, Ask::Miss];

    pub(crate) fn name(self) -> &'static str {
        match self {
            Ask::Hit => "hit",
            Ask::Partial => "partial",
            Ask::Miss => "miss",
        }
    }
}

impl Stored {
    /// Block `d` of instance `w`'s sequence `s`.
    pub(crate) fn block(&self, w: u64, s: u64, d: u64) -> u64 {
        if d < self.prefix { d + 1 } else { (w + 1) << 40 | (s + 1) << 16 | d }
    }

    /// Instance `w`'s sequence `s`.
    pub(crate) fn sequence(&self, w: u64, s: u64) -> Vec<u64> {
        (0..self.depth).map(|d| self.block(w, s, d)).collect()
    }

    /// The event that stores instance `w`'s sequence `s` in our scheduler (number `seq`).
    pub(crate) fn event(&self, w: u64, s: u64, seq: u64) -> KvEvent {
        let blocks = self.sequence(w, s).into_iter().map(BlockHash).collect();
        KvEvent {
            instance: handoff_benches::worker(w).instance,
            dp_rank: 0,
            seq,
            incarnation: 0,
            kind: KvEventKind::Stored { parent: None, blocks },
        }
    }

    /// Query `q` of shape `ask` over `w_count` instances.
    pub(crate) fn query(&self, ask: Ask, w_count: u64, q: u64) -> Vec<u64> {
        let (w, s) = (q % w_count, (q / w_count) % self.per_worker);
        // Blocks nobody stores: bit 62 is never set in a stored block.
        let fresh = |d: u64| 1 << 62 | q << 16 | d;
        match ask {
            Ask::Hit => self.sequence(w, s),
            Ask::Partial => {
                let keep = self.depth * 3 / 4;
                let mut v: Vec<u64> = self.sequence(w, s).into_iter().take(keep as usize).collect();
                v.extend((keep..self.depth).map(fresh));
                v
            }
            Ask::Miss => (0..self.depth).map(fresh).collect(),
        }
    }
}
