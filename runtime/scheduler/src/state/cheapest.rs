//! kv_aware's common case in one pass: the cheapest candidate is found while the slots are
//! walked, with no candidate list built and read again. It decides only when its answer is
//! the one [`gather`](super::gather) and the policy would give: one page size, no slow link
//! charged, the panic threshold not crossed, at least one candidate, no cost undefined (an
//! infinite weight times zero). Otherwise it returns `None` and selection takes the general
//! path.

use std::time::Instant;

use handoff_kv_index::KvIndex;

use super::gather::{SendCosts, SendSpread, Slots, candidate, eligible};
use super::select::Ask;
use crate::policy::{Candidate, KvAwareWeights, kv_aware_cost};

/// The candidates tied for cheapest so far, as (their place among the candidates, slot).
/// Kept between selections, so the pass allocates nothing once warm.
#[derive(Debug, Default)]
pub(super) struct Ties(Vec<(u32, u32)>);

/// The candidate kv_aware (temperature 0) picks for `ask` at `tick`, or `None` when the
/// general path must decide (see the module docs).
///
/// The tie rule is the policy's: lowest cost, then fewest in flight; among full ties the
/// first at or after place `tick % n` among the `n` candidates, else the first. `n` is
/// known only at the end, so the full ties are kept (cleared on every strict improvement).
pub(super) fn cheapest(
    slots: Slots<'_>,
    ask: &Ask<'_>,
    index: &KvIndex,
    now: Instant,
    w: &KvAwareWeights,
    tick: usize,
    ties: &mut Ties,
) -> Option<Candidate> {
    let ties = &mut ties.0;
    ties.clear();
    let prompt = u64::from(ask.prompt_tokens);
    let (mut live, mut ejected, mut n) = (0usize, 0usize, 0u32);
    let mut page: Option<u32> = None;
    let mut sends = SendCosts::default();
    let (mut best_cost, mut best_flight) = (f64::INFINITY, u32::MAX);
    let rows = slots.routes.iter().zip(slots.load).zip(slots.remote_load).zip(slots.run);
    for (s, (((route, l), r), &overlap)) in rows.enumerate() {
        if !route.live {
            continue;
        }
        live += 1;
        if !route.gate.passes(now) {
            ejected += 1;
            continue;
        }
        if !eligible(s, route, ask, index) {
            continue;
        }
        if *page.get_or_insert(route.page_size) != route.page_size {
            return None;
        }
        sends.add(route.send_cost_us);
        let c = candidate(index.slot_at(s), route, l, r, overlap);
        let cost = kv_aware_cost(w, prompt, u64::from(route.page_size), &c);
        if cost.is_nan() {
            // An infinite weight times nothing: the policy's scan keeps such a candidate
            // where it starts, which this pass cannot know yet.
            return None;
        }
        if cost < best_cost || (cost == best_cost && c.in_flight < best_flight) {
            (best_cost, best_flight) = (cost, c.in_flight);
            ties.clear();
        }
        if cost == best_cost && c.in_flight == best_flight {
            ties.push((n, s as u32));
        }
        n += 1;
    }
    // Panic threshold, slow links, or nobody: the general path's to decide.
    let spread = SendSpread::of_costs(ask.prompt_tokens, sends);
    if ejected * 2 > live || spread.charges() || n == 0 {
        return None;
    }
    let start = (tick % n as usize) as u32;
    let &(_, s) = ties.iter().find(|t| t.0 >= start).or(ties.first())?;
    let s = s as usize;
    let (route, l, r) = (&slots.routes[s], &slots.load[s], &slots.remote_load[s]);
    Some(candidate(index.slot_at(s), route, l, r, slots.run[s]))
}

#[cfg(test)]
mod tests;
