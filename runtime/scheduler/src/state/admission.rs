//! Admission: overload is refused at once, never left to time out. A candidate's queue wait
//! is the uncached prefill work queued on it (this replica's and the others') times its
//! instance's measured cost per token. A request is admitted where its wait is within the
//! queue bound and its wait plus its own work fits in its deadline; the policy's pick if it
//! fits, else the candidate that would finish it soonest; else it is refused with how long
//! until the soonest one would have room.

use std::time::Duration;

use crate::policy::Candidate;

/// What a request may wait for, and how long it has.
#[derive(Debug, Clone, Copy)]
pub(super) struct Budget {
    /// Longest queue wait admitted (the scheduler's bound).
    pub(super) max_wait: Duration,
    /// Time left before the request's deadline, if it named one.
    pub(super) deadline: Option<Duration>,
}

/// Where a request was admitted, the wait ahead of it there, and its own work.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Admitted {
    pub(super) index: usize,
    pub(super) wait: Duration,
    pub(super) own: Duration,
}

/// Why a request was refused.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Refusal {
    /// When trying again could succeed.
    pub(super) retry_after: Duration,
    /// For the error message.
    pub(super) reason: String,
}

/// A candidate's costs, in microseconds: the wait ahead of the request and its own work.
fn costs(c: &Candidate, cost_us: f32, prompt_tokens: u64, page_size: u64) -> (f64, f64) {
    let cost = f64::from(cost_us.max(0.0));
    let own = prompt_tokens.saturating_sub(u64::from(c.overlap_blocks) * page_size);
    (c.queued_tokens as f64 * cost, own as f64 * cost)
}

/// Admits at `pick` or the soonest-finishing candidate, or refuses. `cost_us` gives each
/// candidate's cost per token, `page_size` its tokens per block.
pub(super) fn admit(
    candidates: &[Candidate],
    pick: usize,
    prompt_tokens: u32,
    budget: Budget,
    cost_us: impl Fn(&Candidate) -> (f32, u32),
) -> Result<Admitted, Refusal> {
    let max_wait = budget.max_wait.as_secs_f64() * 1e6;
    let deadline = budget.deadline.map_or(f64::INFINITY, |d| d.as_secs_f64() * 1e6);
    // How far over budget a candidate is (0: it fits).
    let over = |c: &Candidate| {
        let (cost, page) = cost_us(c);
        let (wait, own) = costs(c, cost, u64::from(prompt_tokens), u64::from(page));
        let over = (wait - max_wait).max(wait + own - deadline).max(0.0);
        (over, wait, own)
    };
    let micros = |us: f64| Duration::from_micros(us.max(0.0) as u64);
    let (o, wait, own) = over(&candidates[pick]);
    if o <= 0.0 {
        return Ok(Admitted { index: pick, wait: micros(wait), own: micros(own) });
    }
    let (best, (o, wait, own)) = candidates
        .iter()
        .map(over)
        .enumerate()
        .min_by(|a, b| a.1.0.total_cmp(&b.1.0))
        .unwrap_or((pick, (o, wait, 0.0)));
    if o <= 0.0 {
        return Ok(Admitted { index: best, wait: micros(wait), own: micros(own) });
    }
    let reason = if own > deadline {
        format!(
            "its prefill alone takes about {} ms, more than the {} ms left before its deadline",
            (own / 1e3).ceil(),
            (deadline / 1e3).floor()
        )
    } else {
        format!(
            "every prefill instance has at least {} ms of work queued (bound {} ms, {} ms left before the deadline)",
            (wait / 1e3).ceil(),
            (max_wait / 1e3).floor(),
            if deadline.is_finite() { (deadline / 1e3).floor() } else { f64::INFINITY },
        )
    };
    Err(Refusal { retry_after: micros(o).max(Duration::from_millis(1)), reason })
}

#[cfg(test)]
mod tests {
    use super::*;
    use handoff_kv_index::KvIndex;

    fn cand(index: &mut KvIndex, n: u32, queued: u64, overlap: u32) -> Candidate {
        let key =
            handoff_kv_index::WorkerKey { instance: format!("p{n}").parse().unwrap(), dp_rank: 0 };
        Candidate {
            slot: index.register(&key),
            ring: 0,
            overlap_blocks: overlap,
            queued_tokens: queued,
            in_flight: 0,
            send_tokens: 0,
        }
    }

    #[test]
    fn admits_within_the_bound_and_the_deadline_and_refuses_beyond() {
        let mut index = KvIndex::new(1000);
        // 1 ms per token, pages of 16.
        let cs = [cand(&mut index, 0, 5_000, 0), cand(&mut index, 1, 1_000, 0)];
        let cost = |_: &Candidate| (1000.0, 16);
        let b = |wait_ms, deadline_ms: Option<u64>| Budget {
            max_wait: Duration::from_millis(wait_ms),
            deadline: deadline_ms.map(Duration::from_millis),
        };
        // The pick fits: kept.
        let a = admit(&cs, 0, 100, b(10_000, None), cost).unwrap();
        let own = Duration::from_millis(100);
        assert_eq!(a, Admitted { index: 0, wait: Duration::from_secs(5), own });
        // The pick waits too long, the other fits.
        assert_eq!(admit(&cs, 0, 100, b(2_000, None), cost).unwrap().index, 1);
        // Both over the bound: refused, retry when the lighter one has drained enough.
        let r = admit(&cs, 0, 100, b(500, None), cost).unwrap_err();
        assert_eq!(r.retry_after, Duration::from_millis(500));
        // The deadline counts the request's own work too: 1000 queued + 100 own > 1050 ms.
        let r = admit(&cs, 1, 100, b(10_000, Some(1_050)), cost).unwrap_err();
        assert_eq!(r.retry_after, Duration::from_millis(50));
        // A prompt longer than its whole deadline says so.
        let r = admit(&cs, 1, 5_000, b(10_000, Some(2_000)), cost).unwrap_err();
        assert!(r.reason.contains("prefill alone"), "{}", r.reason);
        // Unknown cost (0): nothing to refuse on.
        assert!(admit(&cs, 0, 100, b(0, Some(1)), |_: &Candidate| (0.0, 16)).is_ok());
    }
}
