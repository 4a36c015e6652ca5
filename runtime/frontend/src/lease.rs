//! [`Lease`]: a booking held on a scheduler replica until its attempt ends; a lease dropped
//! first (the client went away) reports its booking cancelled.

use handoff_proto::v1::{Outcome, ReportOutcomeRequest};

use crate::schedulers::reports::ReportTo;
use crate::{Cause, FrontendError};

/// Longest failure reason a report carries, in bytes.
const MAX_REASON: usize = 256;

/// A booking held on a scheduler replica: ended with its outcome, or, if dropped first (the
/// client went away), reported cancelled.
pub(crate) struct Lease {
    report_to: ReportTo,
    booking: u64,
    open: bool,
}

impl Lease {
    /// A booking `booking`, reported to `report_to` (the replica that made it).
    pub(crate) fn new(report_to: ReportTo, booking: u64) -> Self {
        Lease { report_to, booking, open: true }
    }

    /// Reports the outcome (the request does not wait for it to arrive).
    pub(crate) fn end(mut self, outcome: Outcome, error: String) {
        self.open = false;
        self.send(outcome, error);
    }

    fn send(&self, outcome: Outcome, mut error: String) {
        // A report rides along with selections: its reason is for logs, kept short.
        if error.len() > MAX_REASON {
            let cut = (0..=MAX_REASON).rev().find(|&i| error.is_char_boundary(i)).unwrap_or(0);
            error.truncate(cut);
        }
        let req = ReportOutcomeRequest { booking_id: self.booking, outcome: outcome as i32, error };
        self.report_to.report(req);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if self.open {
            self.send(Outcome::Cancelled, "the client went away".into());
        }
    }
}

/// What a failed attempt tells the scheduler.
pub(crate) fn outcome_of(e: &FrontendError) -> Outcome {
    match e.cause() {
        Some(Cause::Instance) | None => Outcome::InstanceFault,
        Some(Cause::Overloaded) => Outcome::Overloaded,
        Some(Cause::Deadline) => Outcome::Deadline,
        Some(Cause::Invalid) => Outcome::Invalid,
        // No wire outcome of its own: neither counts against the instance's breaker.
        Some(Cause::Decode | Cause::Mismatch) => Outcome::DecodeFault,
    }
}
