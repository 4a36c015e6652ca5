//! Ctrl-C and SIGTERM, listened for from the process's first moment.
//!
//! A process is told to stop at any time, starting included: a pod deleted while its prefill
//! warms up or its frontend waits for a scheduler. In a container the binary is PID 1, and
//! the kernel drops a signal PID 1 has no handler for (not queued: a handler installed later
//! never sees it), so a stop during startup was lost and the pod killed at its grace's end,
//! by then registered and serving. The handlers are installed here, before anything else
//! runs, and a signal that comes before anyone waits is kept for the first wait.

use std::future::Future;

/// The stop signals, listened for since [`Stop::listen`].
pub struct Stop {
    #[cfg(unix)]
    signals: Option<(tokio::signal::unix::Signal, tokio::signal::unix::Signal)>,
}

impl Stop {
    /// Installs the handlers now. Needs the runtime. Where they cannot be installed, waits
    /// for Ctrl-C alone (registered on the first wait).
    pub fn listen() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            let signals = match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
                (Ok(term), Ok(int)) => Some((term, int)),
                (Err(e), _) | (_, Err(e)) => {
                    tracing::warn!(error = %e, "SIGTERM not listened for: Ctrl-C alone stops");
                    None
                }
            };
            Self { signals }
        }
        #[cfg(not(unix))]
        Self {}
    }

    /// Completes on the next Ctrl-C or SIGTERM (one that came before this call included).
    pub async fn wait(&mut self) {
        #[cfg(unix)]
        if let Some((term, int)) = &mut self.signals {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            return;
        }
        let _ = tokio::signal::ctrl_c().await;
    }

    /// Runs `starting` unless a stop comes first: then `None`, `starting` dropped, and the
    /// stop said.
    pub async fn unless<T>(&mut self, starting: impl Future<Output = T>) -> Option<T> {
        tokio::select! {
            r = starting => Some(r),
            _ = self.wait() => {
                tracing::info!("told to stop while starting: stopping");
                None
            }
        }
    }
}
