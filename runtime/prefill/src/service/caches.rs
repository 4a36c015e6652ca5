//! The prefix caches' side of the service: prompts stored after they are answered, the KV
//! events that tell the schedulers, and snapshots of everything held.

use bytes::Bytes;
use handoff_discovery::snapshot::{PageError, Taken};
use handoff_discovery::{KvEvent, KvEventKind, KvSnapshot, SnapshotAsk, events::kv_subject};
use tracing::{debug, warn};

use super::{PrefillService, lock};
use crate::cache::CacheDelta;

impl PrefillService {
    /// Stores a prompt's pages in dp rank `dp_rank`'s prefix cache and publishes the change,
    /// on the instance's tasks: a store may copy pages (a mostly cached prompt's new ones, or
    /// the survivors of a buffer eviction left half full or less), which for a long prompt takes
    /// milliseconds that the request's answer does not wait for.
    pub(super) fn cache_later(
        &self,
        dp_rank: u32,
        tokens: Vec<u32>,
        hashes: Vec<handoff_core::BlockHash>,
        kv: handoff_engine::Kv,
    ) {
        // A few stores at a time (`MAX_STORES`).
        let Ok(storing) = self.inner.storing.clone().try_acquire_owned() else {
            debug!(dp_rank, "prompt not cached: stores in flight");
            return;
        };
        let svc = self.clone();
        self.inner.tasks.spawn(async move {
            let _storing = storing;
            let store = move || {
                let dp = &svc.inner.dps[dp_rank as usize];
                let _in_order = lock(&dp.publishing);
                let delta = lock(&dp.cache).store(&tokens, &hashes, kv);
                svc.publish(dp_rank, delta);
            };
            if let Err(e) = tokio::task::spawn_blocking(store).await {
                warn!(error = %e, "caching a prompt failed");
            }
        });
    }

    fn publish(&self, dp_rank: u32, delta: CacheDelta) {
        // Draining, it is no longer this id's cache (nor does it answer snapshots): a
        // replacement under the same id numbers its events afresh (another incarnation),
        // which schedulers take as a restart and resync from; this one's would make them
        // resync again at each.
        if self.draining() {
            return;
        }
        let me = &self.inner;
        let mut kinds = Vec::new();
        if !delta.stored.is_empty() {
            kinds.push(KvEventKind::Stored { parent: delta.parent, blocks: delta.stored });
        }
        if !delta.removed.is_empty() {
            kinds.push(KvEventKind::Removed { blocks: delta.removed });
        }
        // One lock across numbering and queueing keeps events in sequence order. A full queue
        // drops the event: its number is used, so schedulers see the gap and resync.
        let mut seq = lock(&me.seq);
        for kind in kinds {
            *seq += 1;
            let incarnation = me.incarnation;
            let ev = KvEvent { instance: me.id.clone(), dp_rank, seq: *seq, kind, incarnation };
            let payload = match serde_json::to_vec(&ev) {
                Ok(p) => Bytes::from(p),
                Err(e) => {
                    warn!(error = %e, "KV event not encodable");
                    continue;
                }
            };
            me.publisher.try_publish(kv_subject(&me.id), payload);
        }
    }

    /// Everything the prefix caches hold, numbered with the last published KV event.
    pub fn snapshot(&self) -> KvSnapshot {
        let me = &self.inner;
        let seq = lock(&me.seq);
        let taken = self.take(*seq);
        KvSnapshot {
            instance: me.id.clone(),
            seq: taken.seq,
            incarnation: taken.incarnation,
            dp_blocks: taken.dp_blocks,
            dp_parents: taken.dp_parents,
            snapshot: 0,
            page: 0,
            pages: 1,
        }
    }

    /// One page of a snapshot of the prefix caches (see [`Snapshots`]).
    pub fn snapshot_page(&self, ask: SnapshotAsk) -> Result<KvSnapshot, PageError> {
        // Numbering waits while the caches are read, so the snapshot is of one moment.
        let seq = lock(&self.inner.seq);
        self.inner.snapshots.page(ask, *seq, || self.take(*seq))
    }

    fn take(&self, seq: u64) -> Taken {
        let (mut dp_blocks, mut dp_parents) = (Vec::new(), Vec::new());
        for d in &self.inner.dps {
            let (parents, blocks) = lock(&d.cache).blocks().into_iter().unzip();
            dp_blocks.push(blocks);
            dp_parents.push(parents);
        }
        Taken { seq, incarnation: self.inner.incarnation, dp_blocks, dp_parents }
    }
}
