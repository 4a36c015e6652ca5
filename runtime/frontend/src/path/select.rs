//! Selecting a prefill for an attempt: asking a scheduler replica (booking it there), past
//! the instances this frontend cannot reach ([`crate::reach`]), and the backoff between
//! attempts.

use handoff_proto::v1::{Attempt, SelectPrefillRequest};
use tokio::time::Instant;
use tracing::{Instrument, debug};

use super::Frontend;
use super::target::summary;
use crate::FrontendError;
use crate::input::Plan;
use crate::lease::Lease;
use crate::schedulers::{SelectFailure, Selected};

/// The protocols every frontend drives prefills with (see [`super::target`]); `vllm` too
/// when configured ([`crate::FrontendConfig::drive_vllm`]).
pub(super) const PROTOCOLS: [&str; 2] = ["handoff", "sglang"];

/// How long a selection waits for a scheduler replica to answer when none does.
const NO_REPLICA_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

fn retry_after(s: &tonic::Status) -> std::time::Duration {
    let ms = s
        .metadata()
        .get(crate::error::RETRY_AFTER_MS)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(1000);
    std::time::Duration::from_millis(ms)
}

impl Frontend {
    pub(super) fn backoff(&self, failures: usize) -> std::time::Duration {
        let base = self.cfg.backoff.as_secs_f64() * 1.5f64.powi(failures.saturating_sub(1) as i32);
        let jittered = base.min(self.cfg.max_backoff.as_secs_f64()) * rand::random_range(0.8..1.2);
        std::time::Duration::from_secs_f64(jittered)
    }

    /// As [`Frontend::select`], passing over the instances this frontend cannot reach as
    /// well; if that leaves nothing, asking again without them.
    pub(super) async fn select_reachable(
        &self,
        plan: &Plan,
        hashes: &[u64],
        exclude: &[String],
        failed: &[Attempt],
    ) -> Result<(Lease, Selected), FrontendError> {
        let mut avoided = self.reach.avoided_at(Instant::now());
        avoided.retain(|a| !exclude.contains(a));
        // Past the scheduler's bound a request would be refused as invalid: the instances
        // beyond it (the longest since failing) are merely not passed over.
        avoided.truncate(handoff_proto::select::MAX_EXCLUDE.saturating_sub(exclude.len()));
        // One patience for both askings: the second is not given its own.
        let patience = (Instant::now() + NO_REPLICA_PATIENCE).min(plan.deadline);
        if avoided.is_empty() {
            return self.select(plan, hashes, exclude, failed, patience).await;
        }
        let wider: Vec<String> = exclude.iter().chain(&avoided).cloned().collect();
        match self.select(plan, hashes, &wider, failed, patience).await {
            Err(FrontendError::Unavailable(why)) => {
                debug!(%why, ?avoided, "only instances this frontend avoids: asking for them");
                self.select(plan, hashes, exclude, failed, patience).await
            }
            other => other,
        }
    }

    /// Asks a scheduler replica where the prompt goes, booking it there. When no replica
    /// answers (or none is known), asks again after 0.1 s, doubling to 1 s, until `patience`
    /// (at most [`NO_REPLICA_PATIENCE`], within the deadline) or shutdown: a replica
    /// restarting (a deploy, a crash its supervisor restarts) is back within seconds, and a
    /// request with time left waits for it rather than failing.
    async fn select(
        &self,
        plan: &Plan,
        hashes: &[u64],
        exclude: &[String],
        failed: &[Attempt],
        patience: Instant,
    ) -> Result<(Lease, Selected), FrontendError> {
        let mut pause = std::time::Duration::from_millis(100);
        loop {
            match self.select_once(plan, hashes, exclude).await {
                Err(SelectFailure::NoReplica(s)) if Instant::now() + pause < patience => {
                    let why = s.as_ref().map_or("none known", |s| s.message());
                    debug!(%why, ?pause, "no scheduler replica answered; asking again");
                    tokio::select! {
                        _ = tokio::time::sleep(pause) => {}
                        _ = self.tasks.shutdown_requested() => {
                            return selected(Err(SelectFailure::NoReplica(s)), plan, failed);
                        }
                    }
                    pause = (pause * 2).min(std::time::Duration::from_secs(1));
                }
                answer => return selected(answer, plan, failed),
            }
        }
    }

    /// Asks the scheduler replicas once (see [`crate::Schedulers::select`]).
    async fn select_once(
        &self,
        plan: &Plan,
        hashes: &[u64],
        exclude: &[String],
    ) -> Result<(Lease, Selected), SelectFailure> {
        // The prefill must leave the decode its time before the deadline, but at most half
        // the time left: a decode of `max_tokens` longer than the deadline allows may still
        // end early (EOS, a stop string), and is cut at the deadline if not; refused as
        // overload, it could never succeed.
        let left = plan.deadline.saturating_duration_since(Instant::now());
        let decode = self.expected_decode(plan.max_tokens);
        let left = left - decode.min(left / 2);
        let req = SelectPrefillRequest {
            block_hashes: hashes.to_vec(),
            prompt_tokens: plan.tokens.len() as u32,
            policy: plan.policy as i32,
            exclude_instances: exclude.to_vec(),
            deadline_ms: left.as_millis().clamp(1, u128::from(u32::MAX)) as u32,
            protocols: PROTOCOLS
                .iter()
                .chain(self.cfg.drive_vllm.then_some(&"vllm"))
                .map(|p| p.to_string())
                .collect(),
            // The replica asked adds its waiting reports, and the frontend's name (see
            // `Schedulers::select`).
            reports: Vec::new(),
            frontend_id: String::new(),
        };
        // The call runs on its own task and wraps its booking in a lease there: if this
        // request is dropped while the scheduler books it, the lease is dropped with the
        // task's output and the booking reported cancelled, not left to expire.
        let (schedulers, deadline, trace) = (self.schedulers.clone(), plan.deadline, plan.trace);
        let call = self.tasks.spawn(
            async move {
                let sel = schedulers.select(req, deadline, &trace).await?;
                let lease = Lease::new(sel.report_to.clone(), sel.selection.booking_id);
                Ok::<_, SelectFailure>((lease, sel))
            }
            .instrument(tracing::Span::current()),
        );
        call.await.unwrap_or_else(|e| {
            Err(SelectFailure::NoReplica(Some(tonic::Status::internal(format!(
                "selection task: {e}"
            )))))
        })
    }
}

/// What a selection's `answer` means to the request.
fn selected(
    answer: Result<(Lease, Selected), SelectFailure>,
    plan: &Plan,
    failed: &[Attempt],
) -> Result<(Lease, Selected), FrontendError> {
    match answer {
        Ok(booked) => Ok(booked),
        Err(SelectFailure::Answer(s)) => Err(match s.code() {
            tonic::Code::InvalidArgument => FrontendError::Invalid(s.message().to_owned()),
            tonic::Code::ResourceExhausted => FrontendError::Overloaded {
                retry_after: retry_after(&s),
                limit: crate::Limit::Scheduler,
                // Said once: the error's own display says it is overload.
                reason: s.message().trim_start_matches("overloaded: ").to_owned(),
            },
            _ => FrontendError::Unavailable(format!("scheduler: {}", s.message())),
        }),
        Err(SelectFailure::NoReplica(_)) if Instant::now() >= plan.deadline => {
            Err(FrontendError::Deadline(summary(failed)))
        }
        Err(SelectFailure::NoReplica(s)) => {
            let why = s.map_or("no scheduler replica known".to_owned(), |s| {
                format!("no scheduler replica answered: {}", s.message())
            });
            Err(FrontendError::Unavailable(why))
        }
    }
}

#[cfg(test)]
mod tests;
