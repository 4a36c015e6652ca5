//! [`PrefillPeer`]: a handoff prefill's Prefill service as this frontend calls it, and what
//! the instance there said of taking the decode's handshakes in the call.

use std::sync::{Arc, Mutex};

use handoff_proto::v1::prefill_client::PrefillClient;
use tonic::transport::Channel;

/// A handoff prefill's Prefill service, as this frontend calls it.
#[derive(Debug, Clone)]
pub struct PrefillPeer {
    /// The client.
    pub client: PrefillClient<Channel>,
    /// The instance at this address whose last answer said it takes the decode's handshakes
    /// in the call (another instance there since has not said so); forgotten when an attempt
    /// or a call that carried them fails for the instance's reasons (see `call`), so the next
    /// goes the old way and asks again. A dropped attempt forgets nothing.
    taker: Arc<Mutex<Option<String>>>,
}

impl PrefillPeer {
    /// A client for a service not yet heard from.
    pub fn new(client: PrefillClient<Channel>) -> Self {
        PrefillPeer { client, taker: Arc::default() }
    }

    /// Whether `instance` said it takes the handshakes in the call.
    pub(crate) fn takes_handshakes(&self, instance: &str) -> bool {
        lock(&self.taker).as_deref() == Some(instance)
    }

    /// `instance`'s answer said whether it takes them.
    pub(crate) fn learn(&self, instance: &str, takes: bool) {
        let mut taker = lock(&self.taker);
        let said_before = taker.as_deref() == Some(instance);
        if takes && !said_before {
            *taker = Some(instance.to_owned());
        } else if !takes && said_before {
            *taker = None;
        }
    }

    /// The next call goes the old way.
    pub(crate) fn forget(&self) {
        *lock(&self.taker) = None;
    }
}

/// Whether two agents' advertised addresses are one host's: the same address, or both
/// loopback.
pub(crate) fn same_host(a: &str, b: &str) -> bool {
    let ip = |s: &str| s.parse::<std::net::IpAddr>().ok().map(|ip| ip.to_canonical());
    match (ip(a), ip(b)) {
        (Some(a), Some(b)) => a == b || (a.is_loopback() && b.is_loopback()),
        _ => a == b,
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_host_is_one_address_or_loopback_both() {
        assert!(same_host("10.0.0.2", "10.0.0.2"));
        assert!(same_host("127.0.0.1", "127.0.0.5"));
        assert!(same_host("::1", "127.0.0.1"));
        assert!(!same_host("10.0.0.2", "10.0.0.3"));
        assert!(!same_host("127.0.0.1", "10.0.0.3"));
        assert!(same_host("::ffff:10.0.0.2", "10.0.0.2"), "v4-mapped");
        assert!(same_host("::ffff:127.0.0.1", "127.0.0.1"));
        assert!(!same_host("localhost", "127.0.0.1"), "names are not resolved");
    }

    #[tokio::test]
    async fn what_an_instance_said_of_handshakes_is_its_own() {
        let channel = Channel::from_static("http://127.0.0.1:1").connect_lazy();
        let peer = PrefillPeer::new(PrefillClient::new(channel));
        assert!(!peer.takes_handshakes("a"), "not heard from");
        peer.learn("a", true);
        assert!(peer.takes_handshakes("a"));
        assert!(!peer.takes_handshakes("b"), "another instance at the address since");
        peer.learn("b", false);
        assert!(peer.takes_handshakes("a"), "b's answer says nothing of a");
        peer.learn("a", false);
        assert!(!peer.takes_handshakes("a"));
        peer.learn("b", true);
        peer.forget();
        assert!(!peer.takes_handshakes("b"));
    }
}
