//! Ctrl-C and SIGTERM, listened for from a role's first moment.
//!
//! A process is told to stop at any time, starting included: a pod deleted while its prefill
//! warms up or its frontend waits for a scheduler. In a container the binary is PID 1, and
//! the kernel drops a signal PID 1 has no handler for (not queued: a handler installed later
//! never sees it), so a stop during startup was lost and the pod killed at its grace's end,
//! by then registered and serving. The handlers are installed before the role starts, and a
//! signal that comes before anyone waits is kept for the first wait. (`handoff ctl` installs
//! none: a signal ends it at once.)

use std::future::Future;

#[cfg(unix)]
use tokio::signal::unix::{Signal, SignalKind, signal};

/// Which signal told the process to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told {
    /// SIGTERM.
    Terminate,
    /// Ctrl-C (SIGINT).
    Interrupt,
}

/// The stop signals, listened for since [`Stop::listen`].
pub struct Stop {
    #[cfg(unix)]
    term: Option<Signal>,
    #[cfg(unix)]
    int: Option<Signal>,
    /// Handlers that could not be installed, said at the first wait (logging is set up after
    /// the handlers, so as not to drop a signal meanwhile).
    unheard: Vec<String>,
}

impl Stop {
    /// Installs the handlers now (needs the runtime). One that cannot be installed is
    /// warned of at the first wait; with neither, Ctrl-C is registered then.
    pub fn listen() -> Self {
        let mut unheard = Vec::new();
        #[cfg(unix)]
        {
            let mut install = |kind: SignalKind, name: &str| {
                signal(kind).map_err(|e| unheard.push(format!("{name} not listened for: {e}"))).ok()
            };
            let (term, int) = (
                install(SignalKind::terminate(), "SIGTERM"),
                install(SignalKind::interrupt(), "SIGINT"),
            );
            Self { term, int, unheard }
        }
        #[cfg(not(unix))]
        Self { unheard }
    }

    /// Completes on the next Ctrl-C or SIGTERM (one that came before this call included),
    /// saying which.
    pub async fn wait(&mut self) -> Told {
        for said in self.unheard.drain(..) {
            tracing::warn!("{said}");
        }
        #[cfg(unix)]
        if self.term.is_some() || self.int.is_some() {
            async fn next(s: &mut Option<Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending().await,
                }
            }
            return tokio::select! {
                _ = next(&mut self.term) => Told::Terminate,
                _ = next(&mut self.int) => Told::Interrupt,
            };
        }
        let _ = tokio::signal::ctrl_c().await;
        Told::Interrupt
    }

    /// Completes when told to stop again as `first` said: a second Ctrl-C, or a second
    /// SIGTERM. The other signal is not "again": Ctrl-C in a terminal reaches a whole process
    /// group, and a supervisor forwarding it as SIGTERM would have cut every drain short.
    pub async fn again(&mut self, first: Told) {
        while self.wait().await != first {}
    }

    /// A role's start, `starting` (spawning into `tasks`), unless a stop comes first: then
    /// `Ok(None)`. Stopped or failed, `tasks` are shut down first, so what had started is
    /// taken back (out of discovery at once, not listed until its lease lapses).
    pub async fn starting<T>(
        &mut self,
        tasks: &handoff_core::Tasks,
        starting: impl Future<Output = anyhow::Result<T>>,
    ) -> anyhow::Result<Option<T>> {
        match self.unless(starting).await {
            Some(Ok(started)) => Ok(Some(started)),
            Some(Err(e)) => {
                tasks.shutdown().await;
                Err(e)
            }
            None => {
                tasks.shutdown().await;
                Ok(None)
            }
        }
    }

    /// Runs `starting` unless a stop comes first: then `None`, `starting` dropped, and the
    /// stop said. (A step that blocks its thread, such as loading a model, ends first.)
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
