//! Chained block hashes of a prompt: `h0 = xxh3(tokens[0..page])`,
//! `hi = xxh3(h(i-1) ++ tokens of page i)`, tokens as little-endian u32, with a fixed seed.
//! Only full pages are hashed; the same function runs on the frontend, the scheduler and the
//! prefill, so a hash names a prefix, not just a page.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::BlockHash;

/// The seed every side uses.
pub const BLOCK_HASH_SEED: u64 = 0x68616e646f666621; // "handoff!"

/// The chained hashes of every full page of `tokens`.
pub fn block_hashes(tokens: &[u32], page_size: usize) -> Vec<BlockHash> {
    assert!(page_size > 0, "page_size must be positive");
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut buf = Vec::with_capacity(8 + page_size * 4);
    let mut prev: Option<BlockHash> = None;
    for page in tokens.chunks_exact(page_size) {
        let h = chain_into(&mut buf, prev, page);
        out.push(h);
        prev = Some(h);
    }
    out
}

/// The hash of `page` following the page whose hash is `prev` (`None`: the first page).
pub fn chain_page(prev: Option<BlockHash>, page: &[u32]) -> BlockHash {
    chain_into(&mut Vec::with_capacity(8 + page.len() * 4), prev, page)
}

fn chain_into(buf: &mut Vec<u8>, prev: Option<BlockHash>, page: &[u32]) -> BlockHash {
    buf.clear();
    if let Some(p) = prev {
        buf.extend_from_slice(&p.0.to_le_bytes());
    }
    for t in page {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    BlockHash(xxh3_64_with_seed(buf, BLOCK_HASH_SEED))
}

#[cfg(test)]
mod tests;
