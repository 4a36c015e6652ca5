//! [`PrefillCall`]: an attempt's `Prefill` gRPC call, run on the frontend's tasks.
//!
//! The attempt goes on as soon as the KV verifies, not a round trip later when the prefill,
//! its notices acknowledged, answers; so the call runs as a task of its own. Until the KV
//! verifies the call belongs to the attempt: an attempt that fails or is dropped (a client
//! gone, a retry elsewhere) aborts it, which resets the stream and stops the prefill's work,
//! as dropping the call did when it was awaited in place. Once the KV has verified, the call
//! is let run to its answer (the prefill caches the prompt then), bounded by the attempt's
//! deadline and the frontend's shutdown.

use handoff_core::{Room, Tasks};
use handoff_proto::v1::PrefillRequest;
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tracing::debug;

use super::{PrefillPeer, Target};

use crate::{Cause, FrontendError};

/// The call (see the module docs); aborted on drop unless let run.
pub(super) struct PrefillCall {
    handle: Option<JoinHandle<Result<(), FrontendError>>>,
    /// The peer, when this call carries the handshakes (see [`PrefillCall::failed`]).
    carried: Option<PrefillPeer>,
}

impl PrefillCall {
    /// Starts `request` on `target` for room `room`, on `tasks`, until `deadline`; `in_call`:
    /// the request carries the decode's handshakes. Its answer tells the target's peer
    /// whether the next may carry them; a call that carried them and failed for the
    /// instance's reasons (see [`forget_on`]) forgets it.
    pub(super) fn start(
        tasks: &Tasks,
        target: &Target,
        request: tonic::Request<PrefillRequest>,
        in_call: bool,
        room: Room,
        deadline: Instant,
    ) -> Self {
        let stop = tasks.clone();
        let peer = target.prefill.clone();
        let instance = target.instance.clone();
        let mut client = peer.client.clone();
        let handle = tasks.spawn(async move {
            let answer = tokio::select! {
                _ = stop.shutdown_requested() => {
                    Err(FrontendError::because("prefill", Cause::Decode, "the frontend is stopping"))
                }
                a = tokio::time::timeout_at(deadline, client.prefill(request)) => match a {
                    Ok(Ok(answer)) => {
                        peer.learn(&instance, answer.get_ref().takes_handshakes);
                        Ok(())
                    }
                    Ok(Err(s)) => Err(FrontendError::prefill_status(&s)),
                    Err(_) => Err(FrontendError::because(
                        "prefill",
                        Cause::Deadline,
                        "attempt deadline passed",
                    )),
                },
            };
            if let Err(e) = &answer {
                debug!(%room, error = %e, "the Prefill call failed");
                if in_call {
                    forget_on(&peer, e);
                }
            }
            answer
        });
        let carried = in_call.then(|| target.prefill.clone());
        PrefillCall { handle: Some(handle), carried }
    }

    /// Whether the call is still out.
    pub(super) fn is_out(&self) -> bool {
        self.handle.is_some()
    }

    /// Waits for the call's answer (at once if it has come). Cancel-safe.
    pub(super) async fn answer(&mut self) -> Result<(), FrontendError> {
        let Some(h) = self.handle.as_mut() else { return Ok(()) };
        let joined = h.await;
        self.handle = None;
        joined.map_err(|e| FrontendError::at("prefill", format!("the Prefill call: {e}")))?
    }

    /// The attempt failed with `e` before its KV verified: a call that carried the
    /// handshakes forgets what the instance said, if `e` was the instance's (see
    /// [`forget_on`]).
    pub(super) fn failed(&self, e: &FrontendError) {
        if let Some(peer) = &self.carried {
            forget_on(peer, e);
        }
    }

    /// Lets the call run to its answer on the frontend's tasks (the KV has verified).
    pub(super) fn let_run(mut self) {
        self.handle.take();
    }
}

impl Drop for PrefillCall {
    fn drop(&mut self) {
        if let Some(h) = self.handle.take() {
            h.abort();
        }
    }
}

/// Forgets what `peer`'s instance said of handshakes in the call after a failure `e` of an
/// attempt (or a call) that carried them, unless `e` was overload or a deadline (the load,
/// not the instance: the fast path stays on under load) or this frontend stopping.
fn forget_on(peer: &PrefillPeer, e: &FrontendError) {
    if !matches!(e.cause(), Some(Cause::Overloaded | Cause::Deadline | Cause::Decode)) {
        peer.forget();
    }
}

#[cfg(test)]
mod tests {
    use handoff_proto::v1::prefill_client::PrefillClient;
    use tonic::transport::Channel;

    use super::*;

    #[tokio::test]
    async fn only_the_instances_own_failures_forget_what_it_said() {
        let channel = Channel::from_static("http://127.0.0.1:1").connect_lazy();
        let peer = PrefillPeer::new(PrefillClient::new(channel));
        peer.learn("a", true);
        for cause in [Cause::Overloaded, Cause::Deadline, Cause::Decode] {
            forget_on(&peer, &FrontendError::because("prefill", cause, "not the instance's"));
            assert!(peer.takes_handshakes("a"), "{cause:?} is the load's or this frontend's");
        }
        forget_on(&peer, &FrontendError::at("verify", "a notice names another room"));
        assert!(!peer.takes_handshakes("a"), "a fault forgets");
        peer.learn("a", true);
        forget_on(
            &peer,
            &FrontendError::because("prefill", Cause::Invalid, "malformed handshakes"),
        );
        assert!(!peer.takes_handshakes("a"), "handshakes the instance found malformed forget");
        peer.learn("a", true);
        let s = tonic::Status::failed_precondition("mismatch: handshakes: decode tp 3");
        forget_on(&peer, &FrontendError::prefill_status(&s));
        assert!(!peer.takes_handshakes("a"), "handshakes the instance cannot take forget");
    }
}
