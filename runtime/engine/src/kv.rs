//! The canonical KV layout: `[layer][k|v][head][token][head_bytes]`, head-major so that one
//! (layer, k|v, head) run of tokens is contiguous. Shards by KV head (tp) and by layer (pp)
//! are then lists of contiguous runs, which is what the transfer seam moves.

use std::ops::Range;

use bytes::Bytes;

use crate::EngineError;

mod writable;

pub use writable::KvMut;

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
        self.layers * self.layer_bytes(1)
    }

    /// Bytes of one layer of `tokens` tokens ([`Kv::layer`]).
    pub fn layer_bytes(&self, tokens: usize) -> usize {
        2 * self.kv_heads * tokens * self.head_bytes
    }
}

/// The KV of a run of tokens, in the canonical layout, held as one [`Bytes`] per layer (each
/// its own buffer, or views of one buffer holding them all). An engine can hand each layer on
/// as the buffer it computed it into, while it computes the next, and make the KV of those
/// buffers when done ([`Kv::from_layers`]); a KV read from one received region is a view of
/// it. Cloning is cheap; the bytes never change once they are a `Kv` ([`KvMut`] is the
/// writable one). A view keeps its whole buffer alive: a layer handed on from a KV made of
/// one buffer keeps every layer's bytes until it is dropped.
#[derive(Clone, PartialEq, Eq)]
pub struct Kv {
    shape: KvShape,
    tokens: usize,
    layers: Vec<Bytes>,
}

impl std::fmt::Debug for Kv {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kv").field("shape", &self.shape).field("tokens", &self.tokens).finish()
    }
}

impl Kv {
    /// Wraps bytes already in the canonical layout, without copying them.
    pub fn from_bytes(shape: KvShape, tokens: usize, data: Vec<u8>) -> Result<Self, EngineError> {
        if data.len() != shape.token_bytes() * tokens {
            return Err(EngineError::KvShape(format!(
                "{} bytes for {tokens} tokens of {} bytes each",
                data.len(),
                shape.token_bytes()
            )));
        }
        Ok(Self::whole(shape, tokens, Bytes::from(data)))
    }

    /// Wraps one buffer per layer, each [`Kv::layer`]'s bytes, without copying them. What
    /// [`Kv::byte_len`] counts is what is held only when each layer owns its buffer (a slice
    /// of a larger one keeps all of it).
    pub fn from_layers(
        shape: KvShape,
        tokens: usize,
        layers: Vec<Bytes>,
    ) -> Result<Self, EngineError> {
        let len = shape.layer_bytes(tokens);
        if layers.len() != shape.layers {
            return Err(EngineError::KvShape(format!(
                "{} layers, the shape has {}",
                layers.len(),
                shape.layers
            )));
        }
        if let Some((l, b)) = layers.iter().enumerate().find(|(_, b)| b.len() != len) {
            return Err(EngineError::KvShape(format!(
                "layer {l} of {} bytes, {tokens} tokens need {len}",
                b.len()
            )));
        }
        Ok(Kv { shape, tokens, layers })
    }

    /// A KV of the canonical bytes `data`, already checked to be `tokens` tokens of `shape`.
    fn whole(shape: KvShape, tokens: usize, data: Bytes) -> Self {
        let layers = (0..shape.layers).map(|l| data.slice(layer_range(shape, tokens, l))).collect();
        Kv { shape, tokens, layers }
    }

    /// The shape of one token.
    pub fn shape(&self) -> KvShape {
        self.shape
    }

    /// Number of tokens.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes of all layers.
    pub fn byte_len(&self) -> usize {
        self.shape.token_bytes() * self.tokens
    }

    /// Every layer's bytes, in layer order: the canonical layout, one layer after another.
    pub fn layers(&self) -> &[Bytes] {
        &self.layers
    }

    /// The bytes of layer `layer`: its K and V runs of every head over all tokens.
    pub fn layer(&self, layer: usize) -> &Bytes {
        &self.layers[layer]
    }

    /// The bytes of one (layer, k|v, head) run over all tokens.
    pub fn run(&self, layer: usize, kv: usize, head: usize) -> &[u8] {
        let r = run_in_layer(self.shape, self.tokens, kv, head, 0..self.tokens);
        &self.layers[layer][r]
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
    pub fn for_each_run(&self, f: impl FnMut(usize, usize, usize)) {
        for_each_run(self.shape, f);
    }
}

/// Calls `f(layer, k|v, head)` for every run of `shape`, in layout order.
fn for_each_run(shape: KvShape, mut f: impl FnMut(usize, usize, usize)) {
    for l in 0..shape.layers {
        for k in 0..2 {
            for h in 0..shape.kv_heads {
                f(l, k, h);
            }
        }
    }
}

/// [`Kv::gather`] of parts already checked, into one buffer.
fn gathered(shape: KvShape, parts: &[(&Kv, Range<usize>)]) -> Kv {
    let tokens = parts.iter().map(|(_, r)| r.len()).sum();
    let mut data = Vec::with_capacity(shape.token_bytes() * tokens);
    for_each_run(shape, |l, k, h| {
        for (p, r) in parts {
            data.extend_from_slice(&p.layers[l][run_in_layer(shape, p.tokens, k, h, r.clone())]);
        }
    });
    Kv::whole(shape, tokens, Bytes::from(data))
}

/// Byte range of layer `layer` in the canonical layout of `tokens` tokens of `shape`.
pub fn layer_range(shape: KvShape, tokens: usize, layer: usize) -> Range<usize> {
    let len = shape.layer_bytes(tokens);
    layer * len..(layer + 1) * len
}

/// Byte range of the run (k|v, head), tokens `toks`, within one layer ([`Kv::layer`]) of
/// `tokens` tokens of `shape`.
pub fn run_in_layer(
    shape: KvShape,
    tokens: usize,
    kv: usize,
    head: usize,
    toks: Range<usize>,
) -> Range<usize> {
    let hb = shape.head_bytes;
    let base = (kv * shape.kv_heads + head) * tokens * hb;
    base + toks.start * hb..base + toks.end * hb
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
    let base = layer_range(shape, tokens, layer).start;
    let within = run_in_layer(shape, tokens, kv, head, toks);
    base + within.start..base + within.end
}

#[cfg(test)]
mod tests;
