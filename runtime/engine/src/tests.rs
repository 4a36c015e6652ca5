//! The trait's own defaults, through an engine that overrides none of them.

use super::*;

/// The mock engine with only the required methods: [`Engine::prefill_streamed`] is the
/// trait's default.
struct PlainEngine(MockEngine);

#[async_trait]
impl Engine for PlainEngine {
    fn info(&self) -> &ModelInfo {
        self.0.info()
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, EngineError> {
        self.0.tokenize(text)
    }

    fn detokenize(&self, tokens: &[u32]) -> String {
        self.0.detokenize(tokens)
    }

    fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<String, EngineError> {
        self.0.chat_prompt(messages)
    }

    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<Kv>,
        sampling: &Sampling,
    ) -> Result<Prefilled, EngineError> {
        self.0.prefill(tokens, prefix, sampling).await
    }

    fn decoder(
        &self,
        kv: Kv,
        last_token: u32,
        sampling: &Sampling,
    ) -> Result<Box<dyn Decoder>, EngineError> {
        self.0.decoder(kv, last_token, sampling)
    }
}

#[tokio::test]
async fn the_default_streamed_prefill_hands_on_the_kvs_own_layers() {
    streams_the_kvs_own_layers(&PlainEngine(MockEngine::new(MockConfig::default()))).await;
}

/// `e`'s streamed prefill hands on each layer once, in order, as the returned KV's own
/// buffer (not a copy).
pub(crate) async fn streams_the_kvs_own_layers(e: &dyn Engine) {
    let prompt: Vec<u32> = (10..40).collect();
    let (tx, mut rx) = crate::layer_channel(e.info().shape.layers, 0);
    let p = e.prefill_streamed(&prompt, None, &Sampling::default(), tx).await.unwrap();
    let mut got = Vec::new();
    while let Some(part) = rx.next_part().await {
        got.extend(part);
    }
    assert_eq!(got.len(), p.kv.shape().layers, "one of each layer");
    for (l, got) in got.iter().enumerate() {
        assert_eq!(got.layer, l);
        assert_eq!(got.bytes.as_ptr(), p.kv.layer(l).as_ptr(), "layer {l} was copied");
        assert_eq!(got.bytes, p.kv.layer(l));
    }
}
