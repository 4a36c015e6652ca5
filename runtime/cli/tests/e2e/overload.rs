//! A burst over capacity is queued or refused at once, never turned into an outage; every
//! booking ends, whatever happens to its request; a scheduler replica going away costs no
//! request.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::join_all;
use handoff::{Cluster, ClusterConfig};
use handoff_engine::{MockConfig, MockEngine};
use handoff_proto::v1::generate_request::Input;
use handoff_proto::v1::{GenerateRequest, SamplingParams, TokenIds};
use handoff_scheduler::SchedulerConfig;

use super::support::*;

/// A cluster whose mock engine charges real time per token (and 1 ms a decode step).
pub(crate) async fn timed_cluster(cfg: ClusterConfig, prefill_per_token: Duration) -> Cluster {
    let engine = Arc::new(MockEngine::new(MockConfig {
        prefill_per_token,
        decode_per_token: Duration::from_millis(1),
        ..MockConfig::default()
    }));
    let c = Cluster::start_shared(cfg, engine).await.expect("cluster starts");
    // The instances' first heartbeats carry their warm-up's cost per token.
    let since = Instant::now();
    for s in &c.schedulers {
        while s.scheduler.state().instances().iter().any(|i| i.token_cost_us == 0.0) {
            assert!(since.elapsed() < Duration::from_secs(10), "costs heard within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    c
}

/// Every scheduler replica's load is back to zero, the prefills serve nothing, no receive
/// region is left (waits for the last reports, which travel after the answers).
async fn assert_settles(c: &Cluster) {
    let since = Instant::now();
    loop {
        let booked: usize = c.schedulers.iter().map(|s| s.scheduler.state().open_bookings()).sum();
        let in_flight: u32 = c
            .schedulers
            .iter()
            .flat_map(|s| s.scheduler.state().instances())
            .map(|i| i.in_flight)
            .sum();
        let running: usize = c.prefills.iter().map(|p| p.running()).sum();
        let regions = c.frontend.agent().inbox().regions();
        if booked == 0 && in_flight == 0 && running == 0 && regions == 0 {
            return;
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "not settled: {booked} bookings, {in_flight} in flight, {running} running, {regions} regions"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_capacity_is_queued_or_refused_at_once_and_the_service_stays_up() {
    let cfg = ClusterConfig {
        scheduler: SchedulerConfig {
            max_queue_wait: Duration::from_millis(300),
            ..SchedulerConfig::default()
        },
        ..ClusterConfig::ephemeral()
    };
    // 64-token prompts at 1 ms a token: 64 ms of prefill each, about 5 queued per instance.
    let c = timed_cluster(cfg, Duration::from_millis(1)).await;
    let cl = client(&c).await;
    let calls = (0..120u32).map(|i| {
        let mut cl = cl.clone();
        async move {
            let started = Instant::now();
            let r = generate(&mut cl, &prompt(i, 64), 4).await;
            (r, started.elapsed())
        }
    });
    let (mut served, mut refused) = (0, 0);
    for (r, took) in join_all(calls).await {
        match r {
            Ok(_) => served += 1,
            Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                refused += 1;
                let after = e.metadata().get(handoff_frontend::RETRY_AFTER_MS);
                assert!(after.is_some(), "a refusal says when to retry: {e:?}");
                assert!(
                    took < Duration::from_secs(5),
                    "refused at once, not after a wait: {took:?}"
                );
            }
            Err(e) => panic!("only answers or refusals in a burst, got {e:?}"),
        }
    }
    eprintln!("burst of 120: {served} served, {refused} refused");
    assert!(served >= 8, "what fits is served: {served}");
    assert!(refused > 0, "what does not fit is refused");
    // Overload opened no breaker, and the service answers right away.
    for i in c.scheduler.state().instances() {
        assert!(i.routable && i.breaker_closed, "{} still healthy", i.instance.id);
    }
    let mut cl = client(&c).await;
    generate(&mut cl, &prompt(999, 64), 4).await.expect("served right after the burst");
    assert_settles(&c).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_booking_ends_whatever_happens_to_its_request() {
    let cfg = ClusterConfig { schedulers: 2, ..ClusterConfig::ephemeral() };
    let c = timed_cluster(cfg, Duration::from_micros(100)).await;
    let cl = client(&c).await;
    let outcomes = Arc::new([(); 5].map(|_| AtomicUsize::new(0)));
    let requests = futures::stream::iter(0..1000u32).map(|i| {
        let (mut cl, outcomes) = (cl.clone(), outcomes.clone());
        async move {
            let mut ids = prompt(i % 97, 32 + (i as usize * 13) % 96);
            let mut deadline_ms = 0;
            match i % 10 {
                0 => ids.push(1 << 30), // outside the vocabulary: 400
                1 => deadline_ms = 1,   // its deadline passes on the way
                _ => {}
            }
            let req = GenerateRequest {
                input: Some(Input::TokenIds(TokenIds { ids })),
                sampling: Some(SamplingParams {
                    max_tokens: 1 + i % 24,
                    ignore_eos: true,
                    ..Default::default()
                }),
                deadline_ms,
                ..Default::default()
            };
            // A third of the clients go away at a random stage: selection, prefill,
            // transfer or the middle of the stream.
            let cancel_at =
                (i % 3 == 2).then(|| Duration::from_micros(u64::from(i * 7919 % 40_000)));
            let call = async {
                let mut s = cl.generate(req).await?.into_inner();
                while s.message().await?.is_some() {}
                Ok::<_, tonic::Status>(())
            };
            let slot = match cancel_at {
                Some(t) => match tokio::time::timeout(t, call).await {
                    Err(_) => 4,
                    Ok(r) => code_slot(r),
                },
                None => code_slot(call.await),
            };
            outcomes[slot].fetch_add(1, Ordering::Relaxed);
        }
    });
    requests.buffer_unordered(48).collect::<Vec<()>>().await;
    let n: Vec<usize> = outcomes.iter().map(|a| a.load(Ordering::Relaxed)).collect();
    eprintln!(
        "ok {}, invalid {}, deadline or refused {}, other {}, cancelled {}",
        n[0], n[1], n[2], n[3], n[4]
    );
    assert_eq!(n[3], 0, "no request failed for another reason");
    assert!(n[0] > 300 && n[1] > 50 && n[4] > 50, "{n:?}");
    assert_settles(&c).await;
    c.shutdown().await;
}

fn code_slot(r: Result<(), tonic::Status>) -> usize {
    match r {
        Ok(()) => 0,
        Err(e) if e.code() == tonic::Code::InvalidArgument => 1,
        // A deadline shorter than the prefill itself is refused up front; a longer one
        // passes on the way.
        Err(e)
            if matches!(
                e.code(),
                tonic::Code::DeadlineExceeded | tonic::Code::ResourceExhausted
            ) =>
        {
            2
        }
        Err(e) => {
            eprintln!("unexpected: {e:?}");
            3
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_replica_going_away_costs_no_request() {
    let cfg = ClusterConfig { schedulers: 2, ..ClusterConfig::ephemeral() };
    let mut c = timed_cluster(cfg, Duration::from_micros(50)).await;
    let cl = client(&c).await;
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let workers: Vec<_> = (0..4u32)
        .map(|w| {
            let (mut cl, stop, ok, failed) = (cl.clone(), stop.clone(), ok.clone(), failed.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Relaxed) {
                    match generate(&mut cl, &prompt(w * 10_000 + i, 40), 4).await {
                        Ok(_) => ok.fetch_add(1, Ordering::Relaxed),
                        Err(e) => {
                            eprintln!("lost: {e}");
                            failed.fetch_add(1, Ordering::Relaxed)
                        }
                    };
                    i += 1;
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let gone = c.schedulers.pop().expect("two replicas");
    gone.tasks.shutdown().await;
    let before = ok.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(700)).await;
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.await.unwrap();
    }
    let (ok, failed) = (ok.load(Ordering::Relaxed), failed.load(Ordering::Relaxed));
    eprintln!("replica stopped under load: {ok} ok ({} after), {failed} failed", ok - before);
    assert_eq!(failed, 0, "no request lost");
    assert!(ok > before, "requests kept being served");
    c.shutdown().await;
}

/// The only scheduler replica restarted at its address (a deploy, a crash its supervisor
/// restarts): requests arriving while it is away wait for it within their deadline, rather
/// than failing with "no scheduler replica answered" (every one did, at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_waits_for_the_only_scheduler_replica_to_come_back() {
    let mut c = timed_cluster(ClusterConfig::ephemeral(), Duration::from_micros(50)).await;
    let mut cl = client(&c).await;
    generate(&mut cl, &prompt(1, 40), 4).await.expect("served before");
    let gone = c.schedulers.pop().expect("one replica");
    gone.tasks.shutdown().await;
    let asked = Instant::now();
    let (mut during, p) = (cl.clone(), prompt(2, 40));
    let request = tokio::spawn(async move { generate(&mut during, &p, 4).await });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!request.is_finished(), "waiting for a replica, not failed");
    c.start_scheduler(&SchedulerConfig::default(), gone.addr).await.expect("back at its address");
    let (tokens, _) = request.await.unwrap().expect("served once the replica is back");
    assert_eq!(tokens.len(), 4);
    eprintln!("served {:?} after its replica went away", asked.elapsed());
    c.shutdown().await;
}

/// The decode's own bound: a burst of more sequences than the decode advances at once is not
/// let in to slow every stream past its deadline (before, with the prefills keeping up, all of
/// them timed out). What the slots serve in time is served, the rest refused at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_over_the_decodes_slots_is_served_or_refused_at_once_never_timed_out() {
    // 4 sequences a step, 20 ms a step: 40 tokens hold a slot about 0.8 s, and a 2.8 s
    // deadline leaves room for two rounds after the first, the last ending at about 2.4 s
    // (the admission's bound falls half a round past it: a slowdown of 14 % is absorbed).
    let engine = Arc::new(MockEngine::new(MockConfig {
        decode_per_token: Duration::from_millis(20),
        decode_batch: Some(4),
        ..MockConfig::default()
    }));
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.request_timeout = Duration::from_millis(2800);
    let c = Cluster::start_shared(cfg, engine).await.expect("cluster starts");
    let cl = client(&c).await;
    let burst = |n: u32, from: u32| {
        join_all((from..from + n).map(|i| {
            let mut cl = cl.clone();
            async move {
                let started = Instant::now();
                (generate(&mut cl, &prompt(i, 32), 40).await, started.elapsed())
            }
        }))
    };
    type Answer = (Result<(Vec<u32>, handoff_proto::v1::Complete), tonic::Status>, Duration);
    let tally = |answers: Vec<Answer>| {
        let (mut served, mut refused) = (0, 0);
        for (r, took) in answers {
            match r {
                Ok((tokens, _)) => {
                    assert_eq!(tokens.len(), 40);
                    served += 1;
                }
                Err(e) if e.code() == tonic::Code::ResourceExhausted => {
                    refused += 1;
                    assert!(e.message().contains("decode slots full"), "{e:?}");
                    assert!(took < Duration::from_secs(2), "refused at once: {took:?}");
                }
                Err(e) => panic!("only answers or refusals in a burst, got {e:?} after {took:?}"),
            }
        }
        (served, refused)
    };
    // Before any sequence ran to its end, a wait cannot be promised: one round is served.
    assert_eq!(tally(burst(12, 0).await), (4, 8), "cold: the capacity, the rest refused");
    // Now as many rounds as the deadline leaves time for.
    let (served, refused) = tally(burst(48, 100).await);
    eprintln!("decode burst of 48: {served} served, {refused} refused");
    assert!(served >= 8, "what the slots serve in time is served: {served}");
    assert!(refused > 0, "what they cannot is refused");
    let scrape = c.frontend.ops().scrape();
    let by_limit =
        format!("handoff_frontend_refusals_total{{limit=\"decode_slots\"}} {}\n", 8 + refused);
    assert!(scrape.contains(&by_limit), "{by_limit} in {scrape}");
    let mut cl = client(&c).await;
    generate(&mut cl, &prompt(999, 32), 40).await.expect("served right after the burst");
    let slots = c.frontend.decode_slots().expect("the mock's batch bounds the decode");
    // A finished stream's ticket is given back just before the client's last message; on
    // other endings, as its stream's task ends.
    let since = Instant::now();
    while (slots.admitted(), slots.decoding()) != (0, 0) {
        assert!(since.elapsed() < Duration::from_secs(5), "every ticket given back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.shutdown().await;
}

/// A cluster whose frontend decodes one sequence at a time, 20 ms a step, with requests
/// given `timeout`.
async fn one_slot_cluster(timeout: Duration) -> Cluster {
    let engine = Arc::new(MockEngine::new(MockConfig {
        decode_per_token: Duration::from_millis(20),
        ..MockConfig::default()
    }));
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.request_timeout = timeout;
    cfg.frontend.max_decoding = Some(1);
    Cluster::start_shared(cfg, engine).await.expect("cluster starts")
}

/// `max_tokens` tokens after prompt `seed`'s 32, end token ignored.
fn tokens_request(seed: u32, max_tokens: u32) -> GenerateRequest {
    GenerateRequest {
        input: Some(Input::TokenIds(TokenIds { ids: prompt(seed, 32) })),
        sampling: Some(SamplingParams { max_tokens, ignore_eos: true, ..Default::default() }),
        ..Default::default()
    }
}

/// A request of `tokens` tokens on its own task, returned once it holds `c`'s decode slot.
async fn holding_the_slot(
    c: &Cluster,
    cl: &handoff_proto::v1::generate_client::GenerateClient<tonic::transport::Channel>,
    seed: u32,
    tokens: u32,
) -> tokio::task::JoinHandle<Result<(Vec<u32>, handoff_proto::v1::Complete), tonic::Status>> {
    let mut long = cl.clone();
    let first = tokio::spawn(async move { generate(&mut long, &prompt(seed, 32), tokens).await });
    let slots = c.frontend.decode_slots().expect("bounded");
    let since = Instant::now();
    while slots.decoding() == 0 {
        assert!(since.elapsed() < Duration::from_secs(5), "the long request holds the slot");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first
}

/// A request admitted on a wait that turned out longer (a sequence ahead of it decoding for
/// longer than they lately did) gives its slot up when it comes too late for its decode:
/// before any token, rather than decoding into its deadline while the next ones wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_slot_that_comes_too_late_is_given_up_before_any_token() {
    let c = one_slot_cluster(Duration::from_secs(3)).await;
    let mut cl = client(&c).await;
    // Sequences of 20 tokens hold the slot about 0.4 s.
    for i in 0..3 {
        generate(&mut cl, &prompt(i, 32), 20).await.expect("one at a time, each is served");
    }
    // One of 100 tokens holds it 2 s; the next, admitted on a 0.4 s wait, gets it with about
    // 1 s left and 1.6 s of decode to do (it needs at least half its 3 s).
    let first = holding_the_slot(&c, &cl, 10, 100).await;
    let mut stream = cl.generate(tokens_request(11, 80)).await.expect("admitted").into_inner();
    let e = stream.message().await.expect_err("no token, an error");
    assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
    assert!(e.message().contains("a decode slot came with"), "{e:?}");
    let (tokens, _) = first.await.unwrap().expect("the long one is served");
    assert_eq!(tokens.len(), 100);
    c.shutdown().await;
}

/// Requests that hold no decode slot: one of a single token (the prefill's) is answered at
/// once with every slot held (it waited for the slot); one whose client leaves while it
/// waits for a slot gives its place up at once (it counted in everyone's wait until the
/// slot came).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_needing_no_decode_or_left_by_its_client_holds_no_place() {
    let c = one_slot_cluster(Duration::from_secs(60)).await;
    let mut cl = client(&c).await;
    let slots = c.frontend.decode_slots().expect("bounded");
    generate(&mut cl, &prompt(0, 32), 20).await.expect("a hold measured");
    // 200 tokens: the slot is held about 4 s.
    let first = holding_the_slot(&c, &cl, 1, 200).await;
    let asked = Instant::now();
    let (one, _) = generate(&mut cl, &prompt(2, 32), 1).await.expect("a single token is served");
    assert_eq!(one.len(), 1);
    assert!(asked.elapsed() < Duration::from_secs(2), "not after the slot: {:?}", asked.elapsed());
    // A request of 20 tokens waits for the slot; its client then leaves.
    let waiting = cl.generate(tokens_request(3, 20)).await.expect("admitted");
    let since = Instant::now();
    while slots.admitted() < 2 {
        assert!(since.elapsed() < Duration::from_secs(2), "admitted and waiting");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    drop(waiting);
    let left = Instant::now();
    while slots.admitted() > 1 {
        // The slot comes about 4 s after the long one began.
        assert!(left.elapsed() < Duration::from_secs(2), "its place held until the slot came");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.await.unwrap().expect("the long one is served");
    c.shutdown().await;
}

/// A prefill's heartbeat says the uncached work ahead on each dp rank: a request's tokens
/// while it waits or computes, the part its cache holds not counted, none once computed.
/// Scheduler replicas price the rank at no less (work no booking of theirs holds).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heartbeat_says_the_work_ahead_on_each_dp_rank() {
    let c = timed_cluster(
        ClusterConfig { prefills: 1, ..ClusterConfig::ephemeral() },
        Duration::from_millis(10),
    )
    .await;
    let ahead = || c.prefills[0].heartbeat().dp_queued_tokens;
    assert_eq!(ahead(), [0]);
    let mut cl = client(&c).await;
    // 100 tokens at 10 ms: a second of compute.
    let mut other = cl.clone();
    let first = tokio::spawn(async move { generate(&mut other, &prompt(1, 100), 2).await });
    let since = Instant::now();
    while ahead() == [0] {
        assert!(since.elapsed() < Duration::from_secs(5), "the request is counted");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    assert_eq!(ahead(), [100]);
    first.await.unwrap().expect("served");
    assert_eq!(ahead(), [0], "computed: nothing ahead");
    // Cached (its prompt stored after the first), only what it adds counts.
    let since = Instant::now();
    while !c.prefills[0].idle() {
        assert!(since.elapsed() < Duration::from_secs(5), "the prompt stored");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut longer = prompt(1, 100);
    longer.extend(prompt(2, 40));
    let second = tokio::spawn(async move { generate(&mut cl, &longer, 2).await });
    let since = Instant::now();
    while ahead() == [0] {
        assert!(since.elapsed() < Duration::from_secs(5), "the request is counted");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let cached = ahead()[0];
    assert!(cached < 100, "the cached prefix is not ahead: {cached}");
    second.await.unwrap().expect("served");
    c.shutdown().await;
}

/// The requests admitted to the decode hold their prompts' KV while they wait for a slot:
/// past the budget (the transfer inbox's) the next one is refused at once (429) rather than
/// parked (before, time alone bounded them: a burst of long prompts could hold more KV than
/// the host has).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kv_held_for_the_decode_stays_within_its_budget() {
    let engine = Arc::new(MockEngine::new(MockConfig {
        decode_per_token: Duration::from_millis(20),
        ..MockConfig::default()
    }));
    let token_bytes = handoff_engine::Engine::info(&*engine).shape.token_bytes() as u64;
    let mut cfg = ClusterConfig::ephemeral();
    cfg.frontend.max_decoding = Some(1);
    // One prompt of 32 tokens fits, two do not.
    cfg.frontend.inbox.max_total_bytes = 48 * token_bytes;
    let c = Cluster::start_shared(cfg, engine).await.expect("cluster starts");
    let mut cl = client(&c).await;
    let first = holding_the_slot(&c, &cl, 1, 100).await;
    let e = generate(&mut cl, &prompt(2, 32), 10).await.expect_err("refused");
    assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    assert!(e.message().contains("decode KV budget full"), "{e:?}");
    let scrape = c.frontend.ops().scrape();
    assert!(scrape.contains("refusals_total{limit=\"decode_memory\"} 1\n"), "{scrape}");
    first.await.unwrap().expect("the first is served");
    generate(&mut cl, &prompt(3, 32), 10).await.expect("served once the first ended");
    c.shutdown().await;
}
