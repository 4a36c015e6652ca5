//! Fault injection for any backend: wraps a sender's backend and corrupts its next writes in
//! one chosen way, so tests can prove the receiver rejects each fault at verification.

use std::sync::{Arc, Mutex};

use async_trait::async_trait;
use bytes::BytesMut;
use handoff_core::Room;

use crate::{AgentAddr, ConnectRequest, TransferBackend, TransferError, WriteRequest};

/// A fault to inject into a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The notice names another room.
    WrongRoom,
    /// One payload byte is flipped after the checksum was computed.
    FlipByte,
    /// The last payload is cut short; the notice still claims the full length.
    Truncate,
    /// Half the payload is sent, then the sender vanishes: no notice, an error to its caller.
    SenderGone,
    /// The write never completes: the decode's host gone silent (no reset, no answer).
    Stalled,
}

/// The armed fault, shared by every [`FaultyTransfer`] made with it (e.g. all ranks of one
/// instance), so a test can arm it from outside.
#[derive(Debug, Default)]
pub struct FaultSwitch {
    armed: Mutex<Option<(Fault, usize)>>,
}

impl FaultSwitch {
    /// A switch with nothing armed.
    pub fn new() -> Arc<Self> {
        Arc::default()
    }

    /// Injects `fault` into the next `times` writes through this switch.
    pub fn arm(&self, fault: Fault, times: usize) {
        *self.armed.lock().unwrap_or_else(|e| e.into_inner()) =
            (times > 0).then_some((fault, times));
    }

    /// Writes still to be faulted.
    pub fn remaining(&self) -> usize {
        self.armed.lock().unwrap_or_else(|e| e.into_inner()).map_or(0, |a| a.1)
    }

    fn take(&self) -> Option<Fault> {
        let mut armed = self.armed.lock().unwrap_or_else(|e| e.into_inner());
        let (fault, left) = armed.as_mut()?;
        let f = *fault;
        *left -= 1;
        if *left == 0 {
            *armed = None;
        }
        Some(f)
    }
}

/// A backend that injects the faults armed on its [`FaultSwitch`] into the writes it posts.
#[derive(Debug)]
pub struct FaultyTransfer {
    inner: Arc<dyn TransferBackend>,
    switch: Arc<FaultSwitch>,
}

impl std::fmt::Debug for dyn TransferBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.name(), self.local_addr())
    }
}

impl FaultyTransfer {
    /// Wraps `inner`, faulting what `switch` arms.
    pub fn new(inner: Arc<dyn TransferBackend>, switch: Arc<FaultSwitch>) -> Self {
        FaultyTransfer { inner, switch }
    }
}

fn other_room(r: Room) -> Room {
    Room::try_from(if r.get() == 1 { 2 } else { r.get() - 1 }).unwrap_or(r)
}

#[async_trait]
impl TransferBackend for FaultyTransfer {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn local_addr(&self) -> AgentAddr {
        self.inner.local_addr()
    }

    fn handshake_in_call(&self) -> bool {
        self.inner.handshake_in_call()
    }

    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        self.inner.connect(peer, req).await
    }

    async fn post_write(
        &self,
        peer: &AgentAddr,
        mut req: WriteRequest,
    ) -> Result<(), TransferError> {
        match self.switch.take() {
            None => {}
            Some(Fault::WrongRoom) => {
                if let Some(n) = req.notice.as_mut() {
                    n.room = other_room(n.room);
                }
            }
            Some(Fault::FlipByte) => {
                if let Some((b, _)) = req.pairs.iter_mut().find(|(b, _)| !b.is_empty()) {
                    let mut m = BytesMut::from(&b[..]);
                    m[0] ^= 0x5a;
                    *b = m.freeze();
                }
            }
            Some(Fault::Truncate) => {
                if let Some((b, _)) = req.pairs.last_mut() {
                    *b = b.slice(..b.len() / 2);
                }
            }
            Some(Fault::Stalled) => std::future::pending::<()>().await,
            Some(Fault::SenderGone) => {
                let half = req.pairs.len().div_ceil(2);
                req.pairs.truncate(half);
                req.notice = None;
                self.inner.post_write(peer, req).await?;
                return Err(TransferError::Io {
                    peer: peer.clone(),
                    reason: "sender gone mid-transfer".into(),
                });
            }
        }
        self.inner.post_write(peer, req).await
    }
}
