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

/// A request's own deadline is kept up to the frontend's request timeout, and cut to it
/// beyond; none named is that timeout.
#[test]
fn a_deadline_named_is_at_most_the_request_timeout() {
    let cfg = FrontendConfig { request_timeout: Duration::from_secs(60), ..Default::default() };
    let with = |deadline_ms| GenerateRequest { deadline_ms, ..Default::default() };
    assert_eq!(budget(&with(0), &cfg), Duration::from_secs(60));
    assert_eq!(budget(&with(1500), &cfg), Duration::from_millis(1500));
    assert_eq!(budget(&with(u32::MAX), &cfg), Duration::from_secs(60));
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

/// The mock engine, whose tokenizing of a long text blocks until the test lets it go.
struct SlowTokenizer {
    mock: MockEngine,
    began: std::sync::atomic::AtomicBool,
    go: std::sync::Mutex<std::sync::mpsc::Receiver<()>>,
}

#[async_trait::async_trait]
impl Engine for SlowTokenizer {
    fn info(&self) -> &handoff_engine::ModelInfo {
        self.mock.info()
    }

    fn tokenize(&self, text: &str) -> Result<Vec<u32>, handoff_engine::EngineError> {
        if text.len() > TOKENIZE_APART_BYTES {
            self.began.store(true, std::sync::atomic::Ordering::SeqCst);
            let go = self.go.lock().unwrap();
            let _ = go.recv_timeout(Duration::from_secs(5));
        }
        self.mock.tokenize(&text[..text.len().min(64)])
    }

    fn detokenize(&self, tokens: &[u32]) -> String {
        self.mock.detokenize(tokens)
    }

    fn chat_prompt(&self, m: &[ChatMessage]) -> Result<String, handoff_engine::EngineError> {
        self.mock.chat_prompt(m)
    }

    async fn prefill(
        &self,
        tokens: &[u32],
        prefix: Option<handoff_engine::Kv>,
        s: &handoff_engine::Sampling,
    ) -> Result<handoff_engine::Prefilled, handoff_engine::EngineError> {
        self.mock.prefill(tokens, prefix, s).await
    }

    fn decoder(
        &self,
        kv: handoff_engine::Kv,
        last: u32,
        s: &handoff_engine::Sampling,
    ) -> Result<Box<dyn handoff_engine::Decoder>, handoff_engine::EngineError> {
        self.mock.decoder(kv, last, s)
    }
}

/// A long text is tokenized off the async threads: on a one-thread runtime, a short request
/// is checked while a long one's tokenizing is still under way (before, the long one held
/// the thread, and every other request on it, until done).
#[tokio::test(flavor = "current_thread")]
async fn a_long_input_is_tokenized_apart_while_others_are_served() {
    let (go, gate) = std::sync::mpsc::channel();
    let engine = Arc::new(SlowTokenizer {
        mock: MockEngine::new(MockConfig::default()),
        began: Default::default(),
        go: std::sync::Mutex::new(gate),
    });
    let tasks = handoff_core::Tasks::new();
    let fe =
        Frontend::new(FrontendConfig::default(), engine.clone(), &["127.0.0.1:9".into()], &tasks)
            .await
            .unwrap();
    let text = |n: usize| GenerateRequest {
        input: Some(Input::Text("w".repeat(n))),
        ..Default::default()
    };
    let long = tokio::spawn({
        let fe = fe.clone();
        async move { checked(&fe, text(TOKENIZE_APART_BYTES + 1)).await }
    });
    while !engine.began.load(std::sync::atomic::Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // It arrived before its tokenizing began, so before this.
    let arrived_by = Instant::now();
    assert!(checked(&fe, text(10)).await.is_ok(), "the short one is checked");
    assert!(!long.is_finished(), "while the long one is still being tokenized");
    // Held a while longer: its deadline counts from its arrival, not from its tokenizing's end.
    tokio::time::sleep(Duration::from_millis(200)).await;
    go.send(()).unwrap();
    let planned = long.await.unwrap().unwrap();
    let budget = FrontendConfig::default().request_timeout;
    assert!(planned.deadline <= arrived_by + budget, "the deadline counts from the arrival");
}

/// A long input waits for a turn to be tokenized only within its own time: past it, the
/// frontend is too busy for it (429), and it is not tokenized at all. Before, it waited as
/// long as the turns were taken, then was tokenized anyway.
#[tokio::test]
async fn a_long_input_waits_for_a_turn_only_within_its_deadline() {
    let tasks = handoff_core::Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = Frontend::new(FrontendConfig::default(), engine, &["127.0.0.1:9".into()], &tasks)
        .await
        .unwrap();
    // Every turn taken, as by long inputs being tokenized.
    let turns = fe.tokenizing.available_permits() as u32;
    let _held = fe.tokenizing.clone().acquire_many_owned(turns).await.unwrap();
    let req = GenerateRequest {
        input: Some(Input::Text("w ".repeat(TOKENIZE_APART_BYTES))),
        deadline_ms: 50,
        ..Default::default()
    };
    let answered = tokio::time::timeout(Duration::from_secs(30), checked(&fe, req)).await;
    let e = answered.expect("waited past its deadline").unwrap_err();
    assert!(matches!(e, FrontendError::Overloaded { .. }), "{e}");
}

/// Long inputs waiting for a turn hold their text: past [`TOKENIZE_HELD_BYTES`] of them,
/// another is refused at once (429) rather than held too, and one over the input limit is
/// refused before it waits at all. Before, each waited (up to the request's time) whatever
/// its size: 4,096 requests in progress held up to 64 GiB of gRPC messages.
#[tokio::test]
async fn long_inputs_waiting_to_be_tokenized_hold_a_bounded_number_of_bytes() {
    let tasks = handoff_core::Tasks::new();
    let engine = Arc::new(MockEngine::new(MockConfig::default()));
    let fe = Frontend::new(FrontendConfig::default(), engine, &["127.0.0.1:9".into()], &tasks)
        .await
        .unwrap();
    let turns = fe.tokenizing.available_permits() as u32;
    let _held = fe.tokenizing.clone().acquire_many_owned(turns).await.unwrap();
    let text = |n: usize| GenerateRequest {
        input: Some(Input::Text("w".repeat(n))),
        ..Default::default()
    };
    let e = checked(&fe, text(MAX_INPUT_BYTES + 1)).await.unwrap_err();
    assert!(matches!(e, FrontendError::Invalid(_)), "{e}");
    let mut waiting = tokio::task::JoinSet::new();
    for _ in 0..TOKENIZE_HELD_BYTES / MAX_INPUT_BYTES {
        let fe = fe.clone();
        waiting.spawn(async move { checked(&fe, text(MAX_INPUT_BYTES)).await });
    }
    // All waiting (bounded, so a budget that never fills fails below rather than hangs).
    let filled = Instant::now() + Duration::from_secs(5);
    while fe.tokenizing_bytes.available_permits() > 0 && Instant::now() < filled {
        tokio::task::yield_now().await;
    }
    let refused =
        tokio::time::timeout(Duration::from_secs(5), checked(&fe, text(TOKENIZE_APART_BYTES + 1)))
            .await
            .expect("refused at once, not held");
    match refused.unwrap_err() {
        FrontendError::Overloaded { limit, .. } => assert_eq!(limit, crate::Limit::Tokenizer),
        e => panic!("{e}"),
    }
    assert!(checked(&fe, text(10)).await.is_ok(), "a short input still served");
    waiting.abort_all();
}
