use handoff_engine::{MockConfig, MockEngine};
use handoff_proto::v1::{ChatMessage as ChatMsg, ChatMessages, TokenIds};

use super::*;

fn request(input: Input, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(input),
        sampling: Some(SamplingParams { max_tokens, ..Default::default() }),
        ..Default::default()
    }
}

/// With no `max_tokens`, a chat may fill the context (as OpenAI's chat does); text and
/// token ids get the configured default; a number given is kept.
#[test]
fn a_chat_without_max_tokens_may_fill_the_context() {
    let engine = MockEngine::new(MockConfig::default());
    let cfg = FrontendConfig::default();
    let context = engine.info().max_context;
    let chat = || {
        let m = ChatMsg { role: "user".into(), content: "hello there".into() };
        Input::Chat(ChatMessages { messages: vec![m] })
    };
    let plan = super::plan(request(chat(), 0), &engine, &cfg).unwrap();
    assert_eq!(plan.max_tokens as usize, context - plan.tokens.len());
    let plan = super::plan(request(chat(), 5), &engine, &cfg).unwrap();
    assert_eq!(plan.max_tokens, 5);
    let ids = || Input::TokenIds(TokenIds { ids: (1..40).collect() });
    let plan = super::plan(request(ids(), 0), &engine, &cfg).unwrap();
    assert_eq!(plan.max_tokens, cfg.default_max_tokens);
    // A prompt that fills the context leaves no room for a token.
    let full = Input::TokenIds(TokenIds { ids: vec![1; context] });
    assert!(super::plan(request(full, 1), &engine, &cfg).is_err());
}

/// No seed given is a fresh seed per request, below 2^63 (SGLang keeps seeds in a signed
/// 64-bit integer); a seed given, 0 included, is kept.
#[test]
fn no_seed_is_a_fresh_one_below_two_to_the_63() {
    let engine = MockEngine::new(MockConfig::default());
    let cfg = FrontendConfig::default();
    let with_seed = |seed| GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: (1..40).collect() })),
        sampling: Some(SamplingParams { seed, temperature: 1.0, ..Default::default() }),
        ..Default::default()
    };
    let seeds: std::collections::HashSet<u64> = (0..8)
        .map(|_| super::plan(with_seed(None), &engine, &cfg).unwrap().sampling.seed.unwrap())
        .collect();
    assert_eq!(seeds.len(), 8, "{seeds:?}");
    assert!(seeds.iter().all(|&s| s < 1 << 63), "{seeds:?}");
    for given in [0, 5] {
        let plan = super::plan(with_seed(Some(given)), &engine, &cfg).unwrap();
        assert_eq!(plan.sampling.seed, Some(given));
    }
}

/// A chat whose prompt fills the context leaves no room for a token: refused with the reason.
#[test]
fn a_chat_filling_the_context_is_refused() {
    let engine = MockEngine::new(MockConfig { max_context: 8, ..MockConfig::default() });
    let m = ChatMsg { role: "user".into(), content: "one two three four five six seven".into() };
    let chat = Input::Chat(ChatMessages { messages: vec![m] });
    let e = super::plan(request(chat, 0), &engine, &FrontendConfig::default()).unwrap_err();
    assert!(e.to_string().contains("fills the context"), "{e}");
}
