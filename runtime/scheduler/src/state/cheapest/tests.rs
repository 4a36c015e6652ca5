//! The one-pass pick against the general path's on random fleets.

use std::time::{Duration, Instant};

use handoff_kv_index::{KvIndex, WorkerKey};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::super::Load;
use super::super::gather::{self, SendCosts, SendSpread, Slots};
use super::super::member::{Gate, Route};
use super::super::select::Ask;
use super::{Ties, cheapest};
use crate::policy::{KvAwareWeights, PolicyKind, PolicyParams, Request};
use crate::{Protocol, Protocols};

/// One random fleet: its slots, and what a selection over them asks.
struct Fleet {
    index: KvIndex,
    routes: Vec<Route>,
    load: Vec<Load>,
    remote_load: Vec<Load>,
    run: Vec<u32>,
}

impl Fleet {
    /// `n` slots with few distinct values, so that ties are common; now and then a mixed
    /// page size, a slow link, or most breakers open.
    fn random(rng: &mut StdRng, n: usize, now: Instant) -> Fleet {
        let odd_page = rng.random_bool(0.1);
        let slow_link = rng.random_bool(0.1);
        let ejecting = rng.random_bool(0.1);
        // Ejecting: about half of the breakers open, so the panic threshold falls either way.
        let shut_one_in = if ejecting { 2 } else { 12 };
        let busy = rng.random_bool(0.05);
        let mut f = Fleet {
            index: KvIndex::default(),
            routes: vec![],
            load: vec![],
            remote_load: vec![],
            run: vec![],
        };
        for i in 0..n {
            let key = WorkerKey { instance: format!("p{i}").parse().expect("an id"), dp_rank: 0 };
            f.index.register(&key);
            let gate = match rng.random_range(0..shut_one_in * 2) {
                0 => Gate::Shut,
                1 => Gate::Until(now + Duration::from_secs(1)),
                2 => Gate::Until(now - Duration::from_secs(1)),
                n if n < shut_one_in && ejecting => Gate::Shut,
                _ => Gate::Pass,
            };
            f.routes.push(Route {
                live: rng.random_bool(0.9),
                gate,
                ring: rng.random(),
                page_size: if odd_page && i == n / 2 { 32 } else { 16 },
                token_cost_us: [0.0, 1.0, 50.0][rng.random_range(0..3)],
                send_cost_us: match rng.random_range(0..4) {
                    0 if slow_link => 500.0,
                    0 => f32::NAN,
                    1 => 2.0,
                    _ => 0.0,
                },
                protocol: Protocol::ALL[rng.random_range(0..4)],
                ahead: [0, 0, 300][rng.random_range(0..3)],
            });
            // Busy fleets: counts near the top, so the sums saturate.
            let load = |rng: &mut StdRng| match busy {
                false => Load {
                    in_flight: rng.random_range(0..3),
                    queued_tokens: 16 * rng.random_range(0..3),
                },
                true => Load {
                    in_flight: u32::MAX - rng.random_range(0..2),
                    queued_tokens: u64::MAX - rng.random_range(0..2),
                },
            };
            f.load.push(load(rng));
            f.remote_load.push(if rng.random_bool(0.5) { Load::default() } else { load(rng) });
            f.run.push(rng.random_range(0..4));
        }
        f
    }

    fn slots(&self) -> Slots<'_> {
        Slots {
            routes: &self.routes,
            load: &self.load,
            remote_load: &self.remote_load,
            run: &self.run,
        }
    }
}

/// Whenever the pass decides, it picks what gathering, charging and the policy pick, on
/// thousands of random fleets and asks; and it decides in most of them.
#[test]
fn the_one_pass_pick_is_the_general_paths() {
    let mut rng = StdRng::seed_from_u64(7);
    let now = Instant::now();
    // The default weights, and edges: load alone, compute alone, and an infinite weight
    // (whose product with nothing is undefined).
    let weights = [
        KvAwareWeights::default(),
        KvAwareWeights { prefill: 0.0, load: 1.0, temperature: 0.0 },
        KvAwareWeights { prefill: 1.0, load: 0.0, temperature: 0.0 },
        KvAwareWeights { prefill: f64::INFINITY, load: 0.5, temperature: 0.0 },
    ];
    let (mut ties, mut candidates) = (Ties::default(), Vec::new());
    let (mut decided, mut passed) = (0, 0);
    for round in 0..5_000 {
        let n = rng.random_range(1..40);
        let fleet = Fleet::random(&mut rng, n, now);
        let names: Vec<String> = Protocol::ALL
            .iter()
            .filter(|_| rng.random_bool(0.7))
            .map(|p| p.name().to_owned())
            .collect();
        let exclude: Vec<_> = (0..rng.random_range(0..3))
            .map(|_| format!("p{}", rng.random_range(0..n)).parse().expect("an id"))
            .collect();
        let hashes = [];
        let mut ask = Ask::new(&hashes, rng.random_range(1..200));
        ask.protocols = Protocols::from_names(&names).expect("known names");
        ask.exclude = &exclude;
        let tick = rng.random_range(0..1_000);
        let w = weights[rng.random_range(0..weights.len())];
        let params = PolicyParams { kv_aware: w, ..PolicyParams::default() };
        let fast = cheapest(fleet.slots(), &ask, &fleet.index, now, &w, tick, &mut ties);
        let gathered = gather::gather(&mut candidates, fleet.slots(), &ask, &fleet.index, now);
        gather::charge_sends(&mut candidates, &fleet.routes, gathered.spread);
        let req = Request {
            candidates: &candidates,
            prompt_tokens: ask.prompt_tokens as usize,
            page_size: gathered.page_size,
            hashes: &hashes,
            tick,
        };
        let general = PolicyKind::KvAware.pick(&req, &params).map(|i| &candidates[i]);
        match fast {
            Some(c) => {
                decided += 1;
                assert_eq!(Some(&c), general, "round {round}");
            }
            None => passed += 1,
        }
    }
    assert!(decided > 3_000 && passed > 200, "decided {decided}, passed on {passed}");
}

/// The spread from the least and most link costs is the one from every candidate's send
/// time, whatever the costs: unmeasured (NaN, zero, negative), tiny, huge or infinite.
#[test]
fn the_spread_of_the_extreme_costs_is_every_candidates() {
    let mut rng = StdRng::seed_from_u64(11);
    let odd = [f32::NAN, 0.0, -1.0, 1e-9, 0.3, 2.0, 500.0, 1e30, f32::INFINITY];
    for _ in 0..10_000 {
        let prompt = rng.random_range(1..100_000);
        let (mut each, mut extremes) = (SendSpread::NONE, SendCosts::default());
        for _ in 0..rng.random_range(0..6) {
            let send_cost_us = match rng.random_bool(0.5) {
                true => odd[rng.random_range(0..odd.len())],
                false => rng.random_range(0.0..10.0),
            };
            each.add_route(prompt, &Route { send_cost_us, ..Route::default() });
            extremes.add(send_cost_us);
        }
        assert_eq!(SendSpread::of_costs(prompt, extremes), each);
    }
}
