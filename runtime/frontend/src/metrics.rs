//! [`Metrics`]: the frontend's counters and its measured decode step.

/// Counters served at `/metrics`, shared by the gRPC and HTTP entry points.
#[derive(Debug, Default)]
pub(crate) struct Metrics {
    pub(crate) requests: std::sync::atomic::AtomicU64,
    pub(crate) failed: std::sync::atomic::AtomicU64,
    /// Refused at once for overload (429 / RESOURCE_EXHAUSTED).
    pub(crate) refused: std::sync::atomic::AtomicU64,
    /// Past their own deadline (504 / DEADLINE_EXCEEDED).
    pub(crate) expired: std::sync::atomic::AtomicU64,
    /// Clients that went away before their request finished.
    pub(crate) cancelled: std::sync::atomic::AtomicU64,
    pub(crate) tokens: std::sync::atomic::AtomicU64,
    /// Moving average of one decode step, in nanoseconds (0: none measured yet).
    pub(crate) step_ns: std::sync::atomic::AtomicU64,
}

impl Metrics {
    /// Adds a decode step's duration to the moving average.
    pub(crate) fn note_step(&self, took: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        let sample = took.as_nanos().min(u128::from(u64::MAX)) as u64;
        let old = self.step_ns.load(Relaxed);
        let new = if old == 0 { sample } else { (old * 15 + sample) / 16 };
        self.step_ns.store(new, Relaxed);
    }

    /// Time `tokens` decode steps are expected to take.
    pub(crate) fn decode_time(&self, tokens: u32) -> std::time::Duration {
        let step = self.step_ns.load(std::sync::atomic::Ordering::Relaxed);
        std::time::Duration::from_nanos(step.saturating_mul(u64::from(tokens)))
    }
}
