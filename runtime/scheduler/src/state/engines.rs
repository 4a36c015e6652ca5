//! Engine instances (vLLM, SGLang) in the scheduler: registered here, not in discovery, and
//! kept across discovery resets; their index slots fed by their own KV event streams
//! (`handoff_kv_events`), not by handoff's bus; their liveness from those streams and a
//! health probe, never from heartbeats, and never resynced from a handoff snapshot.

use std::time::Instant;

use handoff_core::InstanceId;
use handoff_discovery::Instance;
use handoff_kv_events::IndexOp;
use tracing::{info, warn};

use super::SchedulerState;

impl SchedulerState {
    /// Registers an engine instance (routable at once, as if just heard from). Refused
    /// (`false`) when its id is already taken, by a prefill instance or another engine.
    pub fn add_engine(&self, instance: Instance) -> bool {
        self.add_engine_at(instance, Instant::now())
    }

    /// [`SchedulerState::add_engine`] as of `now`.
    pub fn add_engine_at(&self, instance: Instance, now: Instant) -> bool {
        let mut inner = self.lock();
        let id = instance.id.clone();
        if inner.members.contains_key(&id) {
            warn!(instance = %id, "engine not added: its id is taken");
            return false;
        }
        info!(instance = %id, "engine instance added");
        inner.engines.insert(id.clone());
        inner.admit(instance, now);
        if let Some(m) = inner.members.get_mut(&id) {
            // Its index comes from its own stream: never ask it for a handoff snapshot.
            m.seq = Some(0);
        }
        true
    }

    /// The engine `id` was heard from (an event, or an answered health probe) at `now`.
    pub fn engine_heard_at(&self, id: &InstanceId, now: Instant) {
        let mut inner = self.lock();
        let Some(m) = inner.members.get_mut(id) else { return };
        m.seen = now;
        m.seq = Some(0);
        let resumed = std::mem::replace(&mut m.silent, false);
        if resumed {
            info!(instance = %id, "engine heard again; back in routing");
            inner.sync(id);
        }
    }

    /// Applies what an engine's event stream says about its dp rank `dp_rank`. `epoch` is
    /// the stream's count of the engine's clears as it last saw it: when the engine was
    /// silenced (its entries cleared) since, or is silent now, nothing is applied, `epoch` is
    /// brought up to date and `false` says the stream must start its block map over (children
    /// of cleared blocks would hang off nothing).
    pub fn apply_engine_ops(
        &self,
        id: &InstanceId,
        dp_rank: u32,
        epoch: &mut u64,
        ops: Vec<IndexOp>,
    ) -> bool {
        let mut ops = ops.into_iter().peekable();
        loop {
            let mut inner = self.lock();
            let super::Inner { members, index, .. } = &mut *inner;
            let Some(m) = members.get(id) else { return false };
            if !m.routable() || m.cleared != *epoch {
                *epoch = m.cleared;
                return false;
            }
            let Some(&slot) = m.slots.get(dp_rank as usize) else { return false };
            let mut clearing = false;
            // Up to a clear: the clear is then finished a step per hold of the lock before
            // the next op (a store into a slot being cleared would finish it in one hold).
            for op in ops.by_ref() {
                match op {
                    IndexOp::Store { parent, blocks } => index.store_at(slot, parent, &blocks),
                    IndexOp::Remove { blocks } => index.remove_at(slot, &blocks),
                    IndexOp::Clear => {
                        index.begin_clear_at(slot);
                        clearing = true;
                        break;
                    }
                }
            }
            drop(inner);
            if clearing {
                self.settle_index();
            }
            if ops.peek().is_none() {
                return true;
            }
        }
    }

    /// Forgets the engine `id`: out of routing, its index entries dropped.
    pub fn remove_engine(&self, id: &InstanceId) {
        let mut inner = self.lock();
        if inner.engines.remove(id) {
            info!(instance = %id, "engine instance removed");
            inner.drop_member(id);
        }
        drop(inner);
        self.settle_index();
    }

    /// Whether `id` is an engine instance registered here.
    pub fn is_engine(&self, id: &InstanceId) -> bool {
        self.lock().engines.contains(id)
    }
}
