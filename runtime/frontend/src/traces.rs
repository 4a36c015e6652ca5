//! [`Recent`]: the evidence of the frontend's most recent requests (every attempt's room,
//! instance, dp rank, stage timings and error), found by any of their rooms: what
//! `handoff ctl trace ROOM` shows an operator. [`Frontend::prefill`] records them.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use handoff_proto::v1::Attempt;
use serde_json::{Value, json};
use tokio::time::Instant;
use tracing::Instrument;

use crate::input::Plan;
use crate::path::Ready;
use crate::{Frontend, FrontendError};

/// Requests remembered.
pub const RECENT_REQUESTS: usize = 4096;

/// One request's evidence.
#[derive(Debug, Clone)]
pub struct RequestTrace {
    /// When it arrived.
    pub arrived: SystemTime,
    /// Time until its KV was loaded, or it failed.
    pub took: Duration,
    /// Its attempts, oldest first; the last has an empty error when the request succeeded.
    pub attempts: Vec<Attempt>,
    /// The request's error, empty when it succeeded.
    pub error: String,
    /// How its prefill phase ended: `OK` when its KV was loaded and streaming began (a later
    /// decode failure is not recorded here), else the gRPC code's name its client got.
    /// Requests whose client left during the prefill phase are not recorded.
    pub code: String,
}

impl RequestTrace {
    /// As JSON.
    pub fn to_json(&self) -> Value {
        let since = self.arrived.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let attempts: Vec<Value> = self
            .attempts
            .iter()
            .map(|a| {
                let s = a.stages.unwrap_or_default();
                json!({
                    "bootstrap_room": a.bootstrap_room,
                    "instance": a.instance_id,
                    "dp_rank": a.dp_rank,
                    "error": a.error,
                    "stages_us": {
                        "resolve_topology": s.resolve_topology_us,
                        "resolve_rank": s.resolve_rank_us,
                        "register": s.register_us,
                        "connect": s.connect_us,
                        "verify": s.verify_us,
                        "consume": s.consume_us,
                    },
                })
            })
            .collect();
        json!({
            "arrived_unix_ms": since.as_millis() as u64,
            "took_ms": self.took.as_secs_f64() * 1e3,
            "code": self.code,
            "error": self.error,
            "attempts": attempts,
        })
    }
}

/// The most recent requests' evidence, bounded.
#[derive(Debug)]
pub struct Recent {
    cap: usize,
    ring: Mutex<VecDeque<Arc<RequestTrace>>>,
}

impl Default for Recent {
    fn default() -> Self {
        Recent::new(RECENT_REQUESTS)
    }
}

impl Recent {
    /// Remembers the last `cap` requests.
    pub fn new(cap: usize) -> Self {
        Recent { cap: cap.max(1), ring: Mutex::new(VecDeque::with_capacity(cap.min(1024))) }
    }

    /// Remembers `t`, forgetting the oldest beyond the bound.
    pub fn record(&self, t: RequestTrace) {
        if !handoff_core::metrics::enabled() {
            return;
        }
        let mut ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        if ring.len() >= self.cap {
            ring.pop_front();
        }
        ring.push_back(Arc::new(t));
    }

    /// The request one of whose attempts had `room`, newest first.
    pub fn find(&self, room: u64) -> Option<Arc<RequestTrace>> {
        let ring = self.ring.lock().unwrap_or_else(|e| e.into_inner());
        ring.iter().rev().find(|t| t.attempts.iter().any(|a| a.bootstrap_room == room)).cloned()
    }
}

impl Frontend {
    /// Runs attempts until one yields verified KV loaded into a decoder, or the attempts,
    /// the instances or the deadline run out. Queueing is not failure: an attempt may take
    /// the queue wait the scheduler expects plus `attempt_timeout`.
    pub async fn prefill(&self, plan: &Plan) -> Result<Ready, FrontendError> {
        let (arrived, started) = (std::time::SystemTime::now(), Instant::now());
        let mut failed = Vec::new();
        let span = tracing::info_span!("request", trace_id = tracing::field::Empty);
        plan.trace.bind(&span);
        let result = self.attempts(plan, &mut failed).instrument(span).await;
        let (attempts, error, code) = match &result {
            Ok(r) => {
                let e = &r.evidence;
                let won = Attempt {
                    bootstrap_room: e.bootstrap_room,
                    instance_id: e.instance_id.clone(),
                    dp_rank: e.dp_rank,
                    stages: e.stages,
                    error: String::new(),
                };
                let mut all = e.failed_attempts.clone();
                all.push(won);
                (all, String::new(), "OK".to_owned())
            }
            Err(e) => {
                let code = tonic::Status::from(e.clone()).code();
                (failed, e.to_string(), format!("{code:?}"))
            }
        };
        self.recent.record(RequestTrace {
            arrived,
            took: started.elapsed(),
            attempts,
            error,
            code,
        });
        result
    }

    /// The evidence of a recent request one of whose attempts had `room`.
    pub fn trace(&self, room: u64) -> Option<std::sync::Arc<RequestTrace>> {
        self.recent.find(room)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(rooms: &[u64]) -> RequestTrace {
        RequestTrace {
            arrived: SystemTime::now(),
            took: Duration::from_millis(3),
            attempts: rooms
                .iter()
                .map(|&r| Attempt { bootstrap_room: r, ..Default::default() })
                .collect(),
            error: String::new(),
            code: "OK".into(),
        }
    }

    #[test]
    fn finds_a_request_by_any_of_its_rooms_and_forgets_the_oldest() {
        let r = Recent::new(2);
        r.record(trace(&[1]));
        r.record(trace(&[2, 3]));
        assert_eq!(r.find(3).unwrap().attempts.len(), 2);
        assert!(r.find(1).is_some());
        r.record(trace(&[4]));
        assert!(r.find(1).is_none(), "the oldest is forgotten");
        assert!(r.find(2).is_some() && r.find(4).is_some());
        assert_eq!(r.find(4).unwrap().to_json()["attempts"][0]["bootstrap_room"], 4);
    }
}
