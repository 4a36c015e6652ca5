//! Which attempt a selection gets, by the protocol its instance speaks: a handoff prefill's
//! (`attempt`), or an SGLang prefill server's (`sglang`).

use handoff_core::Room;
use handoff_proto::v1::SelectPrefillResponse;
use tokio::time::Instant;

use super::Frontend;
use crate::attempt::{self, AttemptCtx, Prefilled, Stages, Target};
use crate::input::Plan;
use crate::sglang::SglangTarget;
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
            other => Err(FrontendError::because(
                "resolve-topology",
                Cause::Instance,
                format!("the instance speaks {other:?}, which this frontend does not drive"),
            )),
        }
    }
}
