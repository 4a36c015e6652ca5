//! Partitions on the network-namespace test bed (`fleet`): a frontend cut off from a
//! prefill, a prefill from etcd, a prefill from everything, a scheduler replica from NATS,
//! and a prefill advertising an address that is not its own.

use std::time::{Duration, Instant};

use super::fleet::{A, ETCD, FRONTEND, Fleet, NATS, SCHEDULER, pct, prefill_args};

/// The first frontend cut off from one prefill that the scheduler and the second frontend
/// still reach: every request is served. The first frontend's attempts on the unreachable
/// prefill fail fast and are retried on another; after three that could not get through it passes that prefill
/// over in its own selections, so no later request tries it. The scheduler's breaker for it
/// stays closed: the second frontend reaches it, and its requests never fail an attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frontend_cut_off_from_one_prefill_routes_around_it() {
    let f = Fleet::start().await;
    let mut whole = Vec::new();
    for seed in 0..20 {
        let (ev, ttft) = f.one(seed).await.unwrap();
        assert!(ev.failed_attempts.is_empty(), "all serve while the network is whole: {ev:?}");
        whole.push(ttft);
    }
    let a_ip = f.bed.hosts[A].ip.clone();
    f.bed.cut(FRONTEND, &a_ip);
    let cut = Instant::now();
    let (mut failed_on_a, mut last_failure, mut cut_ttft) = (0u32, None, Vec::new());
    let mut second = std::collections::BTreeMap::<String, u32>::new();
    for seed in 100..160 {
        let (ev, ttft) = f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        cut_ttft.push(ttft);
        assert_ne!(ev.instance_id, "a", "served by a reachable prefill");
        for a in &ev.failed_attempts {
            assert_eq!(a.instance_id, "a", "{a:?}");
            failed_on_a += 1;
            last_failure = Some(cut.elapsed());
        }
        // Another prompt: the same one would be routed to where it was just cached.
        let other = seed + 10_000;
        let (ev, _) = f.one_via_second(other).await.unwrap_or_else(|e| panic!("{other}: {e}"));
        assert!(ev.failed_attempts.is_empty(), "the second frontend reaches all: {ev:?}");
        *second.entry(ev.instance_id).or_default() += 1;
    }
    let instances = f.instances().await;
    let breaker = |id: &str| instances.iter().find(|i| i.instance_id == id).unwrap().breaker_closed;
    whole.sort();
    cut_ttft.sort();
    let costs: Vec<String> = instances
        .iter()
        .map(|i| {
            format!(
                "{} in flight {} prefill {} ns/token send {} ns/token",
                i.instance_id, i.in_flight, i.prefill_ns_per_token, i.send_ns_per_token
            )
        })
        .collect();
    eprintln!("instances after the cut: {costs:?}");
    eprintln!(
        "cut: 60 requests through the cut-off frontend and 60 through the other, 0 failed; {failed_on_a} attempts on the cut-off prefill, the last {last_failure:?} after the cut; the other frontend's served by {second:?}; breakers a closed={} b closed={} c closed={}; TTFT p50/p99 whole {:?}/{:?}, after the cut {:?}/{:?}",
        breaker("a"),
        breaker("b"),
        breaker("c"),
        pct(&whole, 0.5),
        pct(&whole, 0.99),
        pct(&cut_ttft, 0.5),
        pct(&cut_ttft, 0.99)
    );
    // Three that could not get through, and perhaps one handshake that timed out on the way
    // (a deadline, which does not count); then it is passed over.
    let after = handoff_frontend::reach::UNREACHABLE_AFTER;
    assert!(
        (after..=after + 1).contains(&failed_on_a),
        "{failed_on_a} attempts on the cut-off prefill: it is passed over after {after}"
    );
    assert!(second.contains_key("a"), "the other frontend still uses a: {second:?}");
    assert!(breaker("a") && breaker("b") && breaker("c"), "no breaker opened for a partial cut");
    // The scheduler still hears a: it stays registered and heartbeating, just not chosen.
    assert!(instances.iter().any(|i| i.instance_id == "a" && i.routable));
}

/// A prefill cut off from etcd only (NATS and its peers still reachable): its lease lapses and
/// it leaves routing; when the cut heals it registers again and is routed to again. No
/// request fails meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_cut_off_from_etcd_leaves_and_rejoins() {
    let f = Fleet::start().await;
    let listed =
        |all: &[handoff_proto::v1::InstanceStatus]| all.iter().any(|i| i.instance_id == "a");
    let etcd_ip = f.bed.hosts[ETCD].ip.clone();
    f.bed.cut(A, &etcd_ip);
    let cut = Instant::now();
    let mut seed = 0;
    while listed(&f.instances().await) {
        assert!(cut.elapsed() < Duration::from_secs(15), "a's lease lapses");
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        seed += 1;
    }
    let gone = cut.elapsed();
    for _ in 0..10 {
        let (ev, _) = f.one(seed).await.unwrap();
        assert_ne!(ev.instance_id, "a", "out of routing");
        seed += 1;
    }
    f.bed.heal(A, &etcd_ip);
    let healed = Instant::now();
    while !f.instances().await.iter().any(|i| i.instance_id == "a" && i.routable) {
        assert!(healed.elapsed() < Duration::from_secs(20), "a registers again");
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        seed += 1;
    }
    let back = healed.elapsed();
    // Routed to again: some request lands on a.
    let mut on_a = false;
    for _ in 0..40 {
        let (ev, _) = f.one(seed).await.unwrap();
        on_a |= ev.instance_id == "a";
        seed += 1;
    }
    eprintln!(
        "etcd cut: {seed} requests, 0 failed; out of routing {gone:?} after the cut, back {back:?} after the heal"
    );
    assert!(on_a, "a serves again");
}

/// One of two scheduler replicas cut off from NATS, not from the frontend: it hears no more
/// heartbeats, load or KV events, and keeps routing on what it last knew (silence from
/// everyone at once is taken for the bus, not the fleet), while the other replica routes on
/// fresh state. No request fails, through the liveness timeout and well beyond.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduler_cut_off_from_nats_costs_no_request() {
    let f = Fleet::start().await;
    let nats_ip = f.bed.hosts[NATS].ip.clone();
    f.bed.cut(SCHEDULER, &nats_ip);
    let cut = Instant::now();
    let (mut sent, mut by) = (0u32, std::collections::HashMap::<String, u32>::new());
    while cut.elapsed() < Duration::from_secs(8) {
        let (ev, _) = f.one(sent).await.unwrap_or_else(|e| panic!("request {sent} failed: {e}"));
        *by.entry(ev.instance_id).or_default() += 1;
        sent += 1;
    }
    // The cut-off replica still answers, from the state it last knew.
    let listed = f.instances().await;
    eprintln!(
        "nats cut: {sent} requests over 8 s, 0 failed; served by {by:?}; the cut-off replica lists {} instances",
        listed.len()
    );
    assert_eq!(listed.len(), 3, "it still knows the prefills (etcd is reachable)");
    assert!(by.len() == 3, "the prefills keep serving: {by:?}");
}

/// A prefill that advertises another host's address (the scheduler's, where nothing serves
/// its ports) refuses to start: it dials its own directory at the advertised address first, and
/// says which address it could not reach. It never registers; the fleet serves on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_advertised_address_is_refused_at_startup() {
    let f = Fleet::start().await;
    let (h, wrong) = (&f.bed.hosts[A], f.bed.hosts[SCHEDULER].ip.clone());
    let args = [prefill_args("d", h, &wrong), f.discovery.clone()].concat();
    let started = Instant::now();
    let mut child = std::process::Command::new("ip")
        .args(["netns", "exec", &h.ns, env!("CARGO_BIN_EXE_handoff")])
        .args(&args)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // It must exit by itself; one that starts is killed and fails the test (not hangs it).
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(20) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let refused = started.elapsed();
    let mut stderr = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
    assert!(status.is_some_and(|s| !s.success()), "it does not start: {stderr}");
    assert!(
        stderr.contains(&format!("--advertise-host {wrong} is not an address of this host")),
        "warned first: {stderr}"
    );
    assert!(
        stderr.contains(&format!("directory {wrong}:")) && stderr.contains("unreachable"),
        "the error names the address it could not reach: {stderr}"
    );
    for seed in 0..10 {
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
    }
    let ids: Vec<String> = f.instances().await.into_iter().map(|i| i.instance_id).collect();
    eprintln!("wrong address: refused after {refused:?}; 10 requests, 0 failed; instances {ids:?}");
    assert_eq!(ids.len(), 3, "d never registered: {ids:?}");
}

/// A prefill host that loses the network altogether while requests run (its link down): no
/// request fails (an attempt caught on it fails over), it leaves routing when its lease
/// lapses, and when the host comes back it registers again and serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_host_off_the_network_leaves_and_comes_back() {
    let f = Fleet::start().await;
    let listed = |all: &[handoff_proto::v1::InstanceStatus]| {
        all.iter().any(|i| i.instance_id == "a" && i.routable)
    };
    f.bed.isolate(A);
    let cut = Instant::now();
    let (mut seed, mut retried) = (0, 0);
    while listed(&f.instances().await) {
        assert!(cut.elapsed() < Duration::from_secs(15), "a leaves routing");
        let (ev, _) = f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        assert_ne!(ev.instance_id, "a", "nothing is served by a host off the network");
        retried += ev.failed_attempts.len();
        seed += 1;
    }
    let gone = cut.elapsed();
    f.bed.rejoin(A);
    let back = Instant::now();
    while !listed(&f.instances().await) {
        assert!(back.elapsed() < Duration::from_secs(20), "a registers again");
        f.one(seed).await.unwrap_or_else(|e| panic!("request {seed} failed: {e}"));
        seed += 1;
    }
    let rejoined = back.elapsed();
    let mut on_a = false;
    for _ in 0..40 {
        let (ev, _) = f.one(seed + 10_000).await.unwrap();
        on_a |= ev.instance_id == "a";
        seed += 1;
    }
    eprintln!(
        "host off the network: {seed} requests, 0 failed, {retried} attempts retried; out of routing {gone:?} after, back {rejoined:?} after it rejoined"
    );
    assert!(on_a, "a serves again");
}
