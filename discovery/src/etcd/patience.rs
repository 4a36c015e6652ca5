//! Waiting for an etcd not reachable yet: a process started before its etcd (a whole cluster
//! started at once, a host rebooted, a Kubernetes Service not resolvable yet) waits for it,
//! with backoff, rather than exiting (a supervisor restarting it quickly gives up on it after
//! a few tries, and Kubernetes backs its restarts off to 5 minutes). Errors etcd answers
//! (a user or password refused, a request it will not take) are returned at once. A
//! connection that fails (refused, no route, a name that does not resolve, a TLS handshake
//! either side refuses) cannot be told from an etcd not up yet: it is waited on, with a
//! warning naming the error every minute.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// The first wait after a failed try; each next one is twice as long, up to [`LONGEST`].
const FIRST: Duration = Duration::from_millis(500);
const LONGEST: Duration = Duration::from_secs(10);
/// How often the wait is said again.
const SAY_EVERY: Duration = Duration::from_secs(60);

/// Whether `e` says etcd was not reached (or could not answer), rather than refused.
pub(super) fn transient(e: &etcd_client::Error) -> bool {
    use etcd_client::Error as E;
    use tonic::Code;
    match e {
        E::TransportError(_) | E::IoError(_) => true,
        E::GRpcStatus(s) => matches!(
            s.code(),
            Code::Unavailable | Code::DeadlineExceeded | Code::Cancelled | Code::Unknown
        ),
        _ => false,
    }
}

/// The wait after `w`: twice as long, up to [`LONGEST`].
fn next_wait(w: Duration) -> Duration {
    (w * 2).min(LONGEST)
}

/// What `attempt` gives, tried again while etcd is not reached, until `stop` (then the last
/// error). `what` names it in the log: a warning at the first failure, a line when reached.
pub(super) async fn until_reached<T, F, Fut>(
    what: &str,
    stop: &CancellationToken,
    mut attempt: F,
) -> Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, etcd_client::Error>>,
{
    let (mut wait, mut said) = (FIRST, None::<tokio::time::Instant>);
    loop {
        let e = match attempt().await {
            Ok(v) => {
                if said.is_some() {
                    info!("etcd reached: {what}");
                }
                return Ok(v);
            }
            Err(e) if transient(&e) => e,
            Err(e) => return Err(e),
        };
        if said.is_none_or(|at| at.elapsed() >= SAY_EVERY) {
            warn!(error = %causes(&e), "etcd not reached; waiting for it: {what}");
            said = Some(tokio::time::Instant::now());
        }
        tokio::select! {
            _ = stop.cancelled() => return Err(e),
            _ = tokio::time::sleep(wait) => {}
        }
        wait = next_wait(wait);
    }
}

/// `e` and the errors under it (a transport error's own text hides its cause).
pub(super) fn causes(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut at = e.source();
    while let Some(c) = at {
        out.push_str(": ");
        out.push_str(&c.to_string());
        at = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_double_up_to_the_longest() {
        let w: Vec<_> = std::iter::successors(Some(FIRST), |w| Some(next_wait(*w)))
            .take(7)
            .map(|d| d.as_millis())
            .collect();
        assert_eq!(w, [500, 1000, 2000, 4000, 8000, 10_000, 10_000]);
    }

    #[test]
    fn only_etcd_not_reached_is_waited_for() {
        let status = |c| etcd_client::Error::GRpcStatus(tonic::Status::new(c, "x"));
        assert!(transient(&status(tonic::Code::Unavailable)));
        assert!(!transient(&status(tonic::Code::Unauthenticated)));
        assert!(!transient(&status(tonic::Code::PermissionDenied)));
        assert!(!transient(&etcd_client::Error::InvalidArgs("x".into())));
    }
}
