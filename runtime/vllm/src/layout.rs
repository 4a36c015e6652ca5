//! How a vLLM worker's KV cache holds a request's tokens, and how the blocks read from a
//! prefill's tensor-parallel ranks become our engine's canonical KV.
//!
//! vLLM 0.33 registers one NIXL region per attention layer, K and V packed in the content
//! dimension (each head of each token is `[K | V]`, `2 * head_size` elements), `block_size`
//! tokens per block (`base_worker.py`: "each attention layer is a single NIXL region").
//! Inside a block (vLLM's metadata names the layout by its `KVCacheLayout` name):
//! - `LBHNC` (alias `HND`, which its NIXL connector picks for attention models):
//!   `[head][token][K | V]`;
//! - `LBNHC` (alias `NHD`): `[token][head][K | V]`.
//!
//! A prefill of TP `N` splits the KV heads: rank `r` holds heads `[r * H/N, (r+1) * H/N)` of
//! every layer, and its blocks are `1/N` the length. The element type is the decode's: a
//! block whose length is not `heads * block_size * 2 * head_bytes` is refused (a prefill
//! caching bf16 for a decode computing f32 is a configuration error, not something to guess).

use handoff_engine::{Kv, KvShape};

use crate::{AgentMetadata, Blocks, VllmError};

/// One prefill rank's cache description and the blocks read from it (the request's first
/// blocks, in order).
pub type RankBlocks<'a> = (&'a AgentMetadata, &'a Blocks);

/// Where head `h`, token `t` of a block starts, in units of one head's `[K | V]`.
fn slot(heads_outer: bool, heads: usize, block_size: usize, h: usize, t: usize) -> usize {
    if heads_outer { h * block_size + t } else { t * heads + h }
}

/// Checks that `meta`, one of `ranks` TP ranks, caches `shape`'s KV as this decode reads it:
/// one region per layer, whole heads per rank, blocks of the decode's element type.
pub fn check(meta: &AgentMetadata, shape: KvShape, ranks: usize) -> Result<(), VllmError> {
    let unsupported = |s: String| Err(VllmError::Unsupported(s));
    if meta.regions() != shape.layers {
        return unsupported(format!(
            "{} KV regions for a model of {} layers (vLLM 0.33 registers one per layer)",
            meta.regions(),
            shape.layers
        ));
    }
    if ranks == 0 || !shape.kv_heads.is_multiple_of(ranks) {
        return unsupported(format!(
            "prefill tp {ranks} over {} KV heads: each rank must hold whole heads of its own",
            shape.kv_heads
        ));
    }
    let block_size = usize::try_from(meta.block_size).unwrap_or(0);
    if block_size == 0 || block_size > 4096 {
        return unsupported(format!("block size {}", meta.block_size));
    }
    let want = (shape.kv_heads / ranks * block_size * 2 * shape.head_bytes) as u64;
    if let Some(&len) = meta.block_lens.iter().find(|&&l| l != want) {
        return unsupported(format!(
            "blocks of {len} bytes where this decode's model has {want} ({} heads per rank x {block_size} tokens x 2 x {} bytes): the prefill's KV dtype or head size is not the decode's",
            shape.kv_heads / ranks,
            shape.head_bytes
        ));
    }
    Ok(())
}

/// The canonical KV of the first `tokens` tokens from the blocks read from every rank of the
/// prefill, rank `r` at `ranks[r]`, each checked with [`check`] and all of one block size.
pub fn kv_from_ranks(
    shape: KvShape,
    tokens: usize,
    ranks: &[RankBlocks<'_>],
) -> Result<Kv, VllmError> {
    let Some((first, _)) = ranks.first() else {
        return Err(VllmError::Invalid("no prefill rank to read from".into()));
    };
    let block_size = first.block_size as usize;
    let blocks = tokens.div_ceil(block_size.max(1));
    let heads = shape.kv_heads / ranks.len().max(1);
    let hb = shape.head_bytes;
    let block_len = heads * block_size * 2 * hb;
    for (r, (meta, read)) in ranks.iter().enumerate() {
        check(meta, shape, ranks.len())?;
        if meta.block_size as usize != block_size || meta.heads_outer() != first.heads_outer() {
            return Err(VllmError::Unsupported(format!(
                "prefill rank {r} caches blocks of {} tokens in {}, rank 0 of {block_size} in {}",
                meta.block_size, meta.kv_cache_layout, first.kv_cache_layout
            )));
        }
        if read.bytes.len() != shape.layers * blocks * block_len {
            return Err(VllmError::Invalid(format!(
                "{} bytes read from rank {r} for {blocks} blocks of {block_len} bytes in {} layers",
                read.bytes.len(),
                shape.layers
            )));
        }
    }
    // Appended in the canonical layout's order (layer, k|v, head, token), so the buffer is
    // never zeroed first; rank r holds heads r * heads .. (r + 1) * heads.
    let heads_outer = first.heads_outer();
    let mut data = Vec::with_capacity(shape.token_bytes() * tokens);
    for layer in 0..shape.layers {
        for part in 0..2 {
            for g in 0..shape.kv_heads {
                let (read, h) = (&ranks[g / heads].1, g % heads);
                for token in 0..tokens {
                    let (b, t) = (token / block_size, token % block_size);
                    let block = read.block(layer, b, block_len);
                    let at = slot(heads_outer, heads, block_size, h, t) * 2 * hb + part * hb;
                    data.extend_from_slice(&block[at..at + hb]);
                }
            }
        }
    }
    Kv::from_bytes(shape, tokens, data).map_err(|e| VllmError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests;
