//! Rank mapping between a prefill instance's topology and a decode's, as SGLang computes it:
//! which prefill ranks a decode rank reads from, how many decode peers a prefill rank waits
//! for, and which KV heads travel between a pair of ranks. Pure functions, checked against
//! the golden rows of BOOTSTRAP.md.

use std::ops::Range;

use crate::BootstrapError;

/// The prefill ranks one decode rank reads from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankPlan {
    /// Prefill tp ranks to read from.
    pub tp_ranks: Vec<usize>,
    /// Prefill pp ranks to read from.
    pub pp_ranks: Vec<usize>,
    /// Prefill cp ranks to read from.
    pub cp_ranks: Vec<usize>,
    /// Decode peers each of those prefill ranks waits for.
    pub peers: usize,
    /// Completion notices the decode rank waits for.
    pub responses: usize,
}

/// Parallel sizes of one side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallel {
    /// Attention tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// Context-parallel size.
    pub cp: usize,
}

/// Plans which prefill ranks decode rank (`tp_rank`, `pp_rank`) reads from.
/// `kv_cp_sharded`: the prefill shards KV across its cp ranks (then every cp rank sends).
pub fn plan_ranks(
    prefill: Parallel,
    decode: Parallel,
    tp_rank: usize,
    pp_rank: usize,
    kv_cp_sharded: bool,
) -> Result<RankPlan, BootstrapError> {
    let (p, d) = (prefill.tp, decode.tp);
    if p == 0 || d == 0 || prefill.pp == 0 || decode.pp == 0 || prefill.cp == 0 {
        return Err(BootstrapError::Topology("parallel sizes must be positive".into()));
    }
    if tp_rank >= d || pp_rank >= decode.pp {
        return Err(BootstrapError::Topology(format!(
            "decode rank tp {tp_rank} pp {pp_rank} outside tp {d} pp {}",
            decode.pp
        )));
    }
    if !tp_compatible(p, d) {
        return Err(BootstrapError::Topology(format!("tp sizes {p} and {d} do not divide")));
    }
    let peers = readers_per_sender(d, p);
    let (tp_ranks, mut responses) = if d >= p {
        (vec![tp_rank / peers], 1)
    } else {
        let k = p / d;
        ((tp_rank * k..(tp_rank + 1) * k).collect(), k)
    };
    let pp_ranks = if prefill.pp == decode.pp {
        vec![pp_rank]
    } else if decode.pp == 1 {
        responses *= prefill.pp;
        (0..prefill.pp).collect()
    } else {
        return Err(BootstrapError::Topology(format!(
            "prefill pp {} to decode pp {} is not supported",
            prefill.pp, decode.pp
        )));
    };
    let cp_ranks = if prefill.cp > 1 && kv_cp_sharded {
        responses *= prefill.cp;
        (0..prefill.cp).collect()
    } else {
        vec![0]
    };
    Ok(RankPlan { tp_ranks, pp_ranks, cp_ranks, peers, responses })
}

/// Which KV heads go from prefill tp rank `src_rank` to decode tp rank `dst_rank` (non-MLA).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadSlice {
    /// First head, in the prefill rank's local heads.
    pub src_start: usize,
    /// Heads sent.
    pub count: usize,
    /// Where they land, in the decode rank's local heads.
    pub dst_start: usize,
}

/// KV heads held by each rank of a tp group over `total_heads` heads.
pub fn heads_per_rank(tp: usize, total_heads: usize) -> usize {
    (total_heads / tp).max(1)
}

/// The global KV heads tp rank `rank` of a tp group holds (replicated when tp > heads).
pub fn rank_heads(tp: usize, total_heads: usize, rank: usize) -> Range<usize> {
    let n = heads_per_rank(tp, total_heads);
    let start = (rank / (tp / total_heads).max(1)) * n;
    start..start + n
}

/// SGLang's head slicing between prefill tp `p_tp` and decode tp `d_tp`.
pub fn head_slice(
    p_tp: usize,
    d_tp: usize,
    src_rank: usize,
    dst_rank: usize,
    total_heads: usize,
) -> HeadSlice {
    let src_heads = heads_per_rank(p_tp, total_heads);
    let dst_heads = heads_per_rank(d_tp, total_heads);
    if p_tp > d_tp {
        let unique = (src_rank % p_tp) / (p_tp / total_heads).max(1);
        HeadSlice { src_start: 0, count: src_heads, dst_start: (unique * src_heads) % dst_heads }
    } else {
        let unique = (dst_rank % d_tp) / (d_tp / total_heads).max(1);
        HeadSlice { src_start: (unique * dst_heads) % src_heads, count: dst_heads, dst_start: 0 }
    }
}

/// The layers pipeline rank `pp_rank` of `pp` holds, out of `layers`.
pub fn pp_layers(layers: usize, pp: usize, pp_rank: usize) -> Range<usize> {
    pp_rank * layers / pp..(pp_rank + 1) * layers / pp
}

#[cfg(test)]
mod tests;

/// How one prefill rank's KV shard lands in one decode rank's receive region.
///
/// A region holds the decode rank's heads for every layer, laid out
/// `[layer][k|v][local head][token][head_bytes]`; the shard is the runs
/// (layer in `layers`, k|v, head `src_head + i` -> local head `dst_head + i`, i < `heads`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shard {
    /// Layers the prefill rank holds (its pp slice).
    pub layers: Range<usize>,
    /// First global KV head sent.
    pub src_head: usize,
    /// First local head it lands on in the decode rank's region.
    pub dst_head: usize,
    /// Heads sent.
    pub heads: usize,
}

/// The receive region of one decode rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionLayout {
    /// All layers of the model.
    pub layers: usize,
    /// Heads per decode rank.
    pub heads: usize,
    /// Prompt tokens.
    pub tokens: usize,
    /// Bytes of one head of one token.
    pub head_bytes: usize,
}

impl RegionLayout {
    /// The region's size.
    pub fn len(&self) -> u64 {
        (self.layers * 2 * self.heads * self.tokens * self.head_bytes) as u64
    }

    /// Whether the region holds nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Byte offset of the run (layer, k|v, local head).
    pub fn run_offset(&self, layer: usize, kv: usize, head: usize) -> u64 {
        (((layer * 2 + kv) * self.heads + head) * self.tokens * self.head_bytes) as u64
    }

    /// Bytes of one run.
    pub fn run_len(&self) -> usize {
        self.tokens * self.head_bytes
    }

    /// Bytes a shard writes into this region.
    pub fn shard_bytes(&self, s: &Shard) -> u64 {
        (s.layers.len() * 2 * s.heads) as u64 * self.run_len() as u64
    }

    /// Where a shard writes into this region: per layer and K/V, the runs of its heads
    /// (adjacent in the region, so one range each).
    pub fn shard_ranges(&self, s: &Shard) -> Vec<Range<u64>> {
        let len = (s.heads * self.run_len()) as u64;
        s.layers
            .clone()
            .flat_map(|layer| (0..2).map(move |kv| (layer, kv)))
            .map(|(layer, kv)| {
                let at = self.run_offset(layer, kv, s.dst_head);
                at..at + len
            })
            .collect()
    }
}

/// The shard prefill rank (`src_tp`, `src_pp`) of tp `prefill.tp` / pp `prefill.pp` sends to
/// decode tp rank `dst_tp` of `decode_tp`, for a model of `layers` layers and `total_heads`
/// KV heads.
pub fn shard(
    prefill: Parallel,
    decode_tp: usize,
    src_tp: usize,
    src_pp: usize,
    dst_tp: usize,
    total_heads: usize,
    layers: usize,
) -> Shard {
    let s = head_slice(prefill.tp, decode_tp, src_tp, dst_tp, total_heads);
    Shard {
        layers: pp_layers(layers, prefill.pp, src_pp),
        src_head: rank_heads(prefill.tp, total_heads, src_tp).start + s.src_start,
        dst_head: s.dst_start,
        heads: s.count,
    }
}

/// How many decode tp ranks read from each prefill tp rank: a decode tp `decode_tp` larger
/// than the prefill's `prefill_tp` splits each prefill rank's heads among several; a smaller
/// or equal one has each decode rank read from one or more prefill ranks, each of those
/// sending to one. Callers check [`tp_compatible`] first; a prefill tp of 0 counts as 1.
pub fn readers_per_sender(decode_tp: usize, prefill_tp: usize) -> usize {
    (decode_tp / prefill_tp.max(1)).max(1)
}

/// Whether two tp sizes can be mapped onto each other: both positive, the larger a multiple
/// of the smaller.
pub fn tp_compatible(a: usize, b: usize) -> bool {
    a > 0 && b > 0 && a.max(b).is_multiple_of(a.min(b))
}
