//! [`LogEvery`]: something that may happen often, said in the log at most once a while.

use std::time::{Duration, Instant};

/// Counts occurrences and says when one is due to be logged: the first at once, then at most
/// one per `every`, with how many came since. (Logging at powers of two of a lifetime count
/// went silent after weeks: the next line was billions away.)
#[derive(Debug)]
pub struct LogEvery {
    every: Duration,
    last: Option<Instant>,
    since: u64,
}

impl LogEvery {
    /// At most one line per `every`.
    pub const fn new(every: Duration) -> Self {
        LogEvery { every, last: None, since: 0 }
    }

    /// Notes one occurrence at `now`; when a line is due, how many it stands for (this one
    /// and those not logged since the last line).
    pub fn note(&mut self, now: Instant) -> Option<u64> {
        self.since += 1;
        if self.last.is_some_and(|t| now.saturating_duration_since(t) < self.every) {
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.since))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_is_said_then_one_line_a_while_with_the_count() {
        let mut l = LogEvery::new(Duration::from_secs(60));
        let t0 = Instant::now();
        assert_eq!(l.note(t0), Some(1));
        for s in 1..60 {
            assert_eq!(l.note(t0 + Duration::from_secs(s)), None);
        }
        assert_eq!(l.note(t0 + Duration::from_secs(60)), Some(60));
        assert_eq!(l.note(t0 + Duration::from_secs(61)), None);
        assert_eq!(l.note(t0 + Duration::from_secs(3600)), Some(2), "after a quiet hour");
    }
}
