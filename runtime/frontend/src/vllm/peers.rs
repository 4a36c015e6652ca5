//! The vLLM prefill ranks this frontend has handshaken with, and the guard that tells a
//! rank it may free a request's blocks however the attempt ends.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use handoff_transfer::nixl::NixlReader;
use handoff_vllm::{KvSource, Peer, VllmError};

/// Side-channel handshakes remembered (a prefill rank each); past this, all are forgotten.
const MAX_PEERS: usize = 1024;

/// A prefill rank's side channel: host, port, TP rank.
type PeerKey = (String, u16, u32);

/// See the module docs.
#[derive(Default)]
pub(super) struct Peers {
    map: Mutex<HashMap<PeerKey, Arc<Peer>>>,
    /// Side channels (host, port) whose last read ran out of time.
    timed_out: Mutex<HashSet<(String, u16)>>,
}

impl Peers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<PeerKey, Arc<Peer>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// TP rank `rank` of `source`'s prefill at `host`, handshaken once per prefill engine:
    /// its metadata loaded into `reader`'s agent.
    pub(super) async fn get(
        &self,
        reader: &NixlReader,
        host: &str,
        source: &KvSource,
        rank: u32,
        timeout: Duration,
    ) -> Result<Arc<Peer>, VllmError> {
        let key = (host.to_owned(), source.port, rank);
        if let Some(p) = self.lock().get(&key)
            && p.handshake.metadata.engine_id == source.engine_id
        {
            return Ok(p.clone());
        }
        let p = Arc::new(handoff_vllm::connect(reader, host, source.port, 0, rank, timeout).await?);
        if p.handshake.metadata.engine_id != source.engine_id {
            reader.forget_peer(&p.agent);
            return Err(VllmError::Malformed(format!(
                "side channel {host}:{} rank {rank} is engine {:?}, the answer named {:?}",
                source.port, p.handshake.metadata.engine_id, source.engine_id
            )));
        }
        let mut peers = self.lock();
        // One agent is one rank: another key naming it is a prefill lying about who it is
        // (forgetting it would drop the rank it named).
        if peers.iter().any(|(k, q)| *k != key && q.agent == p.agent) {
            return Err(VllmError::Malformed(format!(
                "side channel {host}:{} rank {rank} names agent {:?}, which another rank is",
                source.port, p.agent
            )));
        }
        if peers.len() >= MAX_PEERS {
            for (_, q) in peers.drain() {
                reader.forget_peer(&q.agent);
            }
        }
        if let Some(old) = peers.insert(key, p.clone())
            && old.agent != p.agent
        {
            reader.forget_peer(&old.agent);
        }
        Ok(p)
    }

    /// Notes how a read from side channel `host:port` ended (`timed_out`: out of time, given
    /// enough of it); true if it ran out of time right after another read from it did, no
    /// read between ending in time. A read's time running out is its own failure, and
    /// forgetting the ranks fails every read from them in flight, but a prefill that hangs,
    /// or restarted behind the same address under the same engine id, times every read
    /// out: the second such read in a row forgets it.
    pub(super) fn timed_out_again(&self, host: &str, port: u16, timed_out: bool) -> bool {
        let mut last = self.timed_out.lock().unwrap_or_else(|e| e.into_inner());
        let key = (host.to_owned(), port);
        if last.remove(&key) || !timed_out {
            return timed_out;
        }
        if last.len() >= MAX_PEERS {
            last.clear();
        }
        last.insert(key);
        false
    }

    /// Forgets the ranks behind side channel `host:port` (NIXL's copy of their metadata too):
    /// the prefill may have restarted or changed its cache; they are asked again next time.
    pub(super) fn forget(&self, reader: &NixlReader, host: &str, port: u16) {
        self.lock().retain(|(h, p, _), peer| {
            let keep = h != host || *p != port;
            if !keep {
                reader.forget_peer(&peer.agent);
            }
            keep
        });
    }
}

/// Notifies every rank `"<request id>:1"` when dropped, unless [`Notify::done`] was called:
/// the ranks of a request whose read failed, or whose attempt was given up, free its blocks
/// at once.
pub(super) struct Notify<'a> {
    reader: &'a NixlReader,
    agents: Vec<String>,
    msg: Vec<u8>,
    heartbeat: Vec<u8>,
}

impl<'a> Notify<'a> {
    pub(super) fn new(reader: &'a NixlReader, ranks: &[Arc<Peer>], request_id: &str) -> Self {
        Notify {
            reader,
            agents: ranks.iter().map(|p| p.agent.clone()).collect(),
            msg: format!("{request_id}:1").into_bytes(),
            heartbeat: format!("HB:{request_id}").into_bytes(),
        }
    }

    /// Tells every rank the request's blocks are still wanted (vLLM's `HB:<request id>`):
    /// each extends its lease on them, which would otherwise run out (30 s by default) and
    /// give the blocks to another request while this read is still running.
    pub(super) fn heartbeat(&self) {
        for agent in &self.agents {
            if let Err(e) = self.reader.notify_peer(agent, &self.heartbeat) {
                tracing::debug!(%agent, error = %e, "vLLM rank not sent a heartbeat");
            }
        }
    }

    /// The read's own notification went: nothing more to send.
    pub(super) fn done(mut self) {
        self.agents.clear();
    }
}

impl Drop for Notify<'_> {
    fn drop(&mut self) {
        for agent in &self.agents {
            if let Err(e) = self.reader.notify_peer(agent, &self.msg) {
                tracing::debug!(%agent, error = %e, "vLLM rank not notified");
            }
        }
    }
}
