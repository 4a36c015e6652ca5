//! [`NixlReader`]: a NIXL agent that only reads from foreign agents (vLLM's prefill workers):
//! no control listener, no staging arena; the only memory it ever registers is each read's
//! own buffer, for that read.

use std::sync::Arc;
use std::time::Duration;

use super::engine::{Engine, Segment};
use super::memory;
use crate::TransferError;

/// See the module docs.
#[derive(Clone)]
pub struct NixlReader {
    engine: Arc<Engine>,
}

impl std::fmt::Debug for NixlReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlReader").field("agent", &self.engine.name()).finish()
    }
}

impl NixlReader {
    /// Starts an agent whose progress thread wakes at least every `progress_delay`. Fails,
    /// saying what to install, when NIXL's library is not found.
    pub fn start(progress_delay: Duration) -> Result<Self, TransferError> {
        let name = format!("handoff-reader-{:016x}", rand::random::<u64>());
        Ok(NixlReader { engine: Arc::new(Engine::start(&name, progress_delay)?) })
    }

    /// This agent's name.
    pub fn agent_name(&self) -> &str {
        self.engine.name()
    }

    /// Loads a foreign agent's metadata, or refreshes it; returns that agent's name.
    pub fn load_peer(&self, metadata: &[u8]) -> Result<String, TransferError> {
        self.engine.load(metadata)
    }

    /// Forgets agent `peer`'s metadata (and NIXL's connection to it): for a peer that may
    /// have restarted, whose metadata is loaded again before the next read.
    pub fn forget_peer(&self, peer: &str) {
        self.engine.forget(peer);
    }

    /// Sends agent `peer` the notification `msg`.
    pub fn notify_peer(&self, peer: &str, msg: &[u8]) -> Result<(), TransferError> {
        self.engine.notify(peer, msg)
    }

    /// READs `ranges` (remote address, length) of agent `peer`'s memory, one after the
    /// other, into a fresh buffer, and has NIXL send `peer` the notification `notify` once
    /// they are here (vLLM's prefill frees its blocks on it). The buffer is registered only
    /// for the read, and its key never leaves this agent. Fails after `timeout`; a read that
    /// fails after it was posted keeps its buffer until NIXL says it ended, rather than free
    /// memory UCX may still write (see the engine's module docs).
    pub async fn read_from(
        &self,
        peer: &str,
        ranges: &[(u64, usize)],
        notify: Option<Vec<u8>>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransferError> {
        let mut at = 0usize;
        let mut segments = Vec::with_capacity(ranges.len());
        for &(dst, len) in ranges {
            segments.push(Segment { src: at, dst, len });
            at = at
                .checked_add(len)
                .ok_or_else(|| TransferError::Malformed("read too large".into()))?;
        }
        let into = self.engine.register(memory::Pinned::zeroed(at))?;
        let engine = self.engine.clone();
        let peer = peer.to_owned();
        let deadline = std::time::Instant::now() + timeout;
        tokio::task::spawn_blocking(move || {
            let into = engine.read(into, &segments, &peer, notify.as_deref(), deadline)?;
            let settled = into.settle().ok_or_else(|| {
                TransferError::Failed("nixl could not deregister the read buffer".into())
            })?;
            let mut bytes = settled.into_pinned().into_vec();
            bytes.truncate(at);
            Ok(bytes)
        })
        .await
        .map_err(|e| TransferError::Failed(format!("nixl read task: {e}")))?
    }
}
