//! The mock engine: a timing model with checkable KV.
//!
//! - KV bytes are a pure function of (token, position, layer, head), so a receiver can
//!   recompute and compare every byte, and a cached prefix is valid wherever it came from.
//! - The next token is a function of a digest of all the KV the sequence holds, so wrong KV
//!   gives wrong tokens.
//! - Prefill costs `prefill_per_token` for each computed (not cached) token; each decode step
//!   costs `decode_per_token`, and with a `decode_batch` at most that many steps run at once
//!   (the others wait for their turn, as in a batching engine's later passes).
//! - Text is "tokenized" word by word into ids; ids render back as `w<id>`.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Semaphore;
use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use crate::{
    ChatMessage, Decoder, Engine, EngineError, Kv, KvMut, KvShape, ModelInfo, Prefilled, Sampling,
};

/// Settings of the mock engine.
#[derive(Debug, Clone)]
pub struct MockConfig {
    /// Model name clients ask for.
    pub name: String,
    /// KV shape per token.
    pub shape: KvShape,
    /// Tokens per page.
    pub page_size: usize,
    /// Vocabulary size.
    pub vocab: u32,
    /// Longest sequence.
    pub max_context: usize,
    /// Time charged per computed prefill token.
    pub prefill_per_token: Duration,
    /// Time charged per decode step.
    pub decode_per_token: Duration,
    /// Decode steps charged at once, at most (`None`: any number).
    pub decode_batch: Option<usize>,
    /// The weights it stands for, by number ([`ModelInfo::fingerprint`]; 0: not said).
    pub fingerprint: u64,
}

impl Default for MockConfig {
    fn default() -> Self {
        MockConfig {
            name: "mock".into(),
            shape: KvShape { layers: 4, kv_heads: 4, head_bytes: 32 },
            page_size: 16,
            vocab: 32_000,
            max_context: 8192,
            prefill_per_token: Duration::ZERO,
            decode_per_token: Duration::ZERO,
            decode_batch: None,
            fingerprint: MOCK_FINGERPRINT,
        }
    }
}

/// The default mock's weights, by fingerprint: its KV is the same function of the tokens
/// in every instance.
pub const MOCK_FINGERPRINT: u64 = 0x6d6f_636b;

/// The end-of-sequence token of the mock vocabulary.
pub const MOCK_EOS: u32 = 1;

/// A mock engine (see the module docs).
#[derive(Debug, Clone)]
pub struct MockEngine {
    cfg: MockConfig,
    info: ModelInfo,
    /// Turns at decode steps, one per sequence of a batch (with a `decode_batch`).
    batch: Option<Arc<Semaphore>>,
}

impl MockEngine {
    /// A mock engine with these settings.
    pub fn new(cfg: MockConfig) -> Self {
        let info = ModelInfo {
            name: cfg.name.clone(),
            shape: cfg.shape,
            page_size: cfg.page_size,
            vocab: cfg.vocab,
            max_context: cfg.max_context,
            end_tokens: vec![MOCK_EOS],
            fingerprint: cfg.fingerprint,
        };
        let batch = cfg.decode_batch.map(|n| Arc::new(Semaphore::new(n.max(1))));
        MockEngine { cfg, info, batch }
    }

    /// The KV bytes of one (token, position, layer, head), k and v alike differing by `kv`.
    pub fn kv_bytes(token: u32, pos: usize, layer: usize, kv: usize, head: usize, out: &mut [u8]) {
        let mut key = [0u8; 24];
        key[..4].copy_from_slice(&token.to_le_bytes());
        key[4..12].copy_from_slice(&(pos as u64).to_le_bytes());
        key[12..16].copy_from_slice(&(layer as u32).to_le_bytes());
        key[16..20].copy_from_slice(&(kv as u32).to_le_bytes());
        key[20..24].copy_from_slice(&(head as u32).to_le_bytes());
        let mut s = xxh3_64(&key);
        for chunk in out.chunks_mut(8) {
            // splitmix64: cheap, well mixed, deterministic.
            s = s.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = s;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            chunk.copy_from_slice(&z.to_le_bytes()[..chunk.len()]);
        }
    }

    /// The KV the mock computes for `tokens` at positions `start..start + tokens.len()`.
    pub fn compute_kv(shape: KvShape, tokens: &[u32], start: usize) -> Kv {
        let mut kv = KvMut::zeroed(shape, tokens.len());
        let hb = shape.head_bytes;
        for l in 0..shape.layers {
            for k in 0..2 {
                for h in 0..shape.kv_heads {
                    let run = kv.run_mut(l, k, h);
                    for (i, &t) in tokens.iter().enumerate() {
                        Self::kv_bytes(t, start + i, l, k, h, &mut run[i * hb..(i + 1) * hb]);
                    }
                }
            }
        }
        kv.freeze()
    }

    fn token_from_digest(&self, digest: u64) -> u32 {
        (digest % u64::from(self.cfg.vocab)) as u32
    }
}

#[async_trait]
impl Engine for MockEngine {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn decode_batch(&self) -> Option<usize> {
        self.cfg.decode_batch
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        // Reserved ids: 0 (unused) and MOCK_EOS. `w<id>` words map back to their id.
        let span = u64::from(self.cfg.vocab - 2);
        Ok(text
            .split_whitespace()
            .map(|w| match w.strip_prefix('w').and_then(|n| n.parse::<u32>().ok()) {
                Some(id) if id < self.cfg.vocab => id,
                _ => 2 + (xxh3_64(w.as_bytes()) % span) as u32,
            })
            .collect())
    }

    fn detokenize(&self, tokens: &[u32]) -> String {
        tokens.iter().map(|t| format!(" w{t}")).collect()
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        if messages.is_empty() {
            return Err(EngineError::InvalidInput("no chat messages".into()));
        }
        Ok(messages.iter().map(|m| format!("<{}> {}\n", m.role, m.content)).collect())
    }

    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        _sampling: &Sampling,
    ) -> Result<Prefilled, EngineError> {
        let (out, computed) = self.compute(tokens, prefix)?;
        if !self.cfg.prefill_per_token.is_zero() {
            tokio::time::sleep(self.cfg.prefill_per_token * computed as u32).await;
        }
        Ok(out)
    }

    /// Each layer is handed on once its share of the compute time has passed (measured from
    /// the start, so rounding does not add up).
    async fn prefill_streamed(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        _sampling: &Sampling,
        layers: crate::LayerSink,
    ) -> Result<Prefilled, EngineError> {
        let started = tokio::time::Instant::now();
        let (out, computed) = self.compute(tokens, prefix)?;
        let total = self.cfg.prefill_per_token * computed as u32;
        let n = out.kv.shape().layers;
        for layer in 0..n {
            if !total.is_zero() {
                tokio::time::sleep_until(started + total * (layer as u32 + 1) / n as u32).await;
            }
            let bytes = out.kv.layer(layer).clone();
            let _ = layers.send(crate::LayerKv { layer, bytes });
        }
        Ok(out)
    }

    fn decoder(
        &self,
        kv: Kv,
        last_token: u32,
        _sampling: &Sampling,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        self.start_decoder(kv, last_token)
    }
}

impl MockEngine {
    /// The prompt's KV and first token, and how many tokens were computed (not cached).
    fn compute(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
    ) -> Result<(Prefilled, usize), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidInput("empty prompt".into()));
        }
        if tokens.len() > self.cfg.max_context {
            return Err(EngineError::InvalidInput(format!(
                "prompt of {} tokens exceeds the context of {}",
                tokens.len(),
                self.cfg.max_context
            )));
        }
        let cached = prefix.as_ref().map_or(0, Kv::tokens);
        if cached >= tokens.len() {
            return Err(EngineError::InvalidInput("cached prefix covers the whole prompt".into()));
        }
        let computed = tokens.len() - cached;
        let rest = Self::compute_kv(self.cfg.shape, &tokens[cached..], cached);
        let kv = match prefix {
            Some(p) => Kv::concat(self.cfg.shape, &[&p, &rest])?,
            None => rest,
        };
        let first_token = self.token_from_digest(digest(&kv, 0));
        Ok((Prefilled { kv, first_token }, computed))
    }

    fn start_decoder(&self, kv: Kv, last_token: u32) -> Result<Box<dyn Decoder>, EngineError> {
        if kv.shape() != self.cfg.shape {
            return Err(EngineError::KvShape(format!("{:?} != {:?}", kv.shape(), self.cfg.shape)));
        }
        Ok(Box::new(MockDecoder {
            engine: self.clone(),
            digest: digest(&kv, 0),
            pos: kv.tokens(),
            last: last_token,
        }))
    }
}

/// A mock sequence: holds a digest of its KV instead of the KV itself.
struct MockDecoder {
    engine: MockEngine,
    digest: u64,
    pos: usize,
    last: u32,
}

#[async_trait]
impl Decoder for MockDecoder {
    async fn step(&mut self) -> Result<u32, EngineError> {
        if self.pos + 1 >= self.engine.cfg.max_context {
            return Err(EngineError::InvalidInput("context is full".into()));
        }
        // The engine's semaphore is never closed.
        let _turn = match &self.engine.batch {
            Some(b) => b.acquire().await.ok(),
            None => None,
        };
        if !self.engine.cfg.decode_per_token.is_zero() {
            tokio::time::sleep(self.engine.cfg.decode_per_token).await;
        }
        let kv = MockEngine::compute_kv(self.engine.cfg.shape, &[self.last], self.pos);
        self.digest = digest(&kv, self.digest);
        self.pos += 1;
        self.last = self.engine.token_from_digest(self.digest);
        Ok(self.last)
    }
}

/// xxh3 of the KV's canonical bytes, seeded with `seed`: the same as of one buffer holding them.
fn digest(kv: &Kv, seed: u64) -> u64 {
    let mut h = Xxh3::with_seed(seed);
    for layer in kv.layers() {
        h.update(layer);
    }
    h.digest()
}

#[cfg(test)]
mod tests;
