//! Gathering a selection's candidates: a pass over the slots, dense by slot (routes, loads
//! and overlaps walked in step; a second only past the panic threshold), and what a slow
//! link is charged.

use std::time::Instant;

use handoff_kv_index::{KvIndex, Slot};

use super::Load;
use super::member::Route;
use super::select::Ask;
use crate::policy::Candidate;

/// How much longer than the best measured candidate's a KV may take to leave before the link
/// counts as slow, besides twice the best: per-request differences this small are noise
/// (a scheduler hiccup, a busy core), and charging them would steer steady traffic away from
/// an instance on one unlucky measurement until it decays.
const SEND_NOISE_US: u64 = 2_000;

/// The time in microseconds the KV of a `prompt_tokens`-token prompt takes after the compute
/// over a link measured at `cost_us` per token (0 when not measured).
fn send_us(prompt_tokens: u32, cost_us: f32) -> u64 {
    if cost_us.is_nan() || cost_us <= 0.0 {
        return 0;
    }
    (f64::from(prompt_tokens) * f64::from(cost_us)).min(u64::MAX as f64 / 4.0) as u64
}

/// The least and the most of the measured link costs (µs per token) seen, for
/// [`SendSpread::of_costs`]: two comparisons per candidate instead of a send time each.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct SendCosts {
    range: Option<(f32, f32)>,
}

impl SendCosts {
    /// Counts a link measured at `cost_us` (not measured: NaN or not above 0).
    #[inline]
    pub(super) fn add(&mut self, cost_us: f32) {
        if cost_us > 0.0 {
            let (least, most) = self.range.get_or_insert((cost_us, cost_us));
            *least = least.min(cost_us);
            *most = most.max(cost_us);
        }
    }
}

/// Turns each candidate's send time (µs, from [`send_us`]) into what selection charges: the
/// part beyond twice the best measured candidate's and beyond [`SEND_NOISE_US`] more than
/// it, in tokens of the candidate's compute (at least 1 µs per token, so an instance whose
/// compute is not measured yet, or free, still pays for a slow link). Unmeasured candidates
/// set no floor. `spread` is the best measured and the worst send time among them, kept
/// while they were gathered.
pub(super) fn charge_sends(candidates: &mut [Candidate], routes: &[Route], spread: SendSpread) {
    let floor = spread.floor();
    if !spread.charges() {
        // The common case, no slow link: nothing charged (and nothing to clear when no
        // instance reports the time at all).
        if spread.worst > 0 {
            candidates.iter_mut().for_each(|c| c.send_tokens = 0);
        }
        return;
    }
    for c in candidates.iter_mut() {
        let over = c.send_tokens.saturating_sub(floor);
        c.send_tokens = match over {
            0 => 0,
            over => {
                let per_token = f64::from(routes[c.slot.index()].token_cost_us).max(1.0);
                (over as f64 / per_token) as u64
            }
        };
    }
}

/// The best measured and the worst send time (µs) among a selection's candidates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct SendSpread {
    best: u64,
    worst: u64,
}

impl SendSpread {
    pub(super) const NONE: SendSpread = SendSpread { best: u64::MAX, worst: 0 };

    /// The send time up to which nothing is charged: twice the best measured, and at least
    /// [`SEND_NOISE_US`] more than it.
    fn floor(self) -> u64 {
        let best = if self.best == u64::MAX { 0 } else { self.best };
        best.saturating_mul(2).max(best.saturating_add(SEND_NOISE_US))
    }

    /// Whether some candidate's link is slow enough to be charged.
    pub(super) fn charges(self) -> bool {
        self.worst > self.floor()
    }

    /// The spread of `prompt_tokens`-token sends over links with `costs`: the same as adding
    /// each candidate's, since a send time only grows with its link's cost.
    pub(super) fn of_costs(prompt_tokens: u32, costs: SendCosts) -> SendSpread {
        let at = |cost: f32| send_us(prompt_tokens, cost);
        match costs.range {
            Some((least, most)) => SendSpread { best: at(least), worst: at(most) },
            None => SendSpread::NONE,
        }
    }

    /// Counts a candidate sending in `route`'s time a prompt of `prompt_tokens`, and returns
    /// that time (µs).
    pub(super) fn add_route(&mut self, prompt_tokens: u32, route: &Route) -> u64 {
        let send = send_us(prompt_tokens, route.send_cost_us);
        // Unmeasured instances set no floor.
        self.add(send, route.send_cost_us > 0.0);
        send
    }

    fn add(&mut self, send_us: u64, measured: bool) {
        if measured {
            self.best = self.best.min(send_us);
        }
        self.worst = self.worst.max(send_us);
    }
}

/// What selection reads of each slot.
#[derive(Clone, Copy)]
pub(super) struct Slots<'a> {
    pub(super) routes: &'a [Route],
    pub(super) load: &'a [Load],
    pub(super) remote_load: &'a [Load],
    /// Leading prompt blocks each slot holds or has pending.
    pub(super) run: &'a [u32],
}

/// What gathering saw besides the candidates.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gathered {
    /// Live slots (registered, routing), ejected or not.
    pub(super) live: usize,
    /// The candidates' send times.
    pub(super) spread: SendSpread,
    /// Tokens per block (the last candidate's: one model, one page size).
    pub(super) page_size: usize,
}

/// The slot in `slot` as a candidate: its route, this replica's load `l` and the others' `r`
/// summed, with the work its instance last said is queued there that no replica booked, its
/// run of `overlap` blocks, no send charged.
#[inline]
pub(super) fn candidate(slot: Slot, route: &Route, l: &Load, r: &Load, overlap: u32) -> Candidate {
    Candidate {
        slot,
        ring: route.ring,
        overlap_blocks: overlap,
        queued_tokens: l.queued_tokens.saturating_add(r.queued_tokens).saturating_add(route.ahead),
        in_flight: l.in_flight.saturating_add(r.in_flight),
        send_tokens: 0,
    }
}

/// Whether `ask` may go to the (live, admitted by its breaker) slot `s` with `route`: it
/// speaks a protocol the caller drives, and its instance is not excluded.
#[inline]
pub(super) fn eligible(s: usize, route: &Route, ask: &Ask<'_>, index: &KvIndex) -> bool {
    ask.protocols.contains(route.protocol)
        && (ask.exclude.is_empty()
            || !index.key(index.slot_at(s)).is_some_and(|k| ask.exclude.contains(&k.instance)))
}

/// Fills `candidates` with the slots `ask` may go to: live, speaking a protocol it can drive,
/// not excluded, and with their breaker letting requests through, unless failures alone
/// have ejected more than half of the live ones: then (panic threshold) breakers are
/// ignored and traffic spreads over every live slot. Send times are left in microseconds
/// for [`charge_sends`].
pub(super) fn gather(
    candidates: &mut Vec<Candidate>,
    slots: Slots<'_>,
    ask: &Ask<'_>,
    index: &KvIndex,
    now: Instant,
) -> Gathered {
    let mut out = std::mem::take(candidates);
    out.clear();
    out.reserve(slots.routes.len());
    let mut seen = Gathered { live: 0, spread: SendSpread::NONE, page_size: 16 };
    let mut ejected = 0usize;
    let rows = slots.routes.iter().zip(slots.load).zip(slots.remote_load).zip(slots.run);
    let mut take = |s: usize, route: &Route, l: &Load, r: &Load, overlap: u32| {
        if !eligible(s, route, ask, index) {
            return;
        }
        seen.page_size = route.page_size as usize;
        let send = seen.spread.add_route(ask.prompt_tokens, route);
        // Microseconds until `charge_sends` turns them into tokens.
        out.push(Candidate {
            send_tokens: send,
            ..candidate(index.slot_at(s), route, l, r, overlap)
        });
    };
    for (s, (((route, l), r), &overlap)) in rows.clone().enumerate() {
        if !route.live {
            continue;
        }
        seen.live += 1;
        if route.gate.passes(now) {
            take(s, route, l, r, overlap);
        } else {
            ejected += 1;
        }
    }
    // Panic threshold: failures alone never eject more than half of the fleet.
    if ejected * 2 > seen.live {
        for (s, (((route, l), r), &overlap)) in rows.enumerate() {
            if route.live && !route.gate.passes(now) {
                take(s, route, l, r, overlap);
            }
        }
    }
    *candidates = out;
    seen
}
