//! The `mooncake` backend: Mooncake Transfer Engine's TCP wire, in Rust, compatible with the
//! wheel (`mooncake-transfer-engine` 0.3.13.post1) both ways.
//!
//! An agent listens twice, as a Mooncake P2P segment does: a handshake port (its address,
//! `host:port`, is the segment name and what directories publish) and a data port.
//!
//! - **As a target (receiver)**, it exposes open receive regions at synthetic addresses
//!   ([`exposure::Exposed`]) and applies v2 WRITEs into them through the verifying inbox.
//!   READ is refused. Only hosts it sent handshakes to may open data connections. The
//!   descriptor lists no buffers (TCP initiators do not read them).
//! - **As an initiator (sender)**, it fetches a target's descriptor (cached per peer), writes
//!   over a few pooled lanes per peer, each write acked (v2), and reconnects after a reject
//!   or an error.
//!
//! Between handoff agents, the handshake ([`crate::ConnectRequest`] plus the region's base
//! address) and the completion [`crate::Notice`] travel as Mooncake `Notify` frames on the
//! handshake port, so the inbox verifies a mooncake transfer as it does a tcp one. The wire
//! has no authentication and no TLS: a write is tied to its sender by the shard plan (its
//! offset) and to the sending host by address ([`peer_conn`]), and the cluster token rides
//! only in the handshake and the notice. `docs/security.md` states what that leaves open.

pub mod exposure;
mod initiator;
mod target;
pub mod wire;

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use handoff_core::Tasks;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;

use crate::{
    AgentAddr, ConnId, ConnectRequest, Inbox, Notice, RegionId, TransferBackend, TransferError,
    WriteRequest,
};
use exposure::{Exposed, Remotes};

/// Settings of the mooncake backend.
#[derive(Debug, Clone)]
pub struct MooncakeConfig {
    /// Time to establish a connection (handshake or data).
    pub connect_timeout: Duration,
    /// Time for one handshake exchange, either side (the wheel allows 5 s).
    pub handshake_timeout: Duration,
    /// Time for one write's body and ack (the wheel's status timeout is 30 s).
    pub io_timeout: Duration,
    /// Data connections in use at once per peer, by all writes together (the wheel's lanes;
    /// default 4, at most 16).
    pub lanes: usize,
    /// Inbound connections served at once, per listener.
    pub max_inbound: usize,
    /// How long an inbound connection may go without showing the token before a newer one,
    /// with every place held, may take its place (see `listen.rs`).
    pub unproven_grace: Duration,
    /// An inbound data connection with no request begun for this long is closed.
    pub idle_timeout: Duration,
    /// The cluster's token: sent in handshakes and notices, required of them.
    pub token: Option<String>,
}

impl Default for MooncakeConfig {
    fn default() -> Self {
        MooncakeConfig {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            lanes: 4,
            max_inbound: 1024,
            unproven_grace: Duration::from_secs(1),
            idle_timeout: Duration::from_secs(120),
            token: None,
        }
    }
}

/// What handoff agents say to each other in `Notify` frames.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "handoff", rename_all = "snake_case")]
enum Control {
    /// Receiver to sender: where a room's KV must land, and where the region starts.
    Connect { req: ConnectRequest, base: u64 },
    /// Sender to receiver: a sender's completion notice.
    Notice { region: RegionId, notice: Notice, token: Option<String> },
}

/// The notify reply that means "done".
const SUCCESS: &str = "success";

/// The connection identity of everything from host `ip`: Mooncake's wire has no sessions,
/// so a region's sender is bound to the host that first wrote for it.
pub fn peer_conn(ip: IpAddr) -> ConnId {
    let bytes = match ip.to_canonical() {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    };
    ConnId(xxhash_rust::xxh3::xxh3_64(&bytes) | 1 << 63)
}

struct Shared {
    inbox: Arc<Inbox>,
    exposed: Exposed,
    remotes: Remotes,
    /// `host:port` of the handshake listener: the segment name.
    session: String,
    data_host: String,
    data_port: u16,
    cfg: MooncakeConfig,
    /// The descriptor's JSON, made once.
    descriptor: Vec<u8>,
}

/// The mooncake backend (see the module docs).
pub struct MooncakeTransfer {
    addr: AgentAddr,
    shared: Arc<Shared>,
    client: initiator::Initiator,
}

impl std::fmt::Debug for MooncakeTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MooncakeTransfer")
            .field("session", &self.shared.session)
            .field("data_port", &self.shared.data_port)
            .finish_non_exhaustive()
    }
}

impl MooncakeTransfer {
    /// Serves the handshake listener `rpc` and the data listener `data` into `inbox` on
    /// `tasks` until they shut down. `advertise_ip` is the host peers dial (defaults to the
    /// listeners').
    pub fn serve(
        rpc: TcpListener,
        data: TcpListener,
        advertise_ip: Option<String>,
        inbox: Arc<Inbox>,
        cfg: MooncakeConfig,
        tasks: &Tasks,
    ) -> std::io::Result<Self> {
        let (r, d): (SocketAddr, SocketAddr) = (rpc.local_addr()?, data.local_addr()?);
        let host = advertise_ip.unwrap_or_else(|| r.ip().to_string());
        let addr = AgentAddr { ip: host.clone(), port: r.port() };
        let mut shared = Shared {
            inbox,
            exposed: Exposed::default(),
            remotes: Remotes::default(),
            session: addr.to_string(),
            data_host: host,
            data_port: d.port(),
            cfg: cfg.clone(),
            descriptor: Vec::new(),
        };
        shared.descriptor = target::descriptor(&shared).to_json();
        let shared = Arc::new(shared);
        target::serve(rpc, data, shared.clone(), tasks);
        // Connections leave from the advertised address when it is an IP on one of this
        // host's interfaces, so a peer's target (which takes data only from the address a
        // handshake named) finds them from it on a host with several.
        let bare = shared.data_host.trim_start_matches('[').trim_end_matches(']');
        let source =
            bare.parse::<IpAddr>().ok().filter(|ip| !ip.is_unspecified() && on_this_host(*ip));
        let client = initiator::Initiator::new(shared.session.clone(), source, cfg);
        Ok(MooncakeTransfer { addr, shared, client })
    }

    /// The segment name (`host:port` of the handshake listener), as Mooncake peers name it.
    pub fn session(&self) -> &str {
        &self.shared.session
    }

    /// Stops exposing region `id`, given up before its writes came: until `until` they are
    /// taken and dropped, not refused (see [`exposure::Exposed::retire`]).
    pub fn retire(&self, id: RegionId, until: tokio::time::Instant) {
        self.shared.exposed.retire(id, until);
    }

    /// Exposes open region `id` to writes from `peers`, and returns its base address (for
    /// protocols that hand the address over themselves, as SGLang's does).
    pub fn expose(&self, id: RegionId, peers: &[IpAddr]) -> Result<u64, TransferError> {
        peers.iter().for_each(|ip| self.shared.exposed.allow(*ip));
        self.shared.exposed.expose(&self.shared.inbox, id)
    }

    /// Maps `[start, start + len)` onto open region `id` from `offset`, writable by `peers`
    /// (for protocols that choose the addresses, as SGLang's page pools do).
    pub fn map(
        &self,
        id: RegionId,
        start: u64,
        len: u64,
        offset: u64,
        peers: &[IpAddr],
    ) -> Result<(), TransferError> {
        peers.iter().for_each(|ip| self.shared.exposed.allow(*ip));
        self.shared.exposed.map(&self.shared.inbox, id, start, len, offset)
    }

    /// Stops exposing region `id`.
    pub fn withdraw(&self, id: RegionId) {
        self.shared.exposed.withdraw(id);
    }

    /// The inbox its writes land in.
    pub fn inbox(&self) -> &Arc<Inbox> {
        &self.shared.inbox
    }

    /// A client of other Mooncake targets (the wheel's, or another agent's).
    pub fn initiator(&self) -> &initiator::Initiator {
        &self.client
    }
}

/// Whether `ip` is an address of one of this host's interfaces (not merely bindable: with
/// `ip_nonlocal_bind` any address binds, and packets from one not the host's never return),
/// or a loopback address (all of them are the host's).
fn on_this_host(ip: IpAddr) -> bool {
    if ip.to_canonical().is_loopback() {
        return true;
    }
    let Ok(all) = nix::ifaddrs::getifaddrs() else { return false };
    all.filter_map(|i| i.address).any(|a| {
        let found = match (a.as_sockaddr_in(), a.as_sockaddr_in6()) {
            (Some(v4), _) => IpAddr::V4(v4.ip()),
            (_, Some(v6)) => IpAddr::V6(v6.ip()),
            _ => return false,
        };
        found.to_canonical() == ip.to_canonical()
    })
}

/// The addresses `host` stands for (an IP, or a name resolved now).
pub async fn resolve(host: &str) -> Vec<IpAddr> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return vec![ip];
    }
    match tokio::net::lookup_host((host, 0)).await {
        Ok(addrs) => addrs.map(|a| a.ip()).collect(),
        Err(_) => Vec::new(),
    }
}

#[async_trait]
impl TransferBackend for MooncakeTransfer {
    fn name(&self) -> &'static str {
        "mooncake"
    }

    fn local_addr(&self) -> AgentAddr {
        self.addr.clone()
    }

    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        let region = req.region;
        let base = self.expose(region, &resolve(&peer.ip).await)?;
        let sent = self.client.notify(peer, &Control::Connect { req, base }).await;
        if sent.is_err() {
            self.shared.exposed.withdraw(region);
        }
        sent
    }

    /// Writes land by the peer's address, whatever the connection (see `peer_conn`).
    fn posts_parts(&self) -> bool {
        true
    }

    async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError> {
        let Some(base) = self.shared.remotes.base(req.region) else {
            return Err(TransferError::Failed(format!(
                "no mooncake handshake for region {:?} from {peer}",
                req.region
            )));
        };
        self.client.write(peer, base, &req.pairs).await?;
        let Some(notice) = req.notice else { return Ok(()) };
        let token = self.shared.cfg.token.clone();
        self.client.notify(peer, &Control::Notice { region: req.region, notice, token }).await
    }
}

#[cfg(test)]
mod tests;
