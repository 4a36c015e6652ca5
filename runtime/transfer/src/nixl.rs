//! The `nixl` backend: KV bytes move as NIXL WRITEs (UCX underneath; over TCP on a machine
//! without RDMA), through NIXL's C API (`libnixl_capi.so` from the pinned `nixl-cu13` wheel,
//! loaded at run time by `nixl-sys`). UCX's wire is its own: nothing here speaks it.
//!
//! Every process runs one NIXL agent, and a control listener (the address directories
//! publish) for what NIXL does not carry ([`control`]):
//!
//! - **Handshake (receiver to sender).** The receiver lends the region a zeroed slot of its
//!   size from its staging arena (registered once, for the agent's life; [`staging`]), shared
//!   by the region's senders, and sends each sender the [`crate::ConnectRequest`], the slot's
//!   address, a ticket of its own, its agent's introduction (UCX address, no memory) and the
//!   arena's metadata. The sender checks the token, loads both and records where the region
//!   lands.
//! - **Write (sender).** The sender copies the pairs into one registered source buffer and
//!   WRITEs every segment into the slot. NIXL reports success once the bytes are complete at
//!   the receiver (it flushes the endpoint). A streamed write's parts go as WRITEs of their
//!   own as they are computed.
//! - **Notice (sender to receiver).** Then the sender sends its [`crate::Notice`], its ticket
//!   and the list of segments it wrote over the control wire. The receiver copies the listed
//!   segments of the slot into the region through the inbox and verifies the notice exactly
//!   as for tcp: every byte of the sender's ranges once, the room, the checksum. Its verdict
//!   is the answer. The slot goes back when every ticket is redeemed, or, when the region
//!   closed first, after resting long enough for late WRITEs to have landed.
//!
//! Why one arena: NIXL keeps, for every peer, each memory range that peer's metadata ever
//! named. Buffers registered per handshake and freed come back from the allocator overlapping
//! old ranges, and NIXL then refuses transfers into them (seen: a request in 15 failed so).
//!
//! NIXL over UCX/TCP has no authentication, its metadata names registered memory by raw
//! address, and UCX's software RMA over TCP writes wherever a peer says, registered or not
//! (tested: a WRITE with a key already deregistered still lands). So a peer that reaches the
//! agent can write this process's memory; keys protect nothing here. What the backend adds is
//! verification: a sender's bytes are taken only at the segments its notice lists, and checked
//! as for tcp. `docs/security.md` says what that leaves open.

mod control;
mod engine;
mod memory;
mod pool;
mod reader;
mod serve;
mod staging;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use handoff_core::{Room, Tasks};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::inbox::lock;
use crate::{
    AgentAddr, ConnectRequest, Inbox, RegionId, TransferBackend, TransferError, WriteRequest,
};
use control::Control;
use engine::{Engine, Segment};
use pool::Pool;
pub use reader::NixlReader;
use staging::Staging;

/// Settings of the nixl backend.
#[derive(Debug, Clone)]
pub struct NixlConfig {
    /// Time for one control exchange (handshake or notice), connection included.
    pub control_timeout: Duration,
    /// Time for one write's bytes to complete at the receiver.
    pub io_timeout: Duration,
    /// The agent's progress thread waits on UCX's event fd and wakes at least this often
    /// (whole milliseconds); idle, that is all it costs.
    pub progress_delay: Duration,
    /// Inbound control connections served at once.
    pub max_inbound: usize,
    /// How long an inbound connection may go without showing the token before a newer one,
    /// with every place held, may take its place (see `listen.rs`).
    pub unproven_grace: Duration,
    /// Open handshakes, either side, before new ones are refused (closed regions' entries
    /// are swept first).
    pub max_open: usize,
    /// A sender forgets a handshake whose write never came after this long, and writes for
    /// none older (the receiver rests a closed region's slot this long and more).
    pub handshake_ttl: Duration,
    /// The cluster's token: sent in handshakes and notices, required of them.
    pub token: Option<String>,
    /// Receive staging memory, registered once: the most KV this agent receives at once.
    pub staging_bytes: usize,
    /// Send sources kept for reuse between transfers (unregistered)...
    pub pool_buffers: usize,
    /// ... and their bytes at most.
    pub pool_bytes: usize,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            control_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(30),
            progress_delay: Duration::from_millis(10),
            max_inbound: 1024,
            unproven_grace: Duration::from_secs(1),
            max_open: 4096,
            handshake_ttl: Duration::from_secs(120),
            token: None,
            staging_bytes: 1 << 30,
            pool_buffers: 16,
            pool_bytes: 512 << 20,
        }
    }
}

/// Where a region's KV lands at its receiver (sender side).
#[derive(Debug)]
struct Remote {
    /// The room it is for: closed (its request ended), it is swept with the stale ones.
    room: Room,
    agent: String,
    addr: u64,
    len: u64,
    /// The receiver's ticket for this sender: its notice carries it.
    ticket: u64,
    since: Instant,
    /// (offset, length) of every segment written so far: the notice lists them all.
    written: Vec<(u64, u64)>,
}

struct Shared {
    inbox: Arc<Inbox>,
    engine: Engine,
    addr: AgentAddr,
    cfg: NixlConfig,
    /// Receiving side: the staging memory and the slots lent to open handshakes.
    staging: Staging,
    /// What every handshake carries and never changes: the agent's introduction and the
    /// staging arena's metadata (its key, not the agent's address), hex-encoded once.
    handshake_hex: (String, String),
    /// Sending side: where each handshaken region lands.
    remotes: Mutex<HashMap<RegionId, Remote>>,
    /// Sending side: peers whose metadata is loaded, by the xxh3 of their introduction and
    /// arena metadata (a receiver sends the same every time): its agent name and last use.
    loaded: Mutex<HashMap<u64, (String, Instant)>>,
    /// Staging and source memory between uses.
    pool: Pool,
}

/// The nixl backend (see the module docs).
pub struct NixlTransfer {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for NixlTransfer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransfer")
            .field("addr", &self.shared.addr)
            .field("agent", &self.shared.engine.name())
            .finish_non_exhaustive()
    }
}

impl NixlTransfer {
    /// Starts this process's NIXL agent and serves the control listener `control` into
    /// `inbox` on `tasks` until they shut down. `advertise_ip` is the host peers dial
    /// (defaults to the listener's). Fails, saying what to install, when NIXL's library is
    /// not found.
    pub fn serve(
        control: TcpListener,
        advertise_ip: Option<String>,
        inbox: Arc<Inbox>,
        cfg: NixlConfig,
        tasks: &Tasks,
    ) -> Result<Self, TransferError> {
        let local: SocketAddr = control
            .local_addr()
            .map_err(|e| TransferError::Failed(format!("nixl control listener: {e}")))?;
        let addr = AgentAddr {
            ip: advertise_ip.unwrap_or_else(|| local.ip().to_string()),
            port: local.port(),
        };
        let name = format!("handoff-{addr}-{:016x}", rand::random::<u64>());
        let engine = Engine::start(&name, cfg.progress_delay)?;
        let arena = engine.arena(cfg.staging_bytes)?;
        let handshake_hex = (
            control::hex(engine.introduction()),
            control::hex(&engine.metadata_of(arena.registered())?),
        );
        // A late WRITE may still land until the sender's own deadlines pass: a sender writes
        // for a handshake at most `handshake_ttl` old, each write within `io_timeout`.
        let rest = cfg.handshake_ttl + cfg.io_timeout + cfg.control_timeout;
        let shared = Arc::new(Shared {
            inbox,
            engine,
            addr,
            staging: Staging::new(arena, rest, cfg.max_open),
            handshake_hex,
            remotes: Mutex::default(),
            loaded: Mutex::default(),
            pool: Pool::new(cfg.pool_buffers, cfg.pool_bytes),
            cfg,
        });
        let s = shared.clone();
        let max =
            crate::listen::Places { max: shared.cfg.max_inbound, grace: shared.cfg.unproven_grace };
        crate::listen::serve_accepts(
            control,
            max,
            tasks,
            "nixl control",
            move |st, peer, _, at| {
                let s = s.clone();
                async move { serve::serve_control(st, peer, s, &at).await }
            },
        );
        Ok(NixlTransfer { shared })
    }

    /// This process's NIXL agent name.
    pub fn agent_name(&self) -> &str {
        self.shared.engine.name()
    }

    /// Staging slots lent to open handshakes (receiver side).
    pub fn open_staging(&self) -> usize {
        self.shared.staging.regions()
    }
}

#[async_trait]
impl TransferBackend for NixlTransfer {
    fn name(&self) -> &'static str {
        "nixl"
    }

    fn local_addr(&self) -> AgentAddr {
        self.shared.addr.clone()
    }

    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        let s = &self.shared;
        let region = req.region;
        let len = usize::try_from(req.region_len)
            .map_err(|_| TransferError::Malformed("region too large".into()))?;
        let inbox = &s.inbox;
        let (addr, ticket) =
            s.staging.lend(region, len, Instant::now(), |id| inbox.open_now(id))?;
        let msg = Control::Connect {
            req,
            introduction: s.handshake_hex.0.clone(),
            metadata: s.handshake_hex.1.clone(),
            addr,
            ticket,
        };
        let sent = control::call(peer, &msg, s.cfg.control_timeout).await;
        if sent.is_err() {
            s.staging.cancel(region, ticket, Instant::now());
        }
        sent
    }

    /// A streamed write's parts go as WRITEs of their own, each into the staging slot its
    /// handshake lent this sender; the notice at the end lists every part's segments.
    fn posts_parts(&self) -> bool {
        true
    }

    async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError> {
        let s = &self.shared;
        let remote = {
            let mut remotes = lock(&s.remotes);
            // Past its lifetime a handshake's slot may be lent to another request.
            if remotes.get(&req.region).is_some_and(|r| r.since.elapsed() > s.cfg.handshake_ttl) {
                remotes.remove(&req.region);
            }
            remotes.get(&req.region).map(|r| (r.agent.clone(), r.addr, r.len))
        };
        let Some((agent, base, len)) = remote else {
            return Err(TransferError::Failed(format!(
                "no nixl handshake for region {:?} from {peer}",
                req.region
            )));
        };
        let total: usize = req.pairs.iter().map(|(b, _)| b.len()).sum();
        let mut source = s.pool.take(total, false);
        let Gathered { segments, listed } = gather(&req, base, len, source.bytes_mut())?;
        if !segments.is_empty() {
            let src = s.engine.register(source)?;
            let shared = self.shared.clone();
            let deadline = std::time::Instant::now() + s.cfg.io_timeout;
            let peer_agent = agent.clone();
            let written = tokio::task::spawn_blocking(move || {
                let src = shared.engine.write(src, &segments, &agent, deadline)?;
                if let Some(settled) = src.settle() {
                    shared.pool.give(settled.into_pinned());
                }
                Ok::<(), TransferError>(())
            })
            .await
            .map_err(|e| TransferError::Failed(format!("nixl write task: {e}")))?;
            if let Err(e) = written {
                lock(&s.remotes).remove(&req.region);
                // NIXL drops a peer it lost the connection to: load it afresh next time.
                lock(&s.loaded).retain(|_, (name, _)| *name != peer_agent);
                return Err(e);
            }
        } else {
            s.pool.give(source);
        }
        let written = {
            let mut remotes = lock(&s.remotes);
            let Some(notice) = req.notice else {
                if let Some(r) = remotes.get_mut(&req.region) {
                    r.written.extend(listed);
                }
                return Ok(());
            };
            let Some(remote) = remotes.remove(&req.region) else {
                return Err(TransferError::Failed(format!(
                    "no nixl handshake for region {:?} from {peer}",
                    req.region
                )));
            };
            let mut all = remote.written;
            all.extend(listed);
            (notice, remote.ticket, all)
        };
        let (notice, ticket, segments) = written;
        let msg = Control::Notice {
            region: req.region,
            ticket,
            notice,
            segments,
            token: s.cfg.token.clone(),
        };
        control::call(peer, &msg, s.cfg.control_timeout).await
    }
}

/// A write's pairs, gathered for one WRITE.
struct Gathered {
    /// Each pair's segment: where in the source buffer, where at the receiver.
    segments: Vec<Segment>,
    /// Each pair's (offset, length) in the region, as the notice lists them.
    listed: Vec<(u64, u64)>,
}

/// Gathers `req`'s pairs, one after the other, into `source` (at least their total length),
/// for a region of `region_len` bytes at `base`. Empty pairs are skipped; a pair outside the
/// region is refused.
fn gather(
    req: &WriteRequest,
    base: u64,
    region_len: u64,
    source: &mut [u8],
) -> Result<Gathered, TransferError> {
    let mut at = 0;
    let mut segments = Vec::with_capacity(req.pairs.len());
    let mut listed = Vec::with_capacity(req.pairs.len());
    for (bytes, off) in req.pairs.iter().filter(|(b, _)| !b.is_empty()) {
        let len = bytes.len() as u64;
        if off.checked_add(len).is_none_or(|end| end > region_len) {
            return Err(TransferError::Malformed(format!(
                "write [{off}, +{len}) outside the {region_len}-byte region"
            )));
        }
        let dst = base.checked_add(*off).ok_or_else(|| {
            TransferError::Malformed(format!("receiver address {base:#x} + {off} overflows"))
        })?;
        segments.push(Segment { src: at, dst, len: bytes.len() });
        listed.push((*off, len));
        source[at..at + bytes.len()].copy_from_slice(bytes);
        at += bytes.len();
    }
    Ok(Gathered { segments, listed })
}

#[cfg(test)]
mod tests;
