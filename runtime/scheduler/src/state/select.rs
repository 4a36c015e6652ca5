//! Selection and outcomes: the hot path. One lock, one index match into a reused per-slot
//! buffer, one pass over the members building a reused candidate list; no per-candidate
//! map lookups or allocations.

use std::sync::atomic::Ordering;
use std::time::Instant;

use handoff_core::{BlockHash, InstanceId};

use super::{Inner, Load, SchedulerState, Selection};
use crate::SchedulerError;
use crate::policy::{Candidate, PolicyKind, Request};

/// The prefill work a request queues on an instance: its prompt less the blocks the
/// selection expected cached there. A cached instance with many short suffixes queued is
/// less busy than its raw prompt lengths say.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Work {
    /// Prompt length.
    pub prompt_tokens: u32,
    /// Blocks the selection expected cached ([`Selection::cached_blocks`]).
    pub cached_blocks: u32,
}

impl Work {
    /// The work of a prompt with `cached_blocks` expected cached.
    pub fn new(prompt_tokens: u32, cached_blocks: u32) -> Self {
        Work { prompt_tokens, cached_blocks }
    }

    /// Tokens to compute, with pages of `page_size` tokens.
    pub fn tokens(self, page_size: u32) -> u64 {
        let cached = u64::from(self.cached_blocks) * u64::from(page_size);
        u64::from(self.prompt_tokens).saturating_sub(cached)
    }
}

impl SchedulerState {
    fn check_request(
        &self,
        hashes: &[BlockHash],
        prompt_tokens: u32,
        exclude: &[InstanceId],
    ) -> Result<(), SchedulerError> {
        if prompt_tokens == 0 {
            return Err(SchedulerError::Invalid("prompt_tokens must be positive".into()));
        }
        if hashes.len() > self.cfg.max_block_hashes {
            return Err(SchedulerError::Invalid(format!(
                "{} block hashes exceed the limit of {}",
                hashes.len(),
                self.cfg.max_block_hashes
            )));
        }
        if exclude.len() > self.cfg.max_exclude {
            return Err(SchedulerError::Invalid(format!(
                "at most {} exclusions",
                self.cfg.max_exclude
            )));
        }
        Ok(())
    }

    /// Picks where a prompt goes, and counts it in flight there.
    pub fn select(
        &self,
        hashes: &[BlockHash],
        prompt_tokens: u32,
        policy: Option<PolicyKind>,
        exclude: &[InstanceId],
    ) -> Result<Selection, SchedulerError> {
        self.check_request(hashes, prompt_tokens, exclude)?;
        let policy = policy.unwrap_or(self.cfg.default_policy);
        let mut inner = self.lock();
        let Inner {
            members,
            index,
            routes,
            load,
            remote_load,
            run,
            candidates,
            load_dirty,
            pending,
            ..
        } = &mut *inner;
        index.overlaps_into(hashes, run);
        pending.overlay(hashes, run);
        candidates.clear();
        let mut page_size = 16;
        let mut now = None;
        // Dense by slot: routes, loads and overlaps are walked in step.
        let slots = routes.iter().zip(load.iter()).zip(remote_load.iter()).zip(run.iter());
        for (s, (((route, l), r), &overlap)) in slots.enumerate() {
            if !route.live || !route.gate.passes(&mut now) {
                continue;
            }
            let slot = index.slot_at(s);
            if !exclude.is_empty() && index.key(slot).is_some_and(|k| exclude.contains(&k.instance))
            {
                continue;
            }
            page_size = route.page_size as usize;
            candidates.push(Candidate {
                slot,
                ring: route.ring,
                overlap_blocks: overlap as usize,
                queued_tokens: l.queued_tokens + r.queued_tokens,
                in_flight: l.in_flight + r.in_flight,
            });
        }
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let req =
            Request { candidates, prompt_tokens: prompt_tokens as usize, page_size, hashes, tick };
        let Some(i) = policy.pick(&req, &self.cfg.params) else {
            let why = if exclude.is_empty() {
                String::new()
            } else {
                format!(" (excluded {})", exclude.len())
            };
            return Err(SchedulerError::NoInstance(why));
        };
        let c = candidates[i].clone();
        let key = index
            .key(c.slot)
            .cloned()
            .ok_or_else(|| SchedulerError::NoInstance(" (the chosen slot was freed)".into()))?;
        let m = members
            .get_mut(&key.instance)
            .ok_or_else(|| SchedulerError::NoInstance(" (the chosen instance left)".into()))?;
        m.breaker.admits(true);
        let route_changed = m.breaker.gate() != routes[c.slot.index()].gate;
        let work = Work::new(prompt_tokens, c.overlap_blocks as u32).tokens(m.instance.page_size);
        let l = &mut load[c.slot.index()];
        l.in_flight += 1;
        l.queued_tokens += work;
        *load_dirty = true;
        pending.note(c.slot, hashes, Instant::now());
        let selection = Selection {
            instance: m.instance.clone(),
            dp_rank: key.dp_rank,
            cached_blocks: c.overlap_blocks as u32,
        };
        if route_changed {
            inner.sync(&key.instance);
        }
        Ok(selection)
    }

    /// Ends a request's in-flight accounting on (instance, dp rank) — `work` as selected —
    /// and feeds the instance's circuit breaker: `Some(true)` success, `Some(false)` a
    /// prefill-side failure, `None` a failure that is not the prefill's (it does not count).
    /// Unknown instances are ignored.
    pub fn report(&self, instance: &InstanceId, dp_rank: u32, work: Work, outcome: Option<bool>) {
        let mut inner = self.lock();
        let Inner { members, load, load_dirty, pending, .. } = &mut *inner;
        let Some(m) = members.get_mut(instance) else { return };
        if let Some(slot) = m.slots.get(dp_rank as usize) {
            let l: &mut Load = &mut load[slot.index()];
            l.in_flight = l.in_flight.saturating_sub(1);
            l.queued_tokens = l.queued_tokens.saturating_sub(work.tokens(m.instance.page_size));
            *load_dirty = true;
            pending.done(*slot);
        }
        if let Some(ok) = outcome {
            m.breaker.record(ok, &self.cfg.breaker, instance.as_str());
            inner.sync(instance);
        }
    }
}
