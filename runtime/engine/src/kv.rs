//! The canonical KV layout: `[layer][k|v][head][token][head_bytes]`, head-major so that one
//! (layer, k|v, head) run of tokens is contiguous. Shards by KV head (tp) and by layer (pp)
//! are then lists of contiguous runs, which is what the transfer seam moves.

use std::ops::Range;

use crate::EngineError;

/// The shape of one token's KV.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KvShape {
    /// Transformer layers.
    pub layers: usize,
    /// KV heads (after grouped-query sharing).
    pub kv_heads: usize,
    /// Bytes of one head of one token (head_dim x element size).
    pub head_bytes: usize,
}

impl KvShape {
    /// Bytes of one token's KV across all layers and heads.
    pub fn token_bytes(&self) -> usize {
        self.layers * 2 * self.kv_heads * self.head_bytes
    }
}

/// The KV of a run of tokens, in the canonical layout.
#[derive(Clone, PartialEq, Eq)]
pub struct Kv {
    shape: KvShape,
    tokens: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for Kv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kv").field("shape", &self.shape).field("tokens", &self.tokens).finish()
    }
}

impl Kv {
    /// Zeroed KV for `tokens` tokens.
    pub fn zeroed(shape: KvShape, tokens: usize) -> Self {
        Kv { shape, tokens, data: vec![0; shape.token_bytes() * tokens] }
    }

    /// Wraps bytes already in the canonical layout.
    pub fn from_bytes(shape: KvShape, tokens: usize, data: Vec<u8>) -> Result<Self, EngineError> {
        if data.len() != shape.token_bytes() * tokens {
            return Err(EngineError::KvShape(format!(
                "{} bytes for {tokens} tokens of {} bytes each",
                data.len(),
                shape.token_bytes()
            )));
        }
        Ok(Kv { shape, tokens, data })
    }

    /// The shape of one token.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// All bytes, canonical layout.
    pub fn as_bytes(&self) -> &[u8] {
        &self.data
    }

    /// Byte range of the run (layer, k|v, head) for tokens `toks`.
    pub fn run_range(
        &self,
        layer: usize,
        kv: usize,
        head: usize,
        toks: Range<usize>,
    ) -> Range<usize> {
        run_range(self.shape, self.tokens, layer, kv, head, toks)
    }

    /// The bytes, canonical layout.
    pub fn into_bytes(self) -> Vec<u8> {
        self.data
    }

    /// The bytes of one (layer, k|v, head) run over all tokens.
    pub fn run(&self, layer: usize, kv: usize, head: usize) -> &[u8] {
        &self.data[self.run_range(layer, kv, head, 0..self.tokens)]
    }

    /// Mutable bytes of one (layer, k|v, head) run over all tokens.
    pub fn run_mut(&mut self, layer: usize, kv: usize, head: usize) -> &mut [u8] {
        let r = self.run_range(layer, kv, head, 0..self.tokens);
        &mut self.data[r]
    }

    /// Byte range of layer `layer` (its K and V runs of every head over all tokens: one
    /// contiguous run of the layout).
    pub fn layer_range(&self, layer: usize) -> Range<usize> {
        let len = 2 * self.shape.kv_heads * self.tokens * self.shape.head_bytes;
        layer * len..(layer + 1) * len
    }

    /// The bytes of layer `layer`.
    pub fn layer(&self, layer: usize) -> &[u8] {
        &self.data[self.layer_range(layer)]
    }

    /// Mutable bytes of layer `layer`.
    pub fn layer_mut(&mut self, layer: usize) -> &mut [u8] {
        let r = self.layer_range(layer);
        &mut self.data[r]
    }

    /// A copy of tokens `toks` (each run's slice appended in layout order: no zeroing first).
    ///
    /// Panics if `toks` is not within the KV's tokens.
    pub fn slice_tokens(&self, toks: Range<usize>) -> Kv {
        assert!(
            toks.start <= toks.end && toks.end <= self.tokens,
            "tokens {toks:?} of {}",
            self.tokens
        );
        gathered(self.shape, &[(self, toks)])
    }

    /// Concatenates KV runs of consecutive tokens.
    pub fn concat(shape: KvShape, parts: &[&Kv]) -> Result<Kv, EngineError> {
        let parts: Vec<(&Kv, Range<usize>)> = parts.iter().map(|p| (*p, 0..p.tokens)).collect();
        Kv::gather(shape, &parts)
    }

    /// The tokens `range` of each part, one part after another, in one new KV: each run is
    /// built from its parts' slices in layout order (no zeroing first). Parts must have
    /// `shape`, and their ranges must lie within their tokens.
    pub fn gather(shape: KvShape, parts: &[(&Kv, Range<usize>)]) -> Result<Kv, EngineError> {
        if let Some((p, _)) = parts.iter().find(|(p, _)| p.shape != shape) {
            return Err(EngineError::KvShape(format!("{:?} != {:?}", p.shape, shape)));
        }
        if let Some((p, r)) = parts.iter().find(|(p, r)| r.start > r.end || r.end > p.tokens) {
            return Err(EngineError::KvShape(format!("tokens {r:?} of {}", p.tokens)));
        }
        Ok(gathered(shape, parts))
    }

    /// Calls `f(layer, k|v, head)` for every run, in layout order.
    pub fn for_each_run(&self, mut f: impl FnMut(usize, usize, usize)) {
        for l in 0..self.shape.layers {
            for k in 0..2 {
                for h in 0..self.shape.kv_heads {
                    f(l, k, h);
                }
            }
        }
    }
}

/// [`Kv::gather`] of parts already checked.
fn gathered(shape: KvShape, parts: &[(&Kv, Range<usize>)]) -> Kv {
    let tokens = parts.iter().map(|(_, r)| r.len()).sum();
    let mut data = Vec::with_capacity(shape.token_bytes() * tokens);
    for l in 0..shape.layers {
        for k in 0..2 {
            for h in 0..shape.kv_heads {
                for (p, r) in parts {
                    data.extend_from_slice(&p.data[p.run_range(l, k, h, r.clone())]);
                }
            }
        }
    }
    Kv { shape, tokens, data }
}

/// Byte range of the run (layer, k|v, head), tokens `toks`, in the canonical layout of
/// `tokens` tokens of `shape`.
pub fn run_range(
    shape: KvShape,
    tokens: usize,
    layer: usize,
    kv: usize,
    head: usize,
    toks: Range<usize>,
) -> Range<usize> {
    let hb = shape.head_bytes;
    let base = ((layer * 2 + kv) * shape.kv_heads + head) * tokens * hb;
    base + toks.start * hb..base + toks.end * hb
}

#[cfg(test)]
mod tests;
