//! [`DecodeSlots`]: the decode's own admission.
//!
//! An engine advances at most its batch of sequences in one pass: more sequences than that
//! add no throughput, only passes, so every sequence's tokens come slower. Left unbounded, a
//! burst slows every stream until none meets its deadline, the ones that would have been
//! served included. So at most `capacity` sequences decode at once (by default the engine's
//! batch), and the others wait for a slot in turn (first come, first served, from when their
//! prefill is done).
//!
//! A request is admitted (before its prefill) only if its expected wait for a slot leaves it
//! its expected decode time (its tokens at the larger of a step's time and a token's share
//! of a slot's hold lately), or half the time left if that is less (a decode may end early,
//! at its end token or a stop string; the prefill's admission reserves the decode the same
//! time); otherwise it is refused at once as an overload. The wait counts whole rounds of
//! slots (the requests admitted ahead beyond the capacity, divided by it and rounded up) times
//! how long a sequence that ran to its end held its slot lately, plus how long a request takes
//! from its admission to its slot (its prefill and transfer): slots taken in a burst free up
//! together once their prefills are done, and a sequence cut by its deadline held its slot
//! less than it needed. Until one has run to its end, only the capacity is admitted: a wait
//! that cannot be estimated is not promised.
//!
//! The requests admitted hold their KV from their transfer to their decode's end, waiting
//! for a slot included: their prompts' KV together is kept within a budget (by default the
//! transfer inbox's, 8 GiB), beyond which a request is refused at once as well (a burst of
//! long prompts admitted on time alone could hold more than the host has).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::input::Plan;
use crate::{Frontend, FrontendError, Limit};

/// The decode's slots and the requests admitted to them (see the module docs).
#[derive(Debug)]
pub struct DecodeSlots {
    capacity: usize,
    /// Most bytes of KV the requests admitted hold together.
    kv_budget: u64,
    slots: Arc<Semaphore>,
    counts: Mutex<Counts>,
}

#[derive(Debug, Default)]
struct Counts {
    /// Requests admitted and not ended: prefilling, waiting for a slot or decoding.
    admitted: usize,
    /// Bytes of KV their prompts hold (or will, once transferred).
    kv_bytes: u64,
    /// Moving average of how long a sequence that ran to its end held its slot (0: none
    /// has yet).
    hold_ns: u64,
    /// Moving average of a token's share of such a hold (the hold over the tokens decoded).
    token_ns: u64,
    /// Moving average of how long a request took from its admission to a slot it found free
    /// (its prefill and transfer).
    lead_ns: u64,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodeFull {
    /// The wait for a slot, and its share of the time.
    Slots {
        /// The expected wait for a slot (`None`: no sequence has run to its end yet).
        wait: Option<Duration>,
        /// What the request's deadline leaves for that wait.
        allowed: Duration,
    },
    /// Its KV would pass the budget of the requests admitted.
    Memory {
        /// Bytes the requests admitted hold.
        held: u64,
        /// Bytes its prompt's KV takes.
        asked: u64,
        /// The budget.
        budget: u64,
    },
}

impl DecodeFull {
    /// When to try again: once the wait would fit, at least a second from now.
    pub fn retry_after(&self) -> Duration {
        let over = match *self {
            DecodeFull::Slots { wait, allowed } => {
                wait.map_or(Duration::ZERO, |w| w.saturating_sub(allowed))
            }
            DecodeFull::Memory { .. } => Duration::ZERO,
        };
        over.max(Duration::from_secs(1))
    }

    /// The expected wait for a slot, when that is why.
    pub fn wait(&self) -> Option<Duration> {
        match *self {
            DecodeFull::Slots { wait, .. } => wait,
            DecodeFull::Memory { .. } => None,
        }
    }
}

impl std::fmt::Display for DecodeFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match *self {
            DecodeFull::Slots { wait: Some(w), allowed } => write!(
                f,
                "decode slots full: a slot expected in {} ms, {} ms allowed by the deadline",
                w.as_millis(),
                allowed.as_millis()
            ),
            DecodeFull::Slots { wait: None, .. } => {
                write!(f, "decode slots full: no slot's hold measured yet to promise a wait")
            }
            DecodeFull::Memory { held, asked, budget } => write!(
                f,
                "decode KV budget full: the requests admitted hold {} MiB, this one's prompt \
                 needs {} MiB more, {} MiB at most",
                held >> 20,
                asked.div_ceil(1 << 20),
                budget >> 20
            ),
        }
    }
}

impl DecodeSlots {
    /// At most `capacity` (at least 1) sequences decoding at once, and no KV budget.
    pub fn new(capacity: usize) -> Arc<Self> {
        Self::with_kv_budget(capacity, u64::MAX)
    }

    /// At most `capacity` (at least 1) sequences decoding at once, and the requests
    /// admitted holding at most `kv_budget` bytes of KV.
    pub fn with_kv_budget(capacity: usize, kv_budget: u64) -> Arc<Self> {
        let capacity = capacity.max(1);
        Arc::new(DecodeSlots {
            capacity,
            kv_budget,
            slots: Arc::new(Semaphore::new(capacity)),
            counts: Mutex::default(),
        })
    }

    fn counts(&self) -> std::sync::MutexGuard<'_, Counts> {
        self.counts.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Requests admitted and not ended.
    pub fn admitted(&self) -> usize {
        self.counts().admitted
    }

    /// Slots held now.
    pub fn decoding(&self) -> usize {
        self.capacity - self.slots.available_permits()
    }

    /// Admits a request whose decode is expected to take `decode` and whose deadline is
    /// `left` away, its prompt's KV taking `kv_bytes`, or refuses it: its expected wait for
    /// a slot must leave it `decode`, or half of `left` if that is less (a decode may end
    /// early, at its end token or a stop string), and its KV must fit the budget beside the
    /// others' (or be alone: one request is never refused for its size here).
    pub fn admit(
        self: &Arc<Self>,
        decode: Duration,
        left: Duration,
        kv_bytes: u64,
    ) -> Result<Ticket, DecodeFull> {
        let mut c = self.counts();
        if c.kv_bytes > 0 && c.kv_bytes.saturating_add(kv_bytes) > self.kv_budget {
            return Err(DecodeFull::Memory {
                held: c.kv_bytes,
                asked: kv_bytes,
                budget: self.kv_budget,
            });
        }
        let ahead = (c.admitted + 1).saturating_sub(self.capacity);
        if ahead > 0 {
            let allowed = left - decode.min(left / 2);
            if c.hold_ns == 0 {
                return Err(DecodeFull::Slots { wait: None, allowed });
            }
            let rounds = ahead.div_ceil(self.capacity) as u64;
            let wait = rounds.saturating_mul(c.hold_ns).saturating_add(c.lead_ns);
            let wait = Duration::from_nanos(wait);
            if wait > allowed {
                return Err(DecodeFull::Slots { wait: Some(wait), allowed });
            }
        }
        c.admitted += 1;
        c.kv_bytes = c.kv_bytes.saturating_add(kv_bytes);
        let admitted_at = Instant::now();
        Ok(Ticket { slots: self.clone(), admitted_at, slot: None, ran_to_end: 0, kv_bytes })
    }

    /// Bytes of KV the requests admitted hold.
    pub fn kv_bytes(&self) -> u64 {
        self.counts().kv_bytes
    }

    /// How long decoding `tokens` held a slot lately (zero until a sequence ran to its end):
    /// measured under the load the sequences ran in, as a step's time is not once the
    /// sequences of a burst have ended.
    pub fn decode_time(&self, tokens: u32) -> Duration {
        Duration::from_nanos(self.counts().token_ns.saturating_mul(u64::from(tokens)))
    }

    /// [`Counts::note_hold`].
    #[cfg(test)]
    fn note_hold(&self, took: Duration, tokens: u32) {
        self.counts().note_hold(took, tokens);
    }

    /// Adds how long a request took from its admission to a free slot to the moving average.
    fn note_lead(&self, took: Duration) {
        moving_average(&mut self.counts().lead_ns, took);
    }
}

impl Counts {
    /// Adds how long a sequence that ran to its end held its slot, decoding `tokens`, to the
    /// moving averages.
    fn note_hold(&mut self, took: Duration, tokens: u32) {
        moving_average(&mut self.hold_ns, took);
        moving_average(&mut self.token_ns, took / tokens.max(1));
    }
}

/// Adds `sample` (at least 1 ns: 0 stands for nothing measured) to the average `ns`.
fn moving_average(ns: &mut u64, sample: Duration) {
    let sample = sample.as_nanos().clamp(1, u128::from(u64::MAX)) as u64;
    *ns = if *ns == 0 { sample } else { (*ns * 7 + sample) / 8 };
}

/// An admitted request's place: counted until dropped; holds a slot once [`Ticket::slot`]
/// returns.
#[derive(Debug)]
pub struct Ticket {
    slots: Arc<DecodeSlots>,
    admitted_at: Instant,
    slot: Option<(OwnedSemaphorePermit, Instant)>,
    /// Tokens its sequence decoded, once it ended on its own terms (see
    /// [`Ticket::ran_to_end`]); 0 before.
    ran_to_end: u32,
    /// Its prompt's KV, counted against the budget.
    kv_bytes: u64,
}

impl Ticket {
    /// Marks its sequence as ended on its own terms (an end token, a stop string, its
    /// `max_tokens`, an open-ended chat's deadline; not a request's failure): how long it
    /// held its slot is then what the next ones are promised.
    pub fn ran_to_end(&mut self, tokens: u32) {
        self.ran_to_end = tokens.max(1);
    }

    /// Waits for a slot, after those that began waiting before it (at once if it holds one).
    pub async fn slot(&mut self) {
        if self.slot.is_some() {
            return;
        }
        let slots = self.slots.slots.clone();
        if let Ok(permit) = slots.clone().try_acquire_owned() {
            self.slots.note_lead(self.admitted_at.elapsed());
            self.slot = Some((permit, Instant::now()));
        // The semaphore is never closed.
        } else if let Ok(permit) = slots.acquire_owned().await {
            self.slot = Some((permit, Instant::now()));
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut c = self.slots.counts();
        if let Some((_, since)) = &self.slot
            && self.ran_to_end > 0
        {
            c.note_hold(since.elapsed(), self.ran_to_end);
        }
        c.admitted = c.admitted.saturating_sub(1);
        c.kv_bytes = c.kv_bytes.saturating_sub(self.kv_bytes);
        // The slot goes back with the ticket's fields, after the count.
    }
}

/// Admits `plan` to the decode's slots, if it has a bound (see [`crate::decoding`]): before
/// its prefill, so a request the decode cannot take in time costs no prefill.
pub(crate) fn admit_request(fe: &Frontend, plan: &Plan) -> Result<Option<Ticket>, FrontendError> {
    // One token is the prefill's: no decode step, no slot.
    let Some(slots) = fe.decoding.as_ref().filter(|_| plan.max_tokens > 1) else {
        return Ok(None);
    };
    let decode = fe.expected_decode(plan.max_tokens);
    let left = plan.deadline.saturating_duration_since(tokio::time::Instant::now());
    let kv_bytes =
        (plan.tokens.len() as u64).saturating_mul(fe.engine.info().shape.token_bytes() as u64);
    match slots.admit(decode, left, kv_bytes) {
        Ok(ticket) => Ok(Some(ticket)),
        Err(full) => Err(FrontendError::Overloaded {
            retry_after: full.retry_after(),
            limit: match full {
                DecodeFull::Slots { .. } => Limit::DecodeSlots,
                DecodeFull::Memory { .. } => Limit::DecodeMemory,
            },
            reason: full.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests;
