//! Slow and lossy links on the network-namespace test bed (`fleet`): a prefill on a
//! 100 Mbit/s link, and delay, jitter and loss on every transfer link.

use std::time::{Duration, Instant};

use super::fleet::{A, B, C, FRONTEND, FRONTEND2, Fleet, pct};
use super::netbed::{Counts, Link, Shaper};

/// A prefill whose link sends at most 100 Mbit/s, beside two on the full link, 1000-token
/// prompts (1 MB of the mock's KV each: 80 ms at 100 Mbit/s). Expectation stated: no request
/// fails; the requests the slow prefill serves pay about the KV's time on its link; once its
/// heartbeats carry the time its KV takes after the compute, `kv_aware` prices that like a
/// longer prompt and the big prompts go to the other prefills.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_on_a_100_mbit_link_loses_the_big_prompts_once_measured() {
    let f = Fleet::start().await;
    let mut whole: Vec<Duration> = Vec::new();
    for seed in 0..10 {
        whole.push(f.one_of(seed, 1000).await.unwrap().1);
    }
    f.bed.limit(A, "100mbit");
    let limited = Instant::now();
    let (mut seed, mut slow, mut learning) = (100, Vec::new(), 0);
    // Until both scheduler replicas have heard it: a's heartbeats report its KV's time after
    // the compute well above b's and c's (an event waited for, not a span of time).
    let heard = |all: &[handoff_proto::v1::InstanceStatus]| {
        let send = |id: &str| all.iter().find(|i| i.instance_id == id).map(|i| i.send_ns_per_token);
        matches!((send("a"), send("b"), send("c")),
            (Some(a), Some(b), Some(c)) if a > 4 * b.max(c).max(1))
    };
    while !f.instances_on_both().await.iter().all(|on| heard(on)) {
        assert!(limited.elapsed() < Duration::from_secs(20), "a's slow link reported");
        let (ev, ttft) = f.one_of(seed, 1000).await.unwrap_or_else(|e| panic!("{seed}: {e}"));
        assert!(ev.failed_attempts.is_empty(), "slow is not failed: {ev:?}");
        if ev.instance_id == "a" {
            slow.push(ttft);
        }
        (seed, learning) = (seed + 1, learning + 1);
    }
    let learned = limited.elapsed();
    let mut after = Vec::new();
    for _ in 0..30 {
        let (ev, ttft) = f.one_of(seed, 1000).await.unwrap_or_else(|e| panic!("{seed}: {e}"));
        after.push((ev.instance_id, ttft));
        seed += 1;
    }
    whole.sort();
    slow.sort();
    let mut fast: Vec<Duration> = after.iter().map(|a| a.1).collect();
    fast.sort();
    let on_a = after.iter().filter(|a| a.0 == "a").count();
    eprintln!(
        "100 Mbit on a: {learning} requests of 1000 tokens while it was learned in {learned:?} ({} on a: TTFT p50 {:?}), then 30 with {on_a} on a: TTFT p50 {:?} p99 {:?}; 0 failed; before the limit p50 {:?} p99 {:?}",
        slow.len(),
        slow.get(slow.len() / 2),
        pct(&fast, 0.5),
        pct(&fast, 0.99),
        pct(&whole, 0.5),
        pct(&whole, 0.99)
    );
    // 1000 tokens x 1 KB of KV is 82 ms at 100 Mbit/s (less the bucket's 64 KB burst): a
    // floor set by the link, which no load on this machine can lower.
    assert!(slow.first().is_some_and(|t| *t >= Duration::from_millis(70)), "{slow:?}");
    // One of 30 was seen on a in about one run of 15 with two scheduler replicas and three
    // prefills (not understood yet; see issue 15's note); without the transfer term, half go.
    assert!(on_a <= 1, "the big prompts go to the prefills on the full link: {on_a} of 30 on a");
}

/// 20 ms of delay (give or take 5 ms) and 1 % loss each way on every transfer link: each
/// prefill's packets to both frontends and theirs to each prefill; requests alternate between
/// the frontends. Expectation stated: no request fails; TTFT grows by the round trips the
/// request path makes on those links (about one of 40 ms, and the KV's time), not by a
/// timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_and_loss_on_every_transfer_link_fail_no_request() {
    let f = Fleet::start().await;
    // Warm: every frontend has reached every prefill (directories read, connections open).
    let mut whole = Vec::new();
    for seed in 0..30 {
        let one = if seed % 2 == 0 { f.one(seed).await } else { f.one_via_second(seed).await };
        whole.push(one.unwrap().1);
    }
    let ip = |i: usize| f.bed.hosts[i].ip.as_str();
    let link =
        Link { delay: Duration::from_millis(20), jitter: Duration::from_millis(5), loss: 0.01 };
    let (frontends, prefills) = ([ip(FRONTEND), ip(FRONTEND2)], [ip(A), ip(B), ip(C)]);
    let shapers = [
        f.bed.shape(A, &frontends, link, 1),
        f.bed.shape(B, &frontends, link, 2),
        f.bed.shape(C, &frontends, link, 3),
        f.bed.shape(FRONTEND, &prefills, link, 4),
        f.bed.shape(FRONTEND2, &prefills, link, 5),
    ];
    let (mut shaped, mut retried, mut stages) = (Vec::new(), 0, Vec::new());
    for seed in 100..200 {
        let one = if seed % 2 == 0 { f.one(seed).await } else { f.one_via_second(seed).await };
        let (ev, ttft) = one.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        retried += ev.failed_attempts.len();
        shaped.push(ttft);
        stages.push(ev.stages.unwrap_or_default());
    }
    let counts: Vec<Counts> = shapers.into_iter().map(Shaper::stop).collect();
    let (passed, dropped) = counts.iter().fold((0, 0), |(p, d), c| (p + c.passed, d + c.dropped));
    whole.sort();
    shaped.sort();
    let added = pct(&shaped, 0.5).saturating_sub(pct(&whole, 0.5));
    eprintln!(
        "20 ms +- 5 ms and 1 % loss each way: 100 requests, 0 failed, {retried} attempts retried; {passed} packets delayed, {dropped} dropped; TTFT p50/p99 without {:?}/{:?}, with {:?}/{:?}: p50 +{added:?} ({:.1} round trips of 40 ms)",
        pct(&whole, 0.5),
        pct(&whole, 0.99),
        pct(&shaped, 0.5),
        pct(&shaped, 0.99),
        added.as_secs_f64() / 0.040
    );
    let median = |f: fn(&handoff_proto::v1::StageTimings) -> u64| {
        let mut v: Vec<u64> = stages.iter().map(f).collect();
        v.sort();
        v[v.len() / 2]
    };
    eprintln!(
        "stage medians (us): register {} resolve-topology {} resolve-rank {} connect {} verify {} consume {}",
        median(|s| s.register_us),
        median(|s| s.resolve_topology_us),
        median(|s| s.resolve_rank_us),
        median(|s| s.connect_us),
        median(|s| s.verify_us),
        median(|s| s.consume_us)
    );
    assert!(dropped > 0, "the loss is in effect");
    assert!(added >= Duration::from_millis(35), "the delay is in effect: +{added:?}");
    // The path costs about one round trip plus the KV's time on the link; two would mean a
    // wait crept back into it (the handshakes before the call, the call's answer after the
    // notices), not noise.
    assert!(added < Duration::from_millis(80), "+{added:?}: two round trips or more");
}
