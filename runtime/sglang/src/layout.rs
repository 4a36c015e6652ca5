//! How SGLang lays out a request's KV and metadata on the decode, and how that becomes our
//! engine's canonical KV.
//!
//! SGLang's MHA pool keeps, per layer, a K and a V buffer of pages; page `p` of buffer `i`
//! is at `kv_ptrs[i] + p * item_len`, rows within a page are tokens, each `[head][head_dim]`
//! (NHD). `kv_ptrs` lists all K buffers, then all V. The metadata ("aux") buffers hold one
//! row per request: `output_ids` first (the first token in slot 0), `bootstrap_room` last
//! (the room in slot 0, a u64).
//!
//! A receive region for one request packs exactly what the request needs: its pages of each
//! of the `2 * layers` buffers (pages 0..n, contiguous), then one row of each aux buffer per
//! prefill rank. The pointers SGLang is given point into that region, so every byte of it is
//! written exactly once: the pages by the prefill ranks' Mooncake connections, the rows by
//! them too or over ZMQ (two senders per rank, each bound to where its bytes come from).
//!
//! A prefill of attention TP `N` > 1 (the decode being TP 1) splits the KV heads: rank `t`
//! holds heads `[t * H/N, (t+1) * H/N)` and writes, for every page and token slot, just
//! those heads' bytes (SGLang's `send_kvcache_slice`), so each rank's share of the pages is
//! one small range per token slot. Every rank writes the metadata row too; each gets rows of
//! its own (the registration tells each rank its own metadata pointers), and all must agree.

use std::ops::Range;

use handoff_engine::{Kv, KvShape};

use crate::SglangError;

/// The row sizes of SGLang's metadata buffers without speculative decoding, sampling masks,
/// DSA or KV checksums (`MetadataBuffers.get_buf_infos()` order): output_ids, cached_tokens,
/// two logprob rows, two top-logprob rows, topk p and index, hidden states, bootstrap_room.
pub const AUX_ROW_BYTES: [usize; 10] = [64, 64, 64, 64, 512, 512, 64, 128, 64, 64];

/// The shape of the model's KV as SGLang pages it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SglangLayout {
    /// Transformer layers.
    pub layers: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Bytes of one head of one token (head_dim x element size).
    pub head_bytes: usize,
    /// Bytes of one row of each metadata buffer, in SGLang's order.
    pub aux_row_bytes: Vec<usize>,
}

/// Where one request's pages and rows sit in its receive region.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLayout {
    /// Pages per buffer.
    pub pages: usize,
    /// Offset of each K/V buffer's pages (all K, then all V).
    pub kv: Vec<u64>,
    /// Offset of each metadata row of rank 0; rank `t`'s are `t * rows` further.
    pub aux: Vec<u64>,
    /// Prefill ranks (attention TP), each writing its heads of every page and its own rows.
    pub ranks: usize,
    /// Bytes of one rank's metadata rows.
    pub rows: u64,
    /// The region's length.
    pub len: u64,
}

impl RequestLayout {
    /// Offsets of rank `rank`'s metadata rows.
    pub fn rows_of(&self, rank: usize) -> Vec<u64> {
        self.aux.iter().map(|a| a + rank as u64 * self.rows).collect()
    }

    /// Rank `rank`'s metadata rows, as one range of the region.
    pub fn rows_span(&self, rank: usize) -> Range<u64> {
        let start = self.aux.first().map_or(self.len, |a| a + rank as u64 * self.rows);
        start..start + self.rows
    }
}

impl SglangLayout {
    /// The pages of a model whose KV has `shape`, `page_size` tokens per page, with SGLang's
    /// metadata rows ([`AUX_ROW_BYTES`]).
    pub fn for_kv(shape: KvShape, page_size: usize) -> Self {
        SglangLayout {
            layers: shape.layers,
            page_size,
            kv_heads: shape.kv_heads,
            head_bytes: shape.head_bytes,
            aux_row_bytes: AUX_ROW_BYTES.to_vec(),
        }
    }

    /// Bytes of one page of one buffer.
    pub fn item_len(&self) -> usize {
        self.page_size * self.kv_heads * self.head_bytes
    }

    /// The region for a request of `tokens` tokens from one prefill rank.
    pub fn request(&self, tokens: usize) -> Result<RequestLayout, SglangError> {
        self.request_from(tokens, 1)
    }

    /// The region for a request of `tokens` tokens from a prefill of attention TP `ranks`:
    /// each rank must hold whole heads of its own (replicated heads, TP above the KV heads,
    /// are refused).
    pub fn request_from(&self, tokens: usize, ranks: usize) -> Result<RequestLayout, SglangError> {
        if self.page_size == 0 || self.kv_heads == 0 || self.head_bytes == 0 || self.layers == 0 {
            return Err(SglangError::Unsupported(format!("empty layout {self:?}")));
        }
        if ranks == 0 || !self.kv_heads.is_multiple_of(ranks) {
            return Err(SglangError::Unsupported(format!(
                "prefill attn tp {ranks} over {} KV heads: each rank must hold whole heads of its own",
                self.kv_heads
            )));
        }
        if self.aux_row_bytes.len() < 2 {
            return Err(SglangError::Unsupported("fewer than 2 metadata buffers".into()));
        }
        let pages = tokens.div_ceil(self.page_size).max(1);
        let too_big = || SglangError::Unsupported(format!("{tokens} tokens of {self:?}"));
        let buffer = pages.checked_mul(self.item_len()).ok_or_else(too_big)? as u64;
        buffer.checked_mul(2 * self.layers as u64 + 1).ok_or_else(too_big)?;
        let kv: Vec<u64> = (0..2 * self.layers as u64).map(|i| i * buffer).collect();
        let pages_end = 2 * self.layers as u64 * buffer;
        let mut at = pages_end;
        let aux = self
            .aux_row_bytes
            .iter()
            .map(|&row| {
                let here = at;
                at += row as u64;
                here
            })
            .collect();
        let rows = at - pages_end;
        let len = pages_end + rows * ranks as u64;
        Ok(RequestLayout { pages, kv, aux, ranks, rows, len })
    }

    /// The bytes of the pages rank `rank` of `req.ranks` writes: with one rank, all of them;
    /// otherwise its heads' slice of every token slot of every page.
    pub fn rank_pages(&self, req: &RequestLayout, rank: usize) -> Vec<Range<u64>> {
        let buffer = (req.pages * self.item_len()) as u64;
        if req.ranks <= 1 {
            return req.kv.iter().map(|&b| b..b + buffer).collect();
        }
        let slice = (self.kv_heads / req.ranks * self.head_bytes) as u64;
        let token_row = (self.kv_heads * self.head_bytes) as u64;
        let slots = (req.pages * self.page_size) as u64;
        let mut out = Vec::with_capacity(req.kv.len() * slots as usize);
        for &b in &req.kv {
            for slot in 0..slots {
                let start = b + slot * token_row + rank as u64 * slice;
                out.push(start..start + slice);
            }
        }
        out
    }

    /// The engine's KV for `tokens` tokens out of a filled region: page rows become
    /// `[layer][k|v][head][token]` runs. The element type must already match.
    pub fn to_kv(
        &self,
        req: &RequestLayout,
        region: &[u8],
        tokens: usize,
        shape: KvShape,
    ) -> Result<Kv, SglangError> {
        let ours = (shape.layers, shape.kv_heads, shape.head_bytes);
        if ours != (self.layers, self.kv_heads, self.head_bytes) {
            return Err(SglangError::Unsupported(format!(
                "SGLang pages of {} layers x {} heads x {} bytes, the engine wants {ours:?}",
                self.layers, self.kv_heads, self.head_bytes
            )));
        }
        if region.len() as u64 != req.len || tokens > req.pages * self.page_size {
            return Err(SglangError::Unsupported(format!(
                "{tokens} tokens from a region of {} bytes ({} pages)",
                region.len(),
                req.pages
            )));
        }
        // Appended in the canonical layout's order, so the buffer is never zeroed first.
        let mut data = Vec::with_capacity(shape.token_bytes() * tokens);
        let token_row = self.kv_heads * self.head_bytes;
        let hb = self.head_bytes;
        for layer in 0..self.layers {
            for side in 0..2 {
                let buffer = req.kv[side * self.layers + layer] as usize;
                for head in 0..self.kv_heads {
                    for t in 0..tokens {
                        let src = buffer + t * token_row + head * hb;
                        data.extend_from_slice(&region[src..src + hb]);
                    }
                }
            }
        }
        Kv::from_bytes(shape, tokens, data).map_err(|e| SglangError::Unsupported(e.to_string()))
    }
}

impl SglangLayout {
    /// The pages SGLang would hold for `kv` (the inverse of [`SglangLayout::to_kv`]): every
    /// K/V buffer's pages in turn, all K then all V, the last page zero-padded.
    pub fn pages_from_kv(&self, kv: &Kv) -> Result<Vec<u8>, SglangError> {
        let req = self.request(kv.tokens())?;
        let s = kv.shape();
        if (s.layers, s.kv_heads, s.head_bytes) != (self.layers, self.kv_heads, self.head_bytes) {
            return Err(SglangError::Unsupported(format!("KV of shape {s:?} for {self:?}")));
        }
        let mut out = vec![0u8; req.aux[0] as usize];
        let (hb, row) = (self.head_bytes, self.kv_heads * self.head_bytes);
        for layer in 0..self.layers {
            for side in 0..2 {
                let buffer = req.kv[side * self.layers + layer] as usize;
                for head in 0..self.kv_heads {
                    let run = kv.run(layer, side, head);
                    for t in 0..kv.tokens() {
                        let dst = buffer + t * row + head * hb;
                        out[dst..dst + hb].copy_from_slice(&run[t * hb..(t + 1) * hb]);
                    }
                }
            }
        }
        Ok(out)
    }
}

/// The first token, from rank `rank`'s `output_ids` row.
pub fn first_token(req: &RequestLayout, region: &[u8], rank: usize) -> u32 {
    let at = req.rows_span(rank).start as usize;
    region.get(at..at + 4).map_or(0, |b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// The room rank `rank`'s `bootstrap_room` row (the last) names; 0 if it was never written.
pub fn room(req: &RequestLayout, region: &[u8], rank: usize) -> u64 {
    let Some(at) = req.rows_of(rank).last().map(|&a| a as usize) else { return 0 };
    region.get(at..at + 8).map_or(0, |b| {
        let mut w = [0u8; 8];
        w.copy_from_slice(b);
        u64::from_le_bytes(w)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> SglangLayout {
        SglangLayout {
            layers: 2,
            page_size: 4,
            kv_heads: 2,
            head_bytes: 3,
            aux_row_bytes: AUX_ROW_BYTES.to_vec(),
        }
    }

    #[test]
    fn a_request_region_packs_its_pages_then_one_row_per_buffer() {
        let l = layout();
        let r = l.request(6).unwrap();
        assert_eq!((r.pages, l.item_len()), (2, 24));
        assert_eq!(r.kv, vec![0, 48, 96, 144]);
        assert_eq!(r.aux[0], 192);
        assert_eq!(r.len, 192 + AUX_ROW_BYTES.iter().sum::<usize>() as u64);
    }

    #[test]
    fn page_rows_become_canonical_runs() {
        let l = layout();
        let r = l.request(6).unwrap();
        // Byte = buffer * 64 + token * 8 + head * 4 + i: every byte says where it came from.
        let mut region = vec![0u8; r.len as usize];
        for (b, &off) in r.kv.iter().enumerate() {
            for t in 0..8 {
                for h in 0..2 {
                    for i in 0..3 {
                        let at = off as usize + t * 6 + h * 3 + i;
                        region[at] = (b * 64 + t * 8 + h * 4 + i) as u8;
                    }
                }
            }
        }
        let shape = KvShape { layers: 2, kv_heads: 2, head_bytes: 3 };
        let kv = l.to_kv(&r, &region, 6, shape).unwrap();
        for layer in 0..2 {
            for side in 0..2 {
                for h in 0..2 {
                    let b = side * 2 + layer;
                    let want: Vec<u8> = (0..6)
                        .flat_map(|t| (0..3).map(move |i| (b * 64 + t * 8 + h * 4 + i) as u8))
                        .collect();
                    assert_eq!(kv.run(layer, side, h), &want[..], "layer {layer} side {side}");
                }
            }
        }
        let wrong = KvShape { layers: 2, kv_heads: 2, head_bytes: 6 };
        assert!(l.to_kv(&r, &region, 6, wrong).is_err());
        // And back: the pages of the first 6 tokens, the rest of the last page zero.
        let pages = l.pages_from_kv(&kv).unwrap();
        let back = l.to_kv(&r, &[pages.as_slice(), &region[pages.len()..]].concat(), 6, shape);
        assert!(back.unwrap() == kv);
        assert!(pages[6 * 6..8 * 6].iter().all(|&b| b == 0), "padding rows are zero");
    }

    #[test]
    fn head_sliced_ranks_split_every_token_slot_and_get_rows_of_their_own() {
        let l = layout();
        let one = l.request(6).unwrap();
        let r = l.request_from(6, 2).unwrap();
        assert_eq!((r.ranks, r.rows), (2, one.len - one.aux[0]));
        assert_eq!(r.len, one.len + r.rows, "a second set of rows");
        assert_eq!(r.rows_of(1)[0], r.aux[0] + r.rows);
        assert_eq!(r.rows_span(1), r.aux[0] + r.rows..r.len);
        // Rank t writes head t of every token slot: 3 bytes at slot * 6 + t * 3.
        let (a, b) = (l.rank_pages(&r, 0), l.rank_pages(&r, 1));
        assert_eq!(a.len(), 4 * 8, "one range per buffer and token slot (2 pages of 4)");
        assert_eq!((a[1].clone(), b[1].clone()), (6..9, 9..12));
        let mut all: Vec<_> = a.into_iter().chain(b).collect();
        all.sort_by_key(|x| x.start);
        let mut at = 0;
        for x in &all {
            assert_eq!(x.start, at, "the ranks' slices tile the pages, disjoint");
            at = x.end;
        }
        assert_eq!(at, r.aux[0]);
        assert_eq!(l.rank_pages(&one, 0), one.kv.iter().map(|&k| k..k + 48).collect::<Vec<_>>());
        for ranks in [0, 3, 4] {
            assert!(l.request_from(6, ranks).is_err(), "tp {ranks} over 2 heads");
        }
    }

    #[test]
    fn the_room_and_first_token_rows() {
        let l = layout();
        let r = l.request(1).unwrap();
        let mut region = vec![0u8; r.len as usize];
        assert_eq!(room(&r, &region, 0), 0);
        let at = *r.aux.last().unwrap() as usize;
        region[at..at + 8].copy_from_slice(&0x0123_4567_89ab_cdefu64.to_le_bytes());
        region[r.aux[0] as usize..r.aux[0] as usize + 4].copy_from_slice(&31337u32.to_le_bytes());
        assert_eq!(room(&r, &region, 0), 0x0123_4567_89ab_cdef);
        assert_eq!(first_token(&r, &region, 0), 31337);
    }
}
