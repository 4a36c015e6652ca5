//! [`Pacer`]: an open loop's schedule, kept on the OS's timers.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{UnboundedReceiver, UnboundedSender, unbounded_channel};

/// `n` starts `every` apart, each handed over when due by a thread that sleeps to it on the
/// OS's timers (to the microsecond: tokio's timers tick in whole milliseconds, and sleeping
/// on them starts requests up to a millisecond late). Dropping it stops the thread at its
/// next start and joins it.
pub struct Pacer {
    starts: UnboundedReceiver<(usize, Instant)>,
    thread: Option<JoinHandle<()>>,
    /// When start 0 was due.
    pub origin: Instant,
}

impl Pacer {
    /// Schedules `n` starts `every` apart, the first now.
    pub fn start(n: usize, every: Duration) -> anyhow::Result<Pacer> {
        let (due, starts) = unbounded_channel();
        let origin = Instant::now();
        let thread = std::thread::Builder::new()
            .name("pacer".into())
            .spawn(move || keep(origin, every, n, due))?;
        Ok(Pacer { starts, thread: Some(thread), origin })
    }

    /// The next start: its number and when it was due. `None` after the last.
    pub async fn next(&mut self) -> Option<(usize, Instant)> {
        self.starts.recv().await
    }
}

/// The pacing thread: sleeps to each start and hands it over, until the last or until
/// nobody takes them.
fn keep(origin: Instant, every: Duration, n: usize, due: UnboundedSender<(usize, Instant)>) {
    // Sleeps end within a microsecond of their time instead of the default 50 (best effort:
    // callers measure how late their starts were).
    let _ = std::fs::write("/proc/thread-self/timerslack_ns", "1");
    for i in 0..n {
        let at = origin + every * i as u32;
        std::thread::sleep(at.saturating_duration_since(Instant::now()));
        if due.send((i, at)).is_err() {
            return;
        }
    }
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.starts.close();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every start comes, in order, at its place in the schedule and never before it.
    #[tokio::test]
    async fn starts_come_in_order_and_never_early() {
        let every = Duration::from_millis(2);
        let mut pacer = Pacer::start(5, every).expect("a thread");
        let mut seen = Vec::new();
        while let Some((i, due)) = pacer.next().await {
            assert!(Instant::now() >= due, "start {i} came early");
            seen.push((i, due - pacer.origin));
        }
        let schedule: Vec<(usize, Duration)> = (0..5).map(|i| (i, every * i as u32)).collect();
        assert_eq!(seen, schedule);
    }

    /// A pacer dropped with most of its schedule ahead stops its thread at the next start
    /// and joins it, instead of keeping it for the rest of the schedule.
    #[tokio::test]
    async fn a_pacer_dropped_early_joins_its_thread() {
        let mut pacer = Pacer::start(1_000_000, Duration::from_millis(1)).expect("a thread");
        assert_eq!(pacer.next().await.map(|(i, _)| i), Some(0));
        let (dropped, done) = std::sync::mpsc::channel();
        let dropping = std::thread::spawn(move || {
            drop(pacer);
            let _ = dropped.send(());
        });
        // A guard, not a measure: the drop takes a millisecond; kept, it would take 17 minutes.
        assert!(done.recv_timeout(Duration::from_secs(10)).is_ok(), "the drop did not return");
        dropping.join().expect("the dropping thread");
    }
}
