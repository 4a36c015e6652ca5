//! The `fake` backend: agents in one process, no sockets. Handshakes and writes are
//! delivered by a direct call into the peer's inbox, payloads by reference. For control-plane
//! tests and single-process setups; it verifies exactly as the real backends do.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::{Arc, Mutex, Weak};

use async_trait::async_trait;

use crate::{AgentAddr, ConnectRequest, Inbox, TransferBackend, TransferError, WriteRequest};

/// The in-process "network" fake agents live on.
#[derive(Debug, Default)]
pub struct FakeNetwork {
    next_port: AtomicU16,
    agents: Mutex<HashMap<AgentAddr, Weak<Inbox>>>,
}

impl FakeNetwork {
    /// An empty network.
    pub fn new() -> Arc<Self> {
        Arc::new(FakeNetwork { next_port: AtomicU16::new(1), ..Default::default() })
    }

    fn lookup(&self, peer: &AgentAddr) -> Result<Arc<Inbox>, TransferError> {
        let agents = self.agents.lock().unwrap_or_else(|e| e.into_inner());
        agents.get(peer).and_then(Weak::upgrade).ok_or_else(|| TransferError::Io {
            peer: peer.clone(),
            reason: "no such fake agent".into(),
        })
    }
}

/// A fake agent (see the module docs).
#[derive(Debug)]
pub struct FakeTransfer {
    net: Arc<FakeNetwork>,
    addr: AgentAddr,
}

impl FakeTransfer {
    /// Joins `net` with a fresh address, delivering into `inbox`.
    pub fn new(net: &Arc<FakeNetwork>, inbox: &Arc<Inbox>) -> Self {
        let port = net.next_port.fetch_add(1, Ordering::Relaxed).max(1);
        let addr = AgentAddr { ip: "127.0.0.1".into(), port };
        net.agents
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(addr.clone(), Arc::downgrade(inbox));
        FakeTransfer { net: net.clone(), addr }
    }
}

impl Drop for FakeTransfer {
    fn drop(&mut self) {
        self.net.agents.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.addr);
    }
}

#[async_trait]
impl TransferBackend for FakeTransfer {
    fn name(&self) -> &'static str {
        "fake"
    }

    /// A sender is bound to its agent's port, whatever the call.
    fn posts_parts(&self) -> bool {
        true
    }

    fn handshake_in_call(&self) -> bool {
        true
    }

    fn local_addr(&self) -> AgentAddr {
        self.addr.clone()
    }

    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        self.net.lookup(peer)?.on_connect(req)
    }

    async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError> {
        let inbox = self.net.lookup(peer)?;
        let segments: Vec<(u64, &[u8])> = req.pairs.iter().map(|(b, off)| (*off, &b[..])).collect();
        // In process, the sending agent is the connection.
        let conn = crate::ConnId(u64::from(self.addr.port));
        inbox.on_write(req.region, req.sender, conn, &segments)?;
        match req.notice {
            Some(n) => inbox.on_notice(req.region, conn, n),
            None => Ok(()),
        }
    }
}
