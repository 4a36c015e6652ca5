//! [`Idle`]: connections a client dialed, waiting to be used again, each for a while.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::AgentAddr;

/// Idle connections by peer: at most `max` per peer, each kept at most `ttl`. Expired ones
/// are dropped when met, and at most once every `ttl` a take or a return (to any peer)
/// sweeps them all, so peers that went away leave neither connections nor entries behind
/// for longer than the pool is in use. Times are arguments (`*_at`).
#[derive(Debug)]
pub(crate) struct Idle<C, K = AgentAddr> {
    state: Mutex<IdleState<C, K>>,
    max: usize,
    ttl: Duration,
}

#[derive(Debug)]
struct IdleState<C, K> {
    /// Oldest first, each with when it was returned.
    by_peer: HashMap<K, Vec<(C, Instant)>>,
    swept: Option<Instant>,
}

impl<C, K: Eq + Hash + Clone> Idle<C, K> {
    pub(crate) fn new(max: usize, ttl: Duration) -> Self {
        Idle { state: Mutex::new(IdleState { by_peer: HashMap::new(), swept: None }), max, ttl }
    }

    /// [`Idle::take_at`] now.
    pub(crate) fn take(&self, peer: &K, alive: impl Fn(&C) -> bool) -> Option<C> {
        self.take_at(peer, alive, Instant::now())
    }

    /// The connection to `peer` returned last, if it has not expired by `now` and `alive`
    /// accepts it; those refused on the way are dropped.
    pub(crate) fn take_at(&self, peer: &K, alive: impl Fn(&C) -> bool, now: Instant) -> Option<C> {
        let mut expired = Vec::new();
        loop {
            let (c, since) = {
                let mut s = self.lock();
                if expired.is_empty() {
                    expired = s.sweep_if_due(now, self.ttl);
                }
                let v = s.by_peer.get_mut(peer)?;
                let newest = v.pop();
                if v.is_empty() {
                    s.by_peer.remove(peer);
                }
                newest?
            };
            if now.saturating_duration_since(since) < self.ttl && alive(&c) {
                return Some(c);
            }
        }
    }

    /// [`Idle::put_at`] now.
    pub(crate) fn put(&self, peer: &K, c: C) {
        self.put_at(peer, c, Instant::now());
    }

    /// Returns `c`, a connection to `peer`, at `now`, unless `max` already wait there.
    pub(crate) fn put_at(&self, peer: &K, c: C, now: Instant) {
        let mut s = self.lock();
        let expired = s.sweep_if_due(now, self.ttl);
        let v = s.by_peer.entry(peer.clone()).or_default();
        let refused = if v.len() < self.max {
            v.push((c, now));
            None
        } else {
            Some(c)
        };
        drop(s);
        // Closed outside the lock.
        drop((expired, refused));
    }

    /// Connections waiting, to every peer.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.lock().by_peer.values().map(Vec::len).sum()
    }

    /// Peers with connections waiting.
    #[cfg(test)]
    pub(crate) fn peers(&self) -> usize {
        self.lock().by_peer.len()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, IdleState<C, K>> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl<C, K: Eq + Hash> IdleState<C, K> {
    /// [`IdleState::sweep`], when none has run for `ttl` by `now`.
    fn sweep_if_due(&mut self, now: Instant, ttl: Duration) -> Vec<C> {
        match self.swept {
            Some(t) if now.saturating_duration_since(t) < ttl => Vec::new(),
            _ => {
                self.swept = Some(now);
                self.sweep(now, ttl)
            }
        }
    }

    /// Takes out every connection idle for `ttl` by `now`, and the peers left with none.
    fn sweep(&mut self, now: Instant, ttl: Duration) -> Vec<C> {
        let mut expired = Vec::new();
        self.by_peer.retain(|_, v| {
            let fresh = v.iter().position(|(_, t)| now.saturating_duration_since(*t) < ttl);
            expired.extend(v.drain(..fresh.unwrap_or(v.len())).map(|(c, _)| c));
            !v.is_empty()
        });
        expired
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer(port: u16) -> AgentAddr {
        AgentAddr { ip: "10.0.0.1".into(), port }
    }

    /// A connection idle past the time is not handed out; one within it is, newest first.
    #[test]
    fn an_expired_connection_is_not_handed_out() {
        let idle = Idle::new(4, Duration::from_secs(60));
        let t0 = Instant::now();
        idle.put_at(&peer(1), "old", t0);
        idle.put_at(&peer(1), "new", t0 + Duration::from_secs(30));
        let at = t0 + Duration::from_secs(61);
        assert_eq!(idle.take_at(&peer(1), |_| true, at), Some("new"));
        assert_eq!(idle.take_at(&peer(1), |_| true, at), None, "the old one expired");
        assert_eq!(idle.peers(), 0, "no entry left for the peer");
        // One that does not look alive is dropped on the way.
        idle.put_at(&peer(1), "alive", at);
        idle.put_at(&peer(1), "dead", at);
        assert_eq!(idle.take_at(&peer(1), |c| *c != "dead", at), Some("alive"));
        assert_eq!(idle.len(), 0, "the dead one was dropped");
    }

    /// Peers that went away: their connections and entries go at the next sweep, whoever
    /// returns a connection then; the pool holds at most `max` per peer.
    #[test]
    fn a_return_sweeps_the_expired_connections_of_every_peer() {
        let idle = Idle::new(2, Duration::from_secs(60));
        let t0 = Instant::now();
        for p in 0..100 {
            for _ in 0..3 {
                idle.put_at(&peer(p), p, t0);
            }
        }
        assert_eq!((idle.len(), idle.peers()), (200, 100), "at most 2 per peer");
        idle.put_at(&peer(500), 500, t0 + Duration::from_secs(59));
        assert_eq!(idle.len(), 201, "nothing expired yet");
        idle.put_at(&peer(500), 500, t0 + Duration::from_secs(61));
        assert_eq!((idle.len(), idle.peers()), (2, 1), "only the fresh peer's are left");
        // A take sweeps too, whichever peer it asks for: a pool only asked of keeps nothing.
        assert_eq!(idle.take_at(&peer(9), |_| true, t0 + Duration::from_secs(200)), None);
        assert_eq!((idle.len(), idle.peers()), (0, 0));
    }
}
