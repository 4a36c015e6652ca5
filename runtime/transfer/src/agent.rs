//! [`Agent`]: a transfer backend and the inbox it delivers into.

use std::sync::Arc;

use crate::{AgentAddr, ConnectRequest, Inbox, TransferBackend, TransferError, WriteRequest};

/// One transfer endpoint: a prefill rank, or a decode frontend.
#[derive(Clone)]
pub struct Agent {
    backend: Arc<dyn TransferBackend>,
    inbox: Arc<Inbox>,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("backend", &self.backend.name())
            .field("addr", &self.backend.local_addr())
            .finish()
    }
}

impl Agent {
    /// An agent over `backend`, which delivers into `inbox`.
    pub fn new(backend: Arc<dyn TransferBackend>, inbox: Arc<Inbox>) -> Self {
        Agent { backend, inbox }
    }

    /// This agent's endpoint.
    pub fn addr(&self) -> AgentAddr {
        self.backend.local_addr()
    }

    /// The backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// The receiving side.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Sends a handshake to a sender rank, and marks the region connected once it is accepted.
    pub async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        let region = req.region;
        self.backend.connect(peer, req).await?;
        self.inbox.mark_connected(region);
        Ok(())
    }

    /// Posts a write to a receiver.
    pub async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError> {
        self.backend.post_write(peer, req).await
    }
}
