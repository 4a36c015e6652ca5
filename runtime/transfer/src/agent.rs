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

    /// Whether its handshakes may ride in the prefill call (see
    /// [`TransferBackend::handshake_in_call`]).
    pub fn handshake_in_call(&self) -> bool {
        self.backend.handshake_in_call()
    }

    /// The receiving side.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.inbox
    }

    /// Sends a handshake to a sender rank, and marks the region connected once it is accepted.
    pub async fn connect(
        &self,
        peer: &AgentAddr,
        req: ConnectRequest,
    ) -> Result<(), TransferError> {
        let region = req.region;
        self.backend.connect(peer, req).await?;
        self.inbox.mark_connected(region);
        Ok(())
    }

    /// Opens `sender`'s streamed write into `region` at the receiver `peer` (see
    /// [`crate::WriteStream`]).
    pub async fn open_write(
        &self,
        peer: &AgentAddr,
        region: crate::RegionId,
        sender: crate::SenderId,
    ) -> Result<crate::WriteStream, TransferError> {
        crate::WriteStream::open(self.backend.clone(), peer, region, sender).await
    }

    /// Posts a write to a receiver.
    pub async fn post_write(
        &self,
        peer: &AgentAddr,
        req: WriteRequest,
    ) -> Result<(), TransferError> {
        self.backend.post_write(peer, req).await
    }
}

/// Which backend an agent runs on.
#[derive(Debug, Clone)]
pub enum TransferKind {
    /// Real sockets: listen on `bind_ip` (an ephemeral port), advertise `advertise_ip`.
    Tcp {
        /// Where to listen.
        bind_ip: std::net::IpAddr,
        /// What peers dial (defaults to `bind_ip`).
        advertise_ip: Option<String>,
        /// Mutual TLS with the cluster's CA.
        tls: Option<handoff_core::tls::ClusterTls>,
        /// Writes to peers on this host through shared memory (see `tcp::shm`).
        shared_memory: bool,
    },
    /// Mooncake Transfer Engine's TCP wire: listen on `bind_ip` (two ephemeral ports, the
    /// handshake port advertised), advertise `advertise_ip`.
    Mooncake {
        /// Where to listen.
        bind_ip: std::net::IpAddr,
        /// What peers dial (defaults to `bind_ip`).
        advertise_ip: Option<String>,
    },
    /// NIXL WRITEs (UCX underneath) through the library `scripts/fetch-nixl` installs, with a
    /// control listener on `bind_ip` (an ephemeral port, advertised).
    Nixl {
        /// Where the control listener binds.
        bind_ip: std::net::IpAddr,
        /// What peers dial (defaults to `bind_ip`).
        advertise_ip: Option<String>,
    },
    /// In-process, on this fake network.
    Fake(Arc<crate::FakeNetwork>),
}

impl TransferKind {
    /// Real sockets on loopback.
    pub fn loopback() -> Self {
        TransferKind::Tcp {
            bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
            advertise_ip: None,
            tls: None,
            shared_memory: true,
        }
    }

    /// Where its listeners bind (loopback for the in-process fake).
    pub fn bind_ip(&self) -> std::net::IpAddr {
        match self {
            TransferKind::Tcp { bind_ip, .. }
            | TransferKind::Mooncake { bind_ip, .. }
            | TransferKind::Nixl { bind_ip, .. } => *bind_ip,
            TransferKind::Fake(_) => std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }

    /// What peers dial, when it is not the bind address.
    pub fn advertise_ip(&self) -> Option<String> {
        match self {
            TransferKind::Tcp { advertise_ip, .. }
            | TransferKind::Mooncake { advertise_ip, .. }
            | TransferKind::Nixl { advertise_ip, .. } => advertise_ip.clone(),
            TransferKind::Fake(_) => None,
        }
    }

    /// Starts an agent on this backend, its tasks on `tasks`; with `faults`, its writes go
    /// through a [`crate::FaultyTransfer`]. The inbox's token, when set, is required of
    /// every inbound connection and sent on every outbound one.
    pub async fn start(
        &self,
        inbox: crate::InboxConfig,
        tasks: &handoff_core::Tasks,
        faults: Option<Arc<crate::FaultSwitch>>,
    ) -> std::io::Result<Agent> {
        // The inbox's token (the cluster's) also authenticates every tcp connection.
        let token = inbox.token.clone();
        let inbox = Arc::new(Inbox::new(inbox));
        let backend: Arc<dyn TransferBackend> = match self {
            TransferKind::Tcp { bind_ip, advertise_ip, tls, shared_memory } => {
                let l = tokio::net::TcpListener::bind((*bind_ip, 0)).await?;
                let (tls, shared_memory) = (tls.clone(), *shared_memory);
                let cfg = crate::tcp::TcpConfig { token, tls, shared_memory, ..Default::default() };
                Arc::new(crate::TcpTransfer::serve(
                    l,
                    advertise_ip.clone(),
                    inbox.clone(),
                    cfg,
                    tasks,
                )?)
            }
            TransferKind::Mooncake { bind_ip, advertise_ip } => {
                let rpc = tokio::net::TcpListener::bind((*bind_ip, 0)).await?;
                let data = tokio::net::TcpListener::bind((*bind_ip, 0)).await?;
                let cfg = crate::mooncake::MooncakeConfig { token, ..Default::default() };
                Arc::new(crate::mooncake::MooncakeTransfer::serve(
                    rpc,
                    data,
                    advertise_ip.clone(),
                    inbox.clone(),
                    cfg,
                    tasks,
                )?)
            }
            TransferKind::Nixl { bind_ip, advertise_ip } => {
                let control = tokio::net::TcpListener::bind((*bind_ip, 0)).await?;
                let cfg = crate::nixl::NixlConfig { token, ..Default::default() };
                let nixl = crate::nixl::NixlTransfer::serve(
                    control,
                    advertise_ip.clone(),
                    inbox.clone(),
                    cfg,
                    tasks,
                )
                .map_err(std::io::Error::other)?;
                Arc::new(nixl)
            }
            TransferKind::Fake(net) => Arc::new(crate::FakeTransfer::new(net, &inbox)),
        };
        let backend = match faults {
            Some(sw) => Arc::new(crate::FaultyTransfer::new(backend, sw)),
            None => backend,
        };
        Ok(Agent::new(backend, inbox))
    }
}
