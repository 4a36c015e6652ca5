//! The decode's transfer handshakes ride in the Prefill call once the instance has said (in
//! an answer) that it takes them there: no handshake goes over the ranks' transfer
//! connections then. An attempt that carried them and failed makes the next request go the
//! old way, whose answer tells the frontend again. Backends whose handshake carries more
//! (mooncake, nixl) never put them in the call; `path.rs` checks that.

use handoff::{Cluster, ClusterConfig};
use handoff_transfer::{Fault, FaultSwitch};

use super::support::*;

/// Requests whose handshakes came (over the transfer connections, in the call), summed over
/// the cluster's prefill instances.
pub(crate) fn handshakes_via(c: &Cluster) -> (u64, u64) {
    let mut via = (0, 0);
    for p in &c.prefills {
        for line in p.ops().scrape().lines() {
            let Some(rest) = line.strip_prefix("handoff_prefill_handshake_requests_total{") else {
                continue;
            };
            let n: u64 = rest.rsplit(' ').next().unwrap().parse().unwrap();
            if rest.starts_with("via=\"call\"") {
                via.1 += n;
            } else {
                via.0 += n;
            }
        }
    }
    via
}

/// Generates prompt `seed` with the aggregated tokens and no failed attempt; whether its
/// handshakes came in the call.
async fn served_in_call(c: &Cluster, seed: u32) -> bool {
    let before = handshakes_via(c);
    let mut cl = client(c).await;
    let p = prompt(seed, 40 + seed as usize);
    let (tokens, done) = generate(&mut cl, &p, 4).await.unwrap();
    assert_eq!(tokens, aggregated(&*engine(), &p, 4).await, "prompt {seed}");
    let ev = done.evidence.unwrap();
    assert!(ev.failed_attempts.is_empty(), "prompt {seed}: {:?}", ev.failed_attempts);
    let after = handshakes_via(c);
    let in_call = after.1 - before.1;
    assert_eq!((after.0 - before.0) + in_call, 1, "prompt {seed}: one request, one way");
    in_call == 1
}

/// The first request to an instance sends its handshakes over the transfer connections;
/// once the instance's answer has come (within a few requests), every request carries them
/// in the call. Returns the next seed.
async fn until_in_call(c: &Cluster, mut seed: u32) -> u32 {
    assert!(!served_in_call(c, seed).await, "the first goes the old way");
    for _ in 0..20 {
        seed += 1;
        if served_in_call(c, seed).await {
            return seed + 1;
        }
    }
    panic!("no request carried its handshakes in the call");
}

#[tokio::test]
async fn handshakes_ride_in_the_call_once_the_instance_said_it_takes_them() {
    // (prefill tp, pp, dp; decode tp): pp 2 has each decode rank read from two senders; with
    // dp 2 the instance says it takes them only if every dp rank does (which dp rank serves
    // each request is the scheduler's choice, not checked here).
    for (prefill_tp, prefill_pp, prefill_dp, decode_tp) in
        [(2, 1, 1, 1), (1, 1, 1, 2), (2, 1, 1, 2), (2, 2, 1, 1), (1, 2, 1, 2), (1, 1, 2, 1)]
    {
        let cfg = ClusterConfig {
            prefills: 1,
            prefill_tp,
            prefill_pp,
            prefill_dp,
            decode_tp,
            ..ClusterConfig::ephemeral()
        };
        let c = cluster(cfg).await;
        let seed = until_in_call(&c, 0).await;
        for s in seed..seed + 4 {
            let shape = format!("tp {prefill_tp} pp {prefill_pp} dp {prefill_dp} -> {decode_tp}");
            assert!(served_in_call(&c, s).await, "{shape}, prompt {s}");
            // None came the old way as well: a rank would hold it, untaken.
            assert_eq!(c.prefills[0].pending_handshakes(), 0, "prompt {s}");
        }
        assert_eq!(c.frontend.agent().inbox().regions(), 0, "no receive region left behind");
        c.shutdown().await;
    }
}

#[tokio::test]
async fn an_attempt_that_carried_them_and_failed_sends_the_next_the_old_way() {
    let switch = FaultSwitch::new();
    let cfg = ClusterConfig {
        prefills: 1,
        faults: vec![Some(switch.clone())],
        ..ClusterConfig::ephemeral()
    };
    let c = cluster(cfg).await;
    let seed = until_in_call(&c, 0).await;
    switch.arm(Fault::FlipByte, 1);
    let before = handshakes_via(&c);
    let mut cl = client(&c).await;
    // The only instance fails verification: the request fails (no other to retry on).
    let err = generate(&mut cl, &prompt(seed, 50), 4).await.expect_err("the one instance failed");
    assert!(err.message().contains("checksum mismatch"), "{err}");
    assert_eq!(handshakes_via(&c).1 - before.1, 1, "the failed attempt carried them");
    let next = until_in_call(&c, seed + 1).await;
    assert!(served_in_call(&c, next).await);
    c.shutdown().await;
}

/// Handshakes for requests that ended without taking them (refused here for a token outside
/// the vocabulary, before their handshakes came, and after) are dropped, not kept until the
/// table is full: there, every new handshake was refused and the instance blamed.
#[tokio::test]
async fn handshakes_of_requests_that_ended_without_them_are_dropped() {
    use handoff_core::Room;
    use handoff_proto::v1::PrefillRequest;
    use handoff_proto::v1::prefill_client::PrefillClient;
    use handoff_transfer::{AgentAddr, ConnectRequest, RegionId};
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let rank = c.prefills[0].directory.rank(0, 0, 0, 0).unwrap();
    let peer = AgentAddr { ip: rank.rank_ip, port: rank.rank_port };
    let addr = &c.prefills[0].grpc_addr;
    let mut prefill = PrefillClient::connect(format!("http://{addr}")).await.unwrap();
    let handshake = |room| ConnectRequest {
        room,
        receiver: c.frontend.agent().addr(),
        region: RegionId(1),
        region_len: 4096,
        dst_tp_size: 1,
        dst_tp_rank: 0,
        tokens: 3,
        token: None,
    };
    for handshake_first in [true, false] {
        let room = Room::mint();
        if handshake_first {
            c.frontend.agent().connect(&peer, handshake(room)).await.unwrap();
            assert_eq!(c.prefills[0].pending_handshakes(), 1);
        }
        let req = PrefillRequest {
            bootstrap_room: room.get(),
            token_ids: vec![1, u32::MAX],
            ..Default::default()
        };
        let e = prefill.prefill(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e}");
        if !handshake_first {
            c.frontend.agent().connect(&peer, handshake(room)).await.unwrap();
        }
        assert_eq!(c.prefills[0].pending_handshakes(), 0, "handshake first: {handshake_first}");
    }
    c.shutdown().await;
}
