//! KV events with a gap: the scheduler notices, asks the instance for a snapshot, and its
//! view of the instance then equals the instance's own.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use handoff::ClusterConfig;
use handoff_core::BlockHash;
use handoff_discovery::events::kv_subject;
use handoff_discovery::{KvEvent, KvEventKind};

use super::support::*;

#[tokio::test]
async fn an_event_gap_is_resynced_to_the_instances_own_view() {
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let mut cl = client(&c).await;
    for seed in 0..4 {
        generate(&mut cl, &prompt(seed, 70), 2).await.unwrap();
    }
    let p = &c.prefills[0];
    let state = c.scheduler.state();
    let view = || state.indexed_blocks(&p.id, 0).into_iter().collect::<BTreeSet<_>>();
    let own = || async { p.snapshot().dp_blocks[0].iter().copied().collect::<BTreeSet<_>>() };
    let wait_equal = |what: &'static str| async move {
        let start = Instant::now();
        loop {
            let (v, o) = (view(), own().await);
            if v == o && !o.is_empty() {
                return v;
            }
            assert!(
                start.elapsed() < Duration::from_secs(5),
                "{what}: scheduler {} blocks, instance {}",
                v.len(),
                o.len()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    // A prompt is cached just after its answer: wait for the instance to hold `n` blocks.
    let own_holds = |n: usize| async move {
        let start = Instant::now();
        while own().await.len() < n {
            assert!(start.elapsed() < Duration::from_secs(5), "{n} blocks cached");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    own_holds(16).await;
    let before = wait_equal("in step").await;
    assert_eq!(before.len(), 16, "4 prompts of 4 full pages");

    // Make the scheduler's view wrong, as lost events would: a correctly numbered event that
    // the instance never sent removes four blocks from the scheduler's view only.
    let (seq, incarnation) = (p.snapshot().seq, p.snapshot().incarnation);
    assert_ne!(incarnation, 0, "the prefill says which process numbers its events");
    let lost: Vec<BlockHash> = before.iter().take(4).copied().collect();
    let publish = |ev: KvEvent| {
        let bus = c.bus.clone();
        async move {
            bus.publish(kv_subject(&ev.instance), serde_json::to_vec(&ev).unwrap().into())
                .await
                .unwrap()
        }
    };
    publish(KvEvent {
        instance: p.id.clone(),
        dp_rank: 0,
        seq: seq + 1,
        incarnation,
        kind: KvEventKind::Removed { blocks: lost },
    })
    .await;
    let start = Instant::now();
    while view().len() != 12 {
        assert!(start.elapsed() < Duration::from_secs(5), "the scheduler applied the removal");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Now an event far ahead: a gap. Its own content must not be applied; the snapshot
    // it triggers must repair the view.
    let bogus = BlockHash(0xdead_beef);
    publish(KvEvent {
        instance: p.id.clone(),
        dp_rank: 0,
        seq: seq + 10,
        incarnation,
        kind: KvEventKind::Stored { parent: None, blocks: vec![bogus] },
    })
    .await;
    let after = wait_equal("after the gap").await;
    assert!(!after.contains(&bogus), "the gapped event was not applied");
    assert_eq!(after, before, "the snapshot restored the lost blocks");
    // Events after the resync apply in order again.
    generate(&mut cl, &prompt(100, 40), 2).await.unwrap();
    own_holds(18).await;
    let before = wait_equal("after the resync").await;
    assert_eq!(before.len(), 18);
    // Another process under the instance's id (a restart never seen to leave), numbering
    // past this one's: not applied as the next event; the resync it asks for is the
    // instance's own view.
    publish(KvEvent {
        instance: p.id.clone(),
        dp_rank: 0,
        seq: p.snapshot().seq + 1,
        incarnation: incarnation.wrapping_add(1).max(1),
        kind: KvEventKind::Stored { parent: None, blocks: vec![bogus] },
    })
    .await;
    // Its own next events come after it on the subject: taken as the next, the forged one
    // would have them dropped as old.
    generate(&mut cl, &prompt(101, 40), 2).await.unwrap();
    own_holds(20).await;
    let after = wait_equal("after another process's event").await;
    assert!(!after.contains(&bogus) && after.is_superset(&before), "{} blocks", after.len());
    c.shutdown().await;
}

/// A prefill idle (running nothing, storing nothing) holds every prompt it answered, one at
/// a time: the prompt's store begins before the request stops counting as running, and
/// counts until the cache holds it (what the model bench waits on before it times the next
/// run).
#[tokio::test]
async fn an_idle_prefill_holds_every_prompt_it_answered_one_at_a_time() {
    let c =
        cluster(ClusterConfig { prefills: 1, prefill_tp: 1, ..ClusterConfig::ephemeral() }).await;
    let mut cl = client(&c).await;
    let p = &c.prefills[0];
    let held = || p.snapshot().dp_blocks[0].len();
    // Full pages only; the default budget (256 MiB) evicts none of these.
    let pages = 70 / handoff_engine::MockConfig::default().page_size;
    for seed in 0..20 {
        generate(&mut cl, &prompt(200 + seed, 70), 1).await.unwrap();
        // No sleep: the first look at idle must already see the prompt's pages.
        let start = Instant::now();
        while !p.idle() {
            assert!(start.elapsed() < Duration::from_secs(5), "the prefill went idle");
            tokio::task::yield_now().await;
        }
        assert_eq!(held(), pages * (seed as usize + 1), "prompt {seed} stored once idle");
    }
    c.shutdown().await;
}
