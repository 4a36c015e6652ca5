//! [`LoadOnFirstStep`]: the decoder of a request whose first token came from its prefill,
//! loaded into the engine at its first step. The first token streams as soon as the KV is
//! verified; loading the KV into the engine's own form (a pass over every byte) overlaps its
//! trip to the client instead of delaying it.

use std::sync::Arc;

use async_trait::async_trait;
use handoff_engine::{Decoder, Engine, EngineError, Kv, Sampling};

/// A decoder made at its first step (see the module docs).
pub(crate) struct LoadOnFirstStep {
    engine: Arc<dyn Engine>,
    start: Option<(Kv, u32, Sampling)>,
    loaded: Option<Box<dyn Decoder>>,
}

impl LoadOnFirstStep {
    /// Decodes after `first_token` from `kv` on `engine`.
    pub(crate) fn new(engine: Arc<dyn Engine>, kv: Kv, first_token: u32, s: Sampling) -> Self {
        LoadOnFirstStep { engine, start: Some((kv, first_token, s)), loaded: None }
    }
}

#[async_trait]
impl Decoder for LoadOnFirstStep {
    async fn step(&mut self) -> Result<u32, EngineError> {
        if let Some((kv, first, sampling)) = self.start.take() {
            self.loaded = Some(self.engine.decoder(kv, first, &sampling)?);
        }
        match &mut self.loaded {
            Some(d) => d.step().await,
            None => Err(EngineError::Internal("the decoder failed to load earlier".into())),
        }
    }
}
