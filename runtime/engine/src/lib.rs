//! The engine seam: what handoff needs from a model runtime.
//!
//! - [`Engine`] / [`Decoder`] (this file): model info, tokenization, prefill over an optional
//!   cached prefix, and decoding from imported KV.
//! - [`kv`] — [`Kv`], the canonical KV layout every engine exports and imports, held one
//!   shared buffer per layer; [`KvMut`], the one being written.
//! - `layers` — [`layer_channel`]: a streamed prefill's [`LayerSink`] and the [`LayerParts`]
//!   its listener takes, woken once a part is due rather than at every layer.
//! - [`mock`] — [`MockEngine`], a timing model whose KV bytes are a pure function of (token,
//!   position, layer, head), so every byte received can be checked.

mod error;
pub mod kv;
mod layers;
pub mod mock;

use async_trait::async_trait;

pub use error::EngineError;
pub use kv::{Kv, KvMut, KvShape};
pub use layers::{LayerKv, LayerParts, LayerSink, layer_channel};
pub use mock::{MockConfig, MockEngine};

/// What a model is, as far as KV handoff is concerned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelInfo {
    /// The name clients ask for.
    pub name: String,
    /// Shape of one token's KV.
    pub shape: KvShape,
    /// Tokens per KV page (and per block hash).
    pub page_size: usize,
    /// Vocabulary size.
    pub vocab: u32,
    /// Longest sequence (prompt plus generated tokens).
    pub max_context: usize,
    /// The tokens that end a sequence (end of text, end of a chat turn): generated, one ends
    /// the stream and is not counted.
    pub end_tokens: Vec<u32>,
    /// The weights', 0 when not known: a prefill of other weights (a fine-tune, another
    /// quantization, of the same shape) makes KV the decode would continue from silently.
    pub fingerprint: u64,
}

/// Temperatures at or below this sample greedily: dividing logits by less would overflow
/// them to infinities (and every probability to NaN) long before it changed the choice.
pub const GREEDY_BELOW: f32 = 1e-5;

/// Sampling settings an engine honours.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sampling {
    /// At most [`GREEDY_BELOW`] means greedy.
    pub temperature: f32,
    /// Nucleus sampling mass; 0 or 1 means off.
    pub top_p: f32,
    /// 0 means off.
    pub top_k: u32,
    /// Seed for sampled (non-greedy) decoding.
    pub seed: u64,
}

/// A chat message for [`Engine::chat_prompt`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The message text.
    pub content: String,
}

/// The result of a prefill: the KV of the whole prompt and the first generated token.
#[derive(Debug, Clone)]
pub struct Prefilled {
    /// KV of every prompt token (cached prefix included).
    pub kv: Kv,
    /// The first generated token.
    pub first_token: u32,
}

/// A model runtime.
#[async_trait]
pub trait Engine: Send + Sync + 'static {
    /// The model's shape and limits.
    fn info(&self) -> &ModelInfo;

    /// Text to token ids.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError>;

    /// Token ids to text.
    fn detokenize(&self, tokens: &[u32]) -> String;

    /// Renders chat messages with the model's chat template, ready to tokenize.
    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError>;

    /// Chat messages to token ids. By default the rendered template's: an engine whose
    /// tokenizer has control tokens reads messages' contents as plain text instead, so that
    /// a user writing `<|im_end|>` cannot end a turn or open a system one.
    fn tokenize_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, EngineError> {
        self.tokenize(&self.chat_prompt(messages)?)
    }

    /// Computes the KV of `tokens`, reusing `prefix` (the KV of `tokens[..prefix.tokens()]`)
    /// and computing only the rest, and samples the first generated token.
    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
    ) -> Result<Prefilled, EngineError>;

    /// As [`Engine::prefill`], handing each layer's KV to `layers` as soon as it is computed,
    /// so it can travel while later layers compute. The default computes the whole prompt,
    /// then hands every layer on.
    async fn prefill_streamed(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
        layers: LayerSink,
    ) -> Result<Prefilled, EngineError> {
        let p = self.prefill(tokens, prefix, sampling).await?;
        for layer in 0..p.kv.shape().layers {
            let bytes = p.kv.layer(layer).clone();
            if layers.send(LayerKv { layer, bytes }).is_err() {
                break; // nobody listens any more
            }
        }
        Ok(p)
    }

    /// How many engine handles take turns on this one's compute, itself included (1: it has
    /// its compute to itself). A cost measured while it ran alone is this many times too
    /// low once all of them are busy; the prefill prices its queue with that in mind.
    fn compute_shared_by(&self) -> usize {
        1
    }

    /// Sequences one decode pass advances, at most, if the engine batches them (`None`: no
    /// such bound known). Sequences past it wait for later passes, gaining no throughput:
    /// the frontend decodes at most this many at once by default.
    fn decode_batch(&self) -> Option<usize> {
        None
    }

    /// Starts decoding after `last_token`, from the KV of everything before it.
    fn decoder(
        &self,
        kv: Kv,
        last_token: u32,
        sampling: &Sampling,
    ) -> Result<Box<dyn Decoder>, EngineError>;
}

/// One sequence being decoded.
#[async_trait]
pub trait Decoder: Send {
    /// Feeds the previous token and returns the next one.
    async fn step(&mut self) -> Result<u32, EngineError>;
}

#[cfg(test)]
mod tests;
