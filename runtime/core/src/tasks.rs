//! Owned background tasks: every task a component starts is tracked, sees the shutdown
//! signal, and is awaited on shutdown, so no transfer, lease or stream is orphaned.

use std::future::Future;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// A component's tasks and its shutdown signal.
#[derive(Clone, Default)]
pub struct Tasks {
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Tasks {
    /// A fresh set with its own shutdown signal.
    pub fn new() -> Self {
        Self::default()
    }

    /// A set whose shutdown follows `parent`'s (and can also be shut down on its own).
    pub fn child(&self) -> Self {
        Tasks { tracker: TaskTracker::new(), shutdown: self.shutdown.child_token() }
    }

    /// Spawns a tracked task.
    pub fn spawn<F>(&self, fut: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        self.tracker.spawn(fut)
    }

    /// The shutdown signal (cloned tokens observe the same signal).
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Completes when shutdown is requested.
    pub async fn shutdown_requested(&self) {
        self.shutdown.cancelled().await
    }

    /// Whether shutdown was requested.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.is_cancelled()
    }

    /// Requests shutdown and waits for every tracked task to finish.
    pub async fn shutdown(&self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
    }
}
