//! Selection and outcomes: the hot path. One lock, one index match into a reused per-slot
//! buffer, one pass over the members building a reused candidate list; no per-candidate
//! map lookups or allocations.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use handoff_core::{BlockHash, InstanceId};
use handoff_kv_index::KvIndex;
use tracing::{debug, info};

use super::admission::{self, Admitted, Budget};
use super::bookings::{Booking, BookingId};
use super::member::Gate;
use super::{Inner, SchedulerState, Selection};
use super::{cheapest, gather, pending};
use crate::policy::{Candidate, PolicyKind, Request};
use crate::rejects::Reject;
use crate::{Protocols, SchedulerError};

/// How an attempt ended, as far as its instance is concerned (the wire's `Outcome`). Only
/// [`Outcome::InstanceFault`] counts against the instance's circuit breaker: overload,
/// deadlines, cancellation, bad input and the decode's own faults say nothing about it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// KV verified and loaded.
    Success,
    /// Refused or reset connections, a transfer that failed verification, an internal error.
    InstanceFault,
    /// The instance refused for overload.
    Overloaded,
    /// The request's own deadline passed.
    Deadline,
    /// The client went away.
    Cancelled,
    /// The request was invalid.
    Invalid,
    /// The decode's own step failed.
    DecodeFault,
}

impl Outcome {
    /// Every outcome, in the order of [`Endings::reported`](super::Endings).
    pub const ALL: [Outcome; 7] = [
        Outcome::Success,
        Outcome::InstanceFault,
        Outcome::Overloaded,
        Outcome::Deadline,
        Outcome::Cancelled,
        Outcome::Invalid,
        Outcome::DecodeFault,
    ];

    /// What the breaker hears: success, a fault, or nothing.
    fn breaker(self) -> Option<bool> {
        match self {
            Outcome::Success => Some(true),
            Outcome::InstanceFault => Some(false),
            _ => None,
        }
    }
}

/// One selection request.
#[derive(Debug, Clone, Copy)]
pub struct Ask<'a> {
    /// The prompt's chained block hashes.
    pub hashes: &'a [BlockHash],
    /// Prompt length.
    pub prompt_tokens: u32,
    /// The policy, `None` for the scheduler's default.
    pub policy: Option<PolicyKind>,
    /// Instances not to pick.
    pub exclude: &'a [InstanceId],
    /// Time left before the request's deadline, if it has one.
    pub deadline: Option<Duration>,
    /// The protocols the caller can drive: instances speaking others are not chosen.
    pub protocols: Protocols,
    /// The asking frontend (as registered): its bookings expire soon after it leaves
    /// discovery ([`SchedulerState::frontend_left_at`]).
    pub owner: Option<&'a InstanceId>,
}

impl<'a> Ask<'a> {
    /// A request for `hashes` of a `prompt_tokens`-token prompt, default policy, no deadline.
    pub fn new(hashes: &'a [BlockHash], prompt_tokens: u32) -> Self {
        Ask {
            hashes,
            prompt_tokens,
            policy: None,
            exclude: &[],
            deadline: None,
            protocols: Protocols::ANY,
            owner: None,
        }
    }
}

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

/// What one selection's pass over the slots reads.
#[derive(Clone, Copy)]
struct Pass<'a, 'b> {
    slots: gather::Slots<'a>,
    ask: &'a Ask<'b>,
    index: &'a KvIndex,
    now: Instant,
    tick: usize,
    budget: Budget,
}

impl SchedulerState {
    fn check_request(&self, ask: &Ask<'_>) -> Result<(), SchedulerError> {
        if ask.prompt_tokens == 0 {
            return Err(SchedulerError::Invalid("prompt_tokens must be positive".into()));
        }
        if ask.hashes.len() > self.cfg.max_block_hashes {
            return Err(SchedulerError::Invalid(format!(
                "{} block hashes exceed the limit of {}",
                ask.hashes.len(),
                self.cfg.max_block_hashes
            )));
        }
        if ask.exclude.len() > self.cfg.max_exclude {
            return Err(SchedulerError::Invalid(format!(
                "at most {} exclusions",
                self.cfg.max_exclude
            )));
        }
        Ok(())
    }

    /// Picks where a prompt goes and books it there (its load counted until the booking
    /// ends), or refuses it at once when no candidate can start it in time.
    pub fn select(&self, ask: &Ask<'_>) -> Result<Selection, SchedulerError> {
        let started = Instant::now();
        let chosen = self.select_at(ask, started);
        let policy = ask.policy.unwrap_or(self.cfg.default_policy);
        self.metrics.selected(policy, chosen.as_ref().map(|_| ()), started.elapsed());
        chosen
    }

    /// [`SchedulerState::select`] as of `now`.
    pub fn select_at(&self, ask: &Ask<'_>, now: Instant) -> Result<Selection, SchedulerError> {
        self.check_request(ask)?;
        let policy = ask.policy.unwrap_or(self.cfg.default_policy);
        let mut inner = self.lock();
        if inner.bookings.len() >= self.cfg.max_bookings {
            inner.expire_bookings(now);
            if inner.bookings.len() >= self.cfg.max_bookings {
                return Err(SchedulerError::Overloaded {
                    retry_after: Duration::from_secs(1),
                    reason: format!("{} requests in flight", self.cfg.max_bookings),
                });
            }
        }
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
            bookings,
            routed,
            ties,
            ..
        } = &mut *inner;
        let hashes = ask.hashes;
        index.overlaps_into(hashes, run);
        pending.overlay(hashes, run);
        let slots = gather::Slots { routes, load, remote_load, run: run.as_slice() };
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let budget = Budget { max_wait: self.cfg.max_queue_wait, deadline: ask.deadline };
        let cost_us = |c: &Candidate| {
            let r = &routes[c.slot.index()];
            (r.token_cost_us, r.page_size)
        };
        let w = &self.cfg.params.kv_aware;
        let fast = (policy == PolicyKind::KvAware && w.temperature == 0.0)
            .then(|| cheapest::cheapest(slots, ask, index, now, w, tick, ties))
            .flatten()
            .and_then(|c| {
                let fits = admission::admit(
                    std::slice::from_ref(&c),
                    0,
                    ask.prompt_tokens,
                    budget,
                    cost_us,
                );
                fits.ok().map(|a| (c, a))
            });
        let (c, admitted) = match fast {
            Some(picked) => picked,
            None => {
                let pass = Pass { slots, ask, index, now, tick, budget };
                self.pick_general(pass, policy, candidates, cost_us)?
            }
        };
        let key = index
            .key(c.slot)
            .cloned()
            .ok_or_else(|| SchedulerError::NoInstance(" (the chosen slot was freed)".into()))?;
        let m = members
            .get_mut(&key.instance)
            .ok_or_else(|| SchedulerError::NoInstance(" (the chosen instance left)".into()))?;
        let probing = m.breaker.gate() == Gate::Shut;
        m.breaker.admits(true);
        let probe = !probing && m.breaker.gate() == Gate::Shut;
        let route_changed = m.breaker.gate() != routes[c.slot.index()].gate;
        let work = Work::new(ask.prompt_tokens, c.overlap_blocks).tokens(m.instance.page_size);
        let l = &mut load[c.slot.index()];
        l.in_flight += 1;
        l.queued_tokens += work;
        *load_dirty = true;
        let noted = pending.note(c.slot, hashes, now, pending::TTL);
        if noted.is_some() {
            routed.push(&key, hashes);
        }
        let ttl = ask.deadline.unwrap_or(self.cfg.booking_ttl) + self.cfg.booking_grace;
        let booking = bookings.open(Booking {
            slot: c.slot,
            instance: key.instance.clone(),
            tokens: work,
            pending: noted,
            until: now + ttl.min(self.cfg.booking_ttl_max),
            probe,
            owner: ask.owner.cloned(),
            cut_from: None,
        });
        let selection = Selection {
            instance: m.instance.clone(),
            dp_rank: key.dp_rank,
            cached_blocks: c.overlap_blocks,
            booking,
            expected_wait: admitted.wait,
            expected_prefill: admitted.own,
        };
        if route_changed {
            inner.sync(&key.instance);
        }
        Ok(selection)
    }

    /// The general path: every candidate gathered, slow links charged, the policy's pick,
    /// and admission over them all.
    fn pick_general(
        &self,
        pass: Pass<'_, '_>,
        policy: PolicyKind,
        candidates: &mut Vec<Candidate>,
        cost_us: impl Fn(&Candidate) -> (f32, u32),
    ) -> Result<(Candidate, Admitted), SchedulerError> {
        let Pass { slots, ask, index, now, tick, budget } = pass;
        let gathered = gather::gather(candidates, slots, ask, index, now);
        let (live, page_size) = (gathered.live, gathered.page_size);
        // Only a link well slower than the best measured one counts: within twice the best, or
        // a couple of milliseconds more, is noise, and equals must keep taking turns.
        gather::charge_sends(candidates, slots.routes, gathered.spread);
        let req = Request {
            candidates,
            prompt_tokens: ask.prompt_tokens as usize,
            page_size,
            hashes: ask.hashes,
            tick,
        };
        let Some(pick) = policy.pick(&req, &self.cfg.params) else {
            let why = match (live, ask.exclude.len()) {
                (0, _) => " (none registered and live)".to_owned(),
                (_, 0) => String::new(),
                (_, n) => format!(" (excluded {n})"),
            };
            return Err(SchedulerError::NoInstance(why));
        };
        let admitted =
            admission::admit(candidates, pick, ask.prompt_tokens, budget, cost_us).map_err(
                |r| SchedulerError::Overloaded { retry_after: r.retry_after, reason: r.reason },
            )?;
        Ok((candidates[admitted.index].clone(), admitted))
    }

    /// Ends `booking`: its load and pending prefix come off its instance, and its outcome
    /// feeds the instance's circuit breaker. Idempotent: returns `false` (and changes
    /// nothing) when the booking is not open: reported before, expired, or its instance gone.
    pub fn report(&self, booking: BookingId, outcome: Outcome) -> bool {
        let mut inner = self.lock();
        let Some(b) = inner.bookings.close(booking) else {
            self.rejects.note(
                Reject::UnknownBooking,
                &format_args!(
                    "booking {} ({outcome:?}): already ended, expired, or never made",
                    booking.0
                ),
            );
            return false;
        };
        self.metrics.reported(outcome);
        inner.release(&b);
        if let Some(m) = inner.members.get_mut(&b.instance) {
            m.endings.reported[outcome as usize] += 1;
            // Half-open, only the probe speaks for the instance: a booking made before the
            // breaker opened neither closes it nor frees the probe's place.
            if b.probe || !m.breaker.half_open() {
                match outcome.breaker() {
                    Some(ok) => m.breaker.record(ok, &self.cfg.breaker, b.instance.as_str()),
                    None => m.breaker.release_probe(),
                }
            }
            inner.sync(&b.instance);
        }
        true
    }

    /// `frontend` left discovery at `now`: stopped, or killed and its lease lapsed (then none
    /// of its bookings will be reported). Its open bookings expire within the booking grace
    /// from now, not up to their requests' deadlines later: a frontend killed leaves its
    /// load counted seconds, not a minute; one alive after all (its lease lapsed while it
    /// was cut off from etcd) ends them by its reports, and registering again within the
    /// grace has them back ([`SchedulerState::frontend_back`]).
    /// Returns how many it holds. (Registered again, see
    /// [`SchedulerState::frontend_back`].)
    pub fn frontend_left_at(&self, frontend: &InstanceId, now: Instant) -> usize {
        let until = now + self.cfg.booking_grace;
        let n = self.lock().bookings.cut_short_owned_by(frontend, until);
        if n > 0 {
            info!(%frontend, bookings = n, "frontend left; its open bookings expire soon");
        }
        n
    }

    /// `frontend` registered again (alive: its lease had lapsed while it was cut off from
    /// etcd): its bookings still open get back the expiry they had before it left. Returns
    /// how many.
    pub fn frontend_back(&self, frontend: &InstanceId) -> usize {
        let n = self.lock().bookings.restore_owned_by(frontend);
        if n > 0 {
            info!(%frontend, bookings = n, "frontend back; its open bookings kept");
        }
        n
    }

    /// Open bookings (requests selected and not yet reported).
    pub fn open_bookings(&self) -> usize {
        self.lock().bookings.len()
    }
}

impl Inner {
    /// Takes a closed booking's load and pending prefix off its slot.
    pub(super) fn release(&mut self, b: &Booking) {
        if let Some(l) = self.load.get_mut(b.slot.index()) {
            l.in_flight = l.in_flight.saturating_sub(1);
            l.queued_tokens = l.queued_tokens.saturating_sub(b.tokens);
            self.load_dirty = true;
        }
        if let Some(id) = b.pending {
            self.pending.remove(id);
        }
    }

    /// Ends every booking past its time: their requests were never reported.
    pub(super) fn expire_bookings(&mut self, now: Instant) {
        let expired = self.bookings.expire(now);
        if !expired.is_empty() {
            debug!(n = expired.len(), "bookings expired unreported");
        }
        for b in &expired {
            self.end_unreported(b);
        }
    }

    /// Takes a booking that will never be reported off its slot; a probe among them says
    /// nothing of its instance: given back, the next request probes again.
    fn end_unreported(&mut self, b: &Booking) {
        self.release(b);
        let Some(m) = self.members.get_mut(&b.instance) else { return };
        m.endings.expired += 1;
        if b.probe {
            m.breaker.release_probe();
            self.sync(&b.instance);
        }
    }
}
