//! KV being written: one buffer in the canonical layout, frozen into a [`Kv`] when done.

use bytes::Bytes;

use super::{Kv, KvShape, layer_range, run_range};

/// The KV of a run of tokens while it is written, in the canonical layout.
pub struct KvMut {
    shape: KvShape,
    tokens: usize,
    data: Vec<u8>,
}

impl std::fmt::Debug for KvMut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvMut").field("shape", &self.shape).field("tokens", &self.tokens).finish()
    }
}

impl KvMut {
    /// Zeroed KV for `tokens` tokens.
    pub fn zeroed(shape: KvShape, tokens: usize) -> Self {
        KvMut { shape, tokens, data: vec![0; shape.token_bytes() * tokens] }
    }

    /// Mutable bytes of one (layer, k|v, head) run over all tokens.
    pub fn run_mut(&mut self, layer: usize, kv: usize, head: usize) -> &mut [u8] {
        let r = run_range(self.shape, self.tokens, layer, kv, head, 0..self.tokens);
        &mut self.data[r]
    }

    /// Mutable bytes of layer `layer` ([`Kv::layer`]).
    pub fn layer_mut(&mut self, layer: usize) -> &mut [u8] {
        &mut self.data[layer_range(self.shape, self.tokens, layer)]
    }

    /// The KV as written, without copying it.
    pub fn freeze(self) -> Kv {
        Kv::whole(self.shape, self.tokens, Bytes::from(self.data))
    }
}
