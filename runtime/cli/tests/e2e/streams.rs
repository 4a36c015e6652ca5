//! A request's token stream and its deadline: a client that stops reading holds its request
//! only until the deadline, and its decode slot only until its decode ends, and the frontend's shutdown only for its grace; a `max_tokens` whose decode would outlast the deadline is served
//! until the deadline, not refused; a chat with no `max_tokens` ends there as long enough.

use std::sync::Arc;
use std::time::{Duration, Instant};

use handoff::{Cluster, ClusterConfig};
use handoff_engine::{MockConfig, MockEngine};
use handoff_proto::v1::generate_client::GenerateClient;
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::generate_response::Event;
use handoff_proto::v1::{GenerateRequest, GenerateResponse, SamplingParams, TokenIds};

use super::support::*;

fn request(max_tokens: u32, deadline_ms: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: prompt(1, 32) })),
        sampling: Some(SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }),
        deadline_ms,
        ..Default::default()
    }
}

/// A client of `c`'s frontend whose HTTP/2 windows are 1 KiB: a stream it does not read
/// fills them at once.
async fn small_windowed_client(c: &Cluster) -> GenerateClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.frontend_addr))
        .unwrap()
        .initial_stream_window_size(Some(1024))
        .initial_connection_window_size(Some(1024))
        .connect()
        .await
        .unwrap();
    GenerateClient::new(channel)
}

/// A cluster whose frontend decodes one sequence at once, 1 ms a token, up to `context`
/// tokens, with requests of up to 120 s; `tune` sets the rest.
async fn one_slot(context: usize, tune: impl FnOnce(&mut ClusterConfig)) -> Cluster {
    let engine = MockEngine::new(MockConfig {
        max_context: context,
        decode_per_token: Duration::from_millis(1),
        ..MockConfig::default()
    });
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.max_decoding = Some(1);
    cfg.frontend.request_timeout = Duration::from_secs(120);
    tune(&mut cfg);
    Cluster::start_shared(cfg, Arc::new(engine)).await.unwrap()
}

/// A stream of `tokens` (deadline 120 s) a small-windowed client does not read, once its
/// decode has taken the slot and given it up again, within `within`.
async fn unread_until_the_slot_is_free(
    c: &Cluster,
    tokens: u32,
    within: Duration,
) -> tonic::Streaming<GenerateResponse> {
    let slots = c.frontend.decode_slots().expect("bounded");
    let mut slow = small_windowed_client(c).await;
    let unread = slow.generate(request(tokens, 120_000)).await.unwrap().into_inner();
    let since = Instant::now();
    while slots.decoding() == 0 {
        assert!(since.elapsed() < Duration::from_secs(10), "the decode started");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while (slots.admitted(), slots.decoding()) != (0, 0) {
        let held = since.elapsed();
        assert!(held < within, "the slot held for the unread stream: {held:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unread
}

/// The client's HTTP/2 windows are small and it never reads: the frontend's sends block once
/// the server's buffers fill. The request must end at its deadline all the same (before,
/// its task waited on the send for as long as the client held the stream).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_its_request_only_until_the_deadline() {
    let engine = MockEngine::new(MockConfig { max_context: 200_000, ..MockConfig::default() });
    let c = Cluster::start_shared(ClusterConfig::ephemeral(), Arc::new(engine)).await.unwrap();
    let mut cl = small_windowed_client(&c).await;
    let mut unread = cl.generate(request(150_000, 1500)).await.unwrap().into_inner();
    let since = Instant::now();
    while c.frontend.in_flight() > 0 {
        assert!(since.elapsed() < Duration::from_secs(30), "the request outlived its deadline");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Read at last, the stream ends in the deadline's error, not silently.
    let end = loop {
        match unread.message().await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("the stream ended without a word"),
            Err(s) => break s,
        }
    };
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
}

/// A client that stops reading does not hold its decode slot: the decode runs ahead of it,
/// the slot (and the KV) are given back at the decode's end, far before the deadline, and
/// the next request decodes meanwhile; read at last, the stream is whole. Before, each token
/// waited for the client to take the one before, and a stalled stream held its slot until
/// its deadline: one per slot kept every other request waiting, then refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_gives_its_decode_slot_up_at_the_decodes_end() {
    let c = one_slot(20_000, |_| {}).await;
    // 1,000 tokens: more than the stream's windows, buffers and channel hold.
    let mut unread = unread_until_the_slot_is_free(&c, 1000, Duration::from_secs(60)).await;
    let mut cl = client(&c).await;
    let (next, _) = generate(&mut cl, &prompt(7, 32), 20).await.expect("the next one decodes");
    assert_eq!(next.len(), 20);
    let mut tokens = 0;
    let done = loop {
        match unread
            .message()
            .await
            .expect("the stream goes on")
            .expect("and ends in Complete")
            .event
        {
            Some(Event::Chunk(ch)) => tokens += ch.token_ids.len(),
            Some(Event::Complete(done)) => break done,
            None => {}
        }
    };
    assert_eq!(tokens, 1000, "every token, in the end");
    assert_eq!(done.usage.unwrap().completion_tokens, 1000);
    c.shutdown().await;
}

/// A client that takes nothing while its decode is as far ahead as it may run holds its slot
/// for `client_stall`, not until its deadline: the decode stops there, the next request
/// decodes, and the stream, read at last, has what was decoded, then says why it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_takes_nothing_loses_its_decode_not_just_its_lead() {
    let c = one_slot(60_000, |cfg| cfg.frontend.client_stall = Duration::from_millis(500)).await;
    // 50,000 tokens: a decode of a minute, the deadline two.
    let mut unread = unread_until_the_slot_is_free(&c, 50_000, Duration::from_secs(30)).await;
    let mut cl = client(&c).await;
    let (next, _) = generate(&mut cl, &prompt(7, 32), 20).await.expect("the next one decodes");
    assert_eq!(next.len(), 20);
    let mut tokens = 0;
    let end = loop {
        match unread.message().await {
            Ok(Some(GenerateResponse { event: Some(Event::Chunk(ch)) })) => {
                tokens += ch.token_ids.len()
            }
            Ok(Some(other)) => panic!("{other:?}"),
            Ok(None) => panic!("the stream ended without a word"),
            Err(s) => break s,
        }
    };
    assert_eq!(end.code(), tonic::Code::ResourceExhausted, "{end:?}");
    assert!(end.message().contains(&format!("after {tokens} tokens")), "{tokens}: {end:?}");
    assert!((1024..50_000).contains(&tokens), "{tokens} tokens");
    c.shutdown().await;
}

/// A client that stops reading does not hold the frontend's shutdown either: its connection
/// is cut after the shutdown grace (before, the server waited for the stream to finish, and
/// the process for the client).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_does_not_hold_the_shutdown() {
    let engine = MockEngine::new(MockConfig { max_context: 200_000, ..MockConfig::default() });
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.http.shutdown_grace = Duration::from_millis(300);
    let c = Cluster::start_shared(cfg, Arc::new(engine)).await.unwrap();
    let mut cl = small_windowed_client(&c).await;
    let _unread = cl.generate(request(150_000, 60_000)).await.unwrap().into_inner();
    let stopped = tokio::time::timeout(Duration::from_secs(10), c.shutdown()).await;
    assert!(stopped.is_ok(), "the shutdown waited for a client that does not read");
}

/// A drain tells gRPC clients to go (GOAWAY) while their streams in flight go on: a stream
/// begun before it ends whole, and the server ends once its connections have, before any
/// shutdown (before, a client kept on its connection brought new requests until the drain
/// ended, and then had its streams cut).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_sends_clients_away_and_finishes_their_streams() {
    let engine = MockEngine::new(MockConfig {
        decode_per_token: Duration::from_millis(5),
        ..MockConfig::default()
    });
    let c = Cluster::start_shared(ClusterConfig::ephemeral(), Arc::new(engine)).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving =
        tokio::spawn(handoff_frontend::service::serve(listener, c.frontend.clone(), async move {
            let _ = stopped.await;
        }));
    let mut cl = GenerateClient::connect(format!("http://{addr}")).await.unwrap();
    let mut long = cl.generate(request(200, 0)).await.unwrap().into_inner();
    long.message().await.unwrap().expect("a first token");
    c.frontend.start_draining();
    let mut tokens = 1;
    loop {
        match long.message().await.expect("the stream goes on").expect("to its end").event {
            Some(Event::Chunk(ch)) => tokens += ch.token_ids.len(),
            Some(Event::Complete(_)) => break,
            None => {}
        }
    }
    assert_eq!(tokens, 200, "the stream in flight ended whole");
    let ended = tokio::time::timeout(Duration::from_secs(10), serving).await;
    ended.expect("the server ended with its connections, no shutdown needed").unwrap().unwrap();
    assert!(cl.generate(request(4, 0)).await.is_err(), "no new request taken");
    c.shutdown().await;
}

/// Decode steps of 1 ms, measured by a first request, and prefills the scheduler knows cost
/// 100 us a token; then `max_tokens` of 5,000 (about 5 s of decode) under a 1 s deadline:
/// tokens come, and the deadline ends the stream (before, the scheduler was asked to prefill
/// in 1 ms and refused it as overload).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_max_tokens_longer_than_the_deadline_is_served_until_the_deadline() {
    let c = super::overload::timed_cluster(ClusterConfig::ephemeral(), Duration::from_micros(100))
        .await;
    let mut cl = client(&c).await;
    generate(&mut cl, &prompt(2, 32), 20).await.expect("a first request measures the steps");
    let mut stream = cl.generate(request(5_000, 1000)).await.expect("not refused").into_inner();
    let mut tokens = 0;
    let end = loop {
        match stream.message().await {
            Ok(Some(m)) => match m.event {
                Some(Event::Chunk(chunk)) => tokens += chunk.token_ids.len(),
                other => panic!("no Complete before 5,000 tokens at 1 ms: {other:?}"),
            },
            Ok(None) => panic!("the stream ended without a word"),
            Err(s) => break s,
        }
    };
    assert_eq!(end.code(), tonic::Code::DeadlineExceeded, "{end:?}");
    assert!(tokens > 0, "tokens came before the deadline");
}

/// A chat that names no `max_tokens` may fill the context (OpenAI's chat default); reaching
/// its deadline first, it ends as long enough (`Length`, with its usage), not as a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_ended_chat_ends_at_its_deadline_as_long_enough() {
    use handoff_proto::v1::{ChatMessage, ChatMessages, FinishReason};
    let c = super::overload::timed_cluster(ClusterConfig::ephemeral(), Duration::from_micros(100))
        .await;
    let mut cl = client(&c).await;
    generate(&mut cl, &prompt(3, 32), 20).await.expect("a first request measures the steps");
    let chat = ChatMessage { role: "user".into(), content: "tell me everything".into() };
    let req = GenerateRequest {
        input: Some(Input::Chat(ChatMessages { messages: vec![chat] })),
        sampling: Some(SamplingParams { ignore_eos: true, ..Default::default() }),
        deadline_ms: 1000,
        ..Default::default()
    };
    let mut stream = cl.generate(req).await.expect("not refused").into_inner();
    let mut tokens = 0;
    let done = loop {
        match stream.message().await.expect("no error") {
            Some(m) => match m.event {
                Some(Event::Chunk(chunk)) => tokens += chunk.token_ids.len(),
                Some(Event::Complete(done)) => break done,
                other => panic!("{other:?}"),
            },
            None => panic!("the stream ended without a word"),
        }
    };
    assert_eq!(done.finish_reason, FinishReason::Length as i32);
    assert!(tokens > 0 && tokens < 8000, "{tokens} tokens, cut by the deadline");
    assert_eq!(done.usage.unwrap().completion_tokens as usize, tokens);
}

/// One client connection has at most twice as many streams open at once as the frontend
/// serves requests (`max_concurrent`): a client that reads none of its answers holds what
/// they wait in, after their requests ended too (at their deadlines), only for those; its
/// next request waits in the client until one ends. Before, one connection could hold any
/// number of ended, unread answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_connection_holds_at_most_twice_max_concurrent_streams_open() {
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.max_concurrent = 10;
    let c = cluster(cfg).await;
    // Small stream windows; the connection's large, so one stream read is not held up by
    // the others' unread messages.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.frontend_addr))
        .unwrap()
        .initial_stream_window_size(Some(1024))
        .initial_connection_window_size(Some(64 << 20))
        .connect()
        .await
        .unwrap();
    let cl = GenerateClient::new(channel);
    let mut unread = Vec::new();
    // Two rounds of ten, each ended at its 1 s deadline, its answer unread.
    for _ in 0..2 {
        for _ in 0..10 {
            let mut cl = cl.clone();
            unread.push(cl.generate(request(300, 1000)).await.unwrap().into_inner());
        }
        let since = Instant::now();
        while c.frontend.in_flight() > 0 {
            assert!(since.elapsed() < Duration::from_secs(10), "ended at their deadline");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let mut next = cl.clone();
    let one_more = tokio::spawn(async move { next.generate(request(2, 60_000)).await });
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!one_more.is_finished(), "a stream past the bound went through");
    // One of them read to its end: the next one goes.
    let mut first = unread.swap_remove(0);
    while let Ok(Some(_)) = first.message().await {}
    let answered = tokio::time::timeout(Duration::from_secs(10), one_more).await;
    answered.expect("went once a stream ended").unwrap().expect("answered");
    c.shutdown().await;
}
