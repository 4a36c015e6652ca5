//! Selection against instance count, both sides doing what their router does per request,
//! with requests booked: [`OUTSTANDING`] stay open throughout, so both price the load and
//! the prefixes of requests routed and not yet done.
//!
//! - handoff: `SchedulerState::select` (index match, pending prefixes, kv_aware, booking);
//!   the oldest booking is reported once [`OUTSTANDING`] are open.
//! - Dynamo: `find_matches` on its concurrent compressed tree, `project_worker_loads` over
//!   its active sequences (their load and prompts), the `SchedulingRequest` its scheduler
//!   builds, `DefaultWorkerSelector::select_worker`, then `add_request` (its booking); the
//!   oldest request is `free`d once [`OUTSTANDING`] are open.
//! - Same pick: with nothing booked, a query whose longest overlap one worker alone holds
//!   must go to that worker on both sides (ties are each side's own to break).

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::time::Duration;

use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{RoutingConstraints, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode, SchedulingRequest};
use dynamo_kv_router::selector::{DefaultWorkerSelector, WorkerSelectionInput, WorkerSelector};
use dynamo_kv_router::test_utils::SimpleWorkerConfig;
use dynamo_kv_router::{
    ActiveSequencesMultiWorker, ConcurrentRadixTreeCompressed, NoopSequencePublisher,
    SequenceRequest,
};
use handoff_benches::PAGE;
use handoff_scheduler::{Ask as Select, Outcome, SchedulerState};
use tokio::time::Instant;

use crate::index::Queries;
use crate::p50_per_call;

/// Requests booked while selections are timed.
pub(crate) const OUTSTANDING: usize = 128;

/// p50 per selection, ours, with [`OUTSTANDING`] requests booked.
pub(crate) fn time_ours(state: &SchedulerState, q: &Queries, depth: u64) -> Duration {
    let tokens = depth as u32 * PAGE;
    let mut open = VecDeque::new();
    let mut select = |i: usize| {
        let s = state.select(&Select::new(&q.ours[i], tokens)).unwrap_or_else(|e| panic!("{e}"));
        open.push_back(s.booking);
        if open.len() > OUTSTANDING
            && let Some(b) = open.pop_front()
        {
            state.report(b, Outcome::Success);
        }
        s.dp_rank
    };
    for i in 0..OUTSTANDING {
        select(i);
    }
    let t = p50_per_call(|i| {
        black_box(select(i));
    });
    for b in open {
        state.report(b, Outcome::Success);
    }
    t
}

/// Dynamo's router for `w_count` workers over `tree`: its selector and its active sequences.
pub(crate) struct Dynamo<'a> {
    tree: &'a ConcurrentRadixTreeCompressed,
    workers: HashMap<u64, SimpleWorkerConfig>,
    selector: DefaultWorkerSelector,
    active: ActiveSequencesMultiWorker<NoopSequencePublisher>,
    tokens: usize,
}

impl<'a> Dynamo<'a> {
    pub(crate) fn new(tree: &'a ConcurrentRadixTreeCompressed, w_count: u64, depth: u64) -> Self {
        let workers = (0..w_count).map(|w| (w, SimpleWorkerConfig::default())).collect();
        let ranks = (0..w_count).map(|w| (w, (0, 1))).collect();
        Dynamo {
            tree,
            workers,
            selector: DefaultWorkerSelector::new(None, "prefill"),
            active: ActiveSequencesMultiWorker::new_without_expiry(
                NoopSequencePublisher,
                PAGE as usize,
                ranks,
                false,
                0,
                "prefill",
            ),
            tokens: depth as usize * PAGE as usize,
        }
    }

    /// Picks a worker for query `i` of `q`; with `book`, books it as request `id`.
    fn select(&self, q: &Queries, i: usize, book: Option<&str>) -> WorkerWithDpRank {
        let now = Instant::now();
        let scores = self.tree.find_matches(&q.theirs[i], false).scores;
        let mut overlap = OverlapSignals::default();
        for (w, &blocks) in &scores {
            overlap.tier_overlap_blocks.device.insert(*w, blocks as usize);
            overlap.effective_overlap_blocks.insert(*w, f64::from(blocks));
            overlap.effective_cached_tokens.insert(*w, blocks as usize * PAGE as usize);
        }
        let hashes: Vec<u64> = q.theirs[i].iter().map(|h| h.0).collect();
        let request = SchedulingRequest {
            mode: match book {
                Some(id) => ScheduleMode::Tracked { request_id: id.to_owned() },
                None => ScheduleMode::QueryOnly { request_id: None },
            },
            token_seq: Some(hashes.clone()),
            isl_tokens: self.tokens,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            worker_loads: self.active.project_worker_loads(Some(&hashes), now),
            track_prefill_tokens: true,
            router_config_override: None,
            lora_name: None,
            priority_jump: 0.0,
            strict_priority: 0,
            policy_class: None,
            session_context: None,
            expected_output_tokens: None,
            affinity_target: None,
            pinned_worker: None,
            allowed_worker_ids: None,
            routing_constraints: RoutingConstraints::default(),
            shared_cache_hits: None,
            resp_tx: None,
        };
        let input =
            WorkerSelectionInput::configured(&self.workers, &request, request.eligibility(), PAGE);
        let picked = self.selector.select_worker(input).unwrap_or_else(|e| panic!("{e}")).worker;
        if let Some(id) = book {
            let req = SequenceRequest {
                request_id: id.to_owned(),
                token_sequence: Some(hashes),
                track_prefill_tokens: true,
                expected_output_tokens: None,
                prefill_load_hint: None,
                worker: picked,
                lora_name: None,
            };
            self.active.add_request(req, now).unwrap_or_else(|e| panic!("{e}"));
        }
        picked
    }

    /// p50 per selection, with [`OUTSTANDING`] requests booked.
    pub(crate) fn time(&self, q: &Queries) -> Duration {
        let mut open = VecDeque::new();
        let mut next = 0u64;
        let mut select = |i: usize| {
            next += 1;
            let id = format!("r{next}");
            let picked = self.select(q, i, Some(&id));
            open.push_back(id);
            if open.len() > OUTSTANDING
                && let Some(done) = open.pop_front()
            {
                self.active.free(&done, Instant::now()).unwrap_or_else(|e| panic!("{e}"));
            }
            picked
        };
        for i in 0..OUTSTANDING {
            select(i);
        }
        let t = p50_per_call(|i| {
            black_box(select(i));
        });
        for id in open {
            let _ = self.active.free(&id, Instant::now());
        }
        t
    }
}

/// Of the first `n` queries of `q` whose longest overlap one worker alone holds: how many
/// went to that worker on both sides, and how many there were. Nothing is booked.
pub(crate) fn same_picks(
    state: &SchedulerState,
    dynamo: &Dynamo<'_>,
    q: &Queries,
    depth: u64,
    n: usize,
) -> (usize, usize) {
    let tokens = depth as u32 * PAGE;
    let (mut agree, mut unique) = (0, 0);
    for i in 0..n.min(q.ours.len()) {
        let scores = dynamo.tree.find_matches(&q.theirs[i], false).scores;
        let best = scores.values().copied().max().unwrap_or(0);
        let holders: Vec<_> = scores.iter().filter(|(_, s)| **s == best).collect();
        if best == 0 || holders.len() != 1 {
            continue;
        }
        unique += 1;
        let want = holders[0].0.worker_id;
        let ours = state.select(&Select::new(&q.ours[i], tokens)).unwrap_or_else(|e| panic!("{e}"));
        state.report(ours.booking, Outcome::Success);
        let mine = ours.instance.id.to_string();
        let theirs = dynamo.select(q, i, None).worker_id;
        if mine == format!("w{want}") && theirs == want {
            agree += 1;
        }
    }
    (agree, unique)
}
