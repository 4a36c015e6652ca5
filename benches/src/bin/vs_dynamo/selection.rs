//! Selection against instance count, both sides doing what their router does per request:
//! match the prompt in the index, price every worker, pick one.
//!
//! - handoff: `SchedulerState::select` (index match, candidates, kv_aware, booking) and the
//!   `report` that ends the booking.
//! - Dynamo: `find_matches` on its concurrent compressed radix tree, the `SchedulingRequest`
//!   its scheduler builds from the scores (overlap per worker, a load projection per
//!   worker), and `DefaultWorkerSelector::select_worker`.

use std::collections::HashMap;
use std::hint::black_box;
use std::time::Duration;

use dynamo_kv_router::ConcurrentRadixTreeCompressed;
use dynamo_kv_router::WorkerLoadProjection;
use dynamo_kv_router::indexer::SyncIndexer;
use dynamo_kv_router::protocols::{LocalBlockHash, RoutingConstraints, WorkerWithDpRank};
use dynamo_kv_router::scheduling::{OverlapSignals, ScheduleMode, SchedulingRequest};
use dynamo_kv_router::selector::{DefaultWorkerSelector, WorkerSelectionInput, WorkerSelector};
use dynamo_kv_router::test_utils::SimpleWorkerConfig;
use handoff_benches::{DEPTH, PAGE};
use handoff_core::BlockHash;
use handoff_scheduler::{Ask, Outcome, SchedulerState};
use rustc_hash::FxHashMap;

use crate::p50_per_call;

/// p50 per selection, ours.
pub(crate) fn time_ours(state: &SchedulerState, queries: &[Vec<BlockHash>]) -> Duration {
    let tokens = DEPTH as u32 * PAGE;
    p50_per_call(|q| {
        let s = state.select(&Ask::new(&queries[q], tokens)).unwrap_or_else(|e| panic!("{e}"));
        state.report(s.booking, Outcome::Success);
        black_box(s.dp_rank);
    })
}

/// p50 per selection, Dynamo.
pub(crate) fn time_dynamo(
    tree: &ConcurrentRadixTreeCompressed,
    w_count: u64,
    queries: &[Vec<LocalBlockHash>],
) -> Duration {
    let workers: HashMap<u64, SimpleWorkerConfig> =
        (0..w_count).map(|w| (w, SimpleWorkerConfig::default())).collect();
    let selector = DefaultWorkerSelector::new(None, "prefill");
    let tokens = DEPTH as usize * PAGE as usize;
    p50_per_call(|q| {
        let scores = tree.find_matches(&queries[q], false).scores;
        let mut overlap = OverlapSignals::default();
        for (w, &blocks) in &scores {
            overlap.tier_overlap_blocks.device.insert(*w, blocks as usize);
            overlap.effective_overlap_blocks.insert(*w, f64::from(blocks));
            overlap.effective_cached_tokens.insert(*w, blocks as usize * PAGE as usize);
        }
        let worker_loads: FxHashMap<WorkerWithDpRank, WorkerLoadProjection> = (0..w_count)
            .map(|w| {
                let key = WorkerWithDpRank { worker_id: w, dp_rank: 0 };
                let cached = scores.get(&key).copied().unwrap_or(0) as usize * PAGE as usize;
                let load = WorkerLoadProjection {
                    active_prefill_tokens: tokens - cached,
                    active_decode_blocks: 0,
                    active_requests: 0,
                    additional_active_blocks: DEPTH as usize,
                };
                (key, load)
            })
            .collect();
        let request = SchedulingRequest {
            mode: ScheduleMode::QueryOnly { request_id: None },
            token_seq: None,
            isl_tokens: tokens,
            overlap,
            kv_transfer_candidates: None,
            retain_kv_transfer_chain: false,
            worker_loads,
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
            WorkerSelectionInput::configured(&workers, &request, request.eligibility(), PAGE);
        let picked = selector.select_worker(input).unwrap_or_else(|e| panic!("{e}"));
        black_box(picked.worker);
    })
}
