use handoff_transfer::TransferError;

use super::*;

/// Found in review: one request's own failure (the decode's KV budget in use, a request too
/// large, its time run out) forgot the prefill's ranks, disconnecting the NIXL agent every
/// other request reading from that prefill was using: their reads failed too, and each
/// failure forgot them again. Only a failure that puts the prefill in doubt forgets it.
#[test]
fn only_a_failure_of_the_prefill_forgets_its_ranks() {
    let peer = handoff_transfer::AgentAddr { ip: "10.0.0.1".into(), port: 1 };
    let own = [
        budget_in_use(),
        failure("register", VllmError::TooLarge("1 GiB".into())),
        failure("verify", VllmError::Transfer(TransferError::Timeout("read".into()))),
        FrontendError::because("verify", Cause::Deadline, "attempt deadline passed"),
    ];
    for e in own {
        assert!(!peer_suspect(&e), "{e}");
    }
    let the_prefills = [
        failure("connect", VllmError::SideChannel { addr: "h:1".into(), reason: "refused".into() }),
        failure("resolve-topology", VllmError::Unsupported("layout".into())),
        failure("verify", VllmError::Transfer(TransferError::Io { peer, reason: "reset".into() })),
    ];
    for e in the_prefills {
        assert!(peer_suspect(&e), "{e}");
    }
}

/// Found in review: a read still running when vLLM's lease on its blocks ran out (30 s by
/// default) could finish with another request's KV, written into blocks given away, and
/// vLLM's wire has no checksum: the ranks are told the blocks are still wanted at each tick
/// until the read ends, and not after.
#[tokio::test]
async fn a_read_running_tells_the_ranks_its_blocks_are_still_wanted() {
    let beats = std::cell::Cell::new(0);
    let (tick, ticks) = tokio::sync::mpsc::unbounded_channel::<()>();
    let (done, read) = tokio::sync::oneshot::channel::<u32>();
    let ticks = tokio_stream::wrappers::UnboundedReceiverStream::new(ticks);
    let mut run = std::pin::pin!(leased(read, ticks, || beats.set(beats.get() + 1)));
    assert!(futures::poll!(&mut run).is_pending());
    tick.send(()).unwrap();
    tick.send(()).unwrap();
    assert!(futures::poll!(&mut run).is_pending());
    assert_eq!(beats.get(), 2, "a beat per tick while reading");
    done.send(7).unwrap();
    tick.send(()).unwrap();
    assert_eq!(run.await, Ok(7));
    assert_eq!(beats.get(), 2, "none once the read is done");
}

/// Found in review: a read that runs out of time never forgot the prefill, so one that hung,
/// or restarted behind the same address under the same engine id, timed every read out for
/// good. A second timeout in a row forgets it; a read ending in time between, or one from
/// another side channel, does not count.
#[test]
fn a_second_read_in_a_row_running_out_of_time_forgets_the_prefill() {
    let peers = peers::Peers::default();
    assert!(!peers.timed_out_again("h", 1, true), "the first is the request's own");
    assert!(!peers.timed_out_again("h", 2, true), "another side channel's");
    assert!(peers.timed_out_again("h", 1, true), "the second in a row");
    assert!(!peers.timed_out_again("h", 1, true), "counted afresh once forgotten");
    assert!(!peers.timed_out_again("h", 1, false), "a read in time between");
    assert!(!peers.timed_out_again("h", 1, true));
    assert!(!peers.timed_out_again("h", 1, false));
    assert!(!peers.timed_out_again("h", 1, false), "no failure, nothing forgotten");

    // Found in review: two requests with short deadlines of their own, timing out one after
    // the other, forgot a healthy prefill and failed every read in flight from it.
    let late = FrontendError::because("verify", Cause::Deadline, "attempt deadline passed");
    assert!(!out_of_time_given_enough(Duration::from_millis(300), &late));
    assert!(out_of_time_given_enough(READ_GIVEN_ENOUGH, &late));
    assert!(!out_of_time_given_enough(READ_GIVEN_ENOUGH, &budget_in_use()));
}
