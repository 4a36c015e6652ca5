//! Which attempt a selection gets, by the protocol its instance speaks: a handoff prefill's
//! (`attempt`), an SGLang prefill server's (`sglang`) or a vLLM one's (`vllm`); and what
//! attempts share (the engine's sampling, the summary of failures).

use handoff_core::Room;
use handoff_proto::v1::{Attempt, SelectPrefillResponse};
use tokio::time::Instant;

use super::Frontend;
use crate::attempt::{self, AttemptCtx, Prefilled, Stages, Target};
use crate::input::Plan;
use crate::sglang::SglangTarget;
use crate::vllm::VllmTarget;
use crate::{Cause, FrontendError};

impl Frontend {
    /// Runs one attempt with `room` on the instance `sel` chose.
    pub(super) async fn attempt_on(
        &self,
        ctx: &AttemptCtx<'_>,
        sel: &SelectPrefillResponse,
        room: Room,
        plan: &Plan,
        deadline: Instant,
        stages: &mut Stages,
    ) -> Result<Prefilled, FrontendError> {
        match sel.protocol.as_str() {
            // Empty: a scheduler from before protocols were named, which routes handoff only.
            "" | "handoff" => {
                let target = Target {
                    instance: sel.instance_id.clone(),
                    dp_rank: sel.dp_rank,
                    bootstrap_addr: sel.bootstrap_addr.clone(),
                    prefill: self.prefill_client(&sel.prefill_addr)?,
                };
                attempt::run(ctx, target, room, &plan.tokens, &plan.sampling, deadline, stages)
                    .await
            }
            "sglang" => {
                let target = SglangTarget {
                    url: sel.prefill_addr.clone(),
                    bootstrap_addr: sel.bootstrap_addr.clone(),
                };
                self.sglang
                    .attempt(&target, room, &plan.tokens, &plan.sampling, deadline, stages)
                    .await
            }
            "vllm" if self.cfg.drive_vllm => {
                let target = VllmTarget {
                    url: sel.prefill_addr.clone(),
                    side_channel: sel.bootstrap_addr.clone(),
                };
                let sampling = handoff_prefill_sampling(&plan.sampling);
                self.vllm.attempt(&target, room, &plan.tokens, &sampling, deadline, stages).await
            }
            other => Err(FrontendError::because(
                "resolve-topology",
                Cause::Instance,
                format!("the instance speaks {other:?}, which this frontend does not drive"),
            )),
        }
    }
}

/// The engine's sampling for the request's.
pub(super) fn handoff_prefill_sampling(
    s: &handoff_proto::v1::SamplingParams,
) -> handoff_engine::Sampling {
    handoff_engine::Sampling {
        temperature: s.temperature,
        top_p: s.top_p,
        top_k: s.top_k,
        // `input::plan` gave every request one.
        seed: s.seed.unwrap_or_default(),
    }
}

/// Every failed attempt, for the error the client gets.
pub(super) fn summary(failed: &[Attempt]) -> String {
    if failed.is_empty() {
        return "no attempt made".into();
    }
    failed
        .iter()
        .map(|a| format!("[{} room {}: {}]", a.instance_id, a.bootstrap_room, a.error))
        .collect::<Vec<_>>()
        .join(" ")
}

/// What a client gets when every attempt failed, the last with `last`: overload (an
/// instance refusing, or one whose queue held the request past the attempt's deadline)
/// refuses with 429 / `RESOURCE_EXHAUSTED` and a time to retry; anything else (a timeout
/// with no word from the instance included) is unavailable (503).
pub(super) fn all_failed(last: Option<Cause>, failed: &[Attempt]) -> FrontendError {
    match last {
        Some(Cause::Overloaded) => FrontendError::Overloaded {
            retry_after: std::time::Duration::from_secs(1),
            limit: crate::Limit::Prefills,
            reason: summary(failed),
        },
        _ => FrontendError::Unavailable(summary(failed)),
    }
}

/// A fresh room for an attempt on `sel`. An SGLang prefill serves room `r` on dp rank
/// `r % dp`: minted on the rank chosen for the cache it holds (any room, and the rank would
/// be chance's, the cache credited on another).
pub(super) fn room_for(sel: &SelectPrefillResponse) -> Room {
    match sel.protocol.as_str() {
        "sglang" => Room::mint_on(sel.dp_rank, sel.dp_size),
        _ => Room::mint(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Instances that refused, or held the request in their queue past its time, are busy:
    /// the client is told to come back (429). A timeout without a word from the instance
    /// (hung, or its KV lost) is not an overload (503).
    #[test]
    fn only_refusals_and_queue_expiry_are_an_overload() {
        for (last, overloaded) in [
            (Some(Cause::Deadline), false),
            (Some(Cause::Overloaded), true),
            (Some(Cause::Instance), false),
            (None, false),
        ] {
            let e = all_failed(last, &[]);
            assert_eq!(matches!(e, FrontendError::Overloaded { .. }), overloaded, "{last:?}: {e}");
        }
    }

    /// An SGLang prefill's room is on the chosen dp rank; others' are any room.
    #[test]
    fn an_sglang_room_is_on_the_chosen_rank() {
        let sel = |protocol: &str, dp_rank, dp_size| SelectPrefillResponse {
            protocol: protocol.into(),
            dp_rank,
            dp_size,
            ..Default::default()
        };
        for _ in 0..100 {
            assert_eq!(room_for(&sel("sglang", 3, 8)).get() % 8, 3);
            assert_eq!(room_for(&sel("sglang", 0, 2)).get() % 2, 0);
        }
        let any: std::collections::HashSet<u64> =
            (0..64).map(|_| room_for(&sel("handoff", 3, 8)).get() % 8).collect();
        assert!(any.len() > 1, "a handoff prefill's room is any room");
    }
}
