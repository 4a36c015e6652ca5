//! [`Initiator`]: a client of Mooncake targets: handshakes (descriptor cached per peer),
//! notifications, and v2 writes over a few pooled lanes per peer.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures::future::try_join_all;
use serde::Serialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};
use tokio::sync::Semaphore;

use super::wire::{self, FrameType, Header, NotifyMsg, OP_V2, OP_WRITE, SegmentDesc, Status};
use super::{MooncakeConfig, SUCCESS};
use crate::idle::Idle;
use crate::{AgentAddr, TransferError};

/// Most peers whose descriptors are cached (the cache is cleared when it fills).
const MAX_PEERS: usize = 4096;

/// A data endpoint: (host, port).
type Endpoint = (String, u16);

/// A client of Mooncake targets (see the module docs).
pub struct Initiator {
    session: String,
    /// The address its connections leave from, when this host's own (see [`connect_from`]).
    source: Option<IpAddr>,
    cfg: MooncakeConfig,
    descriptors: Mutex<HashMap<AgentAddr, Arc<SegmentDesc>>>,
    /// Idle data connections, each kept half the idle timeout (a target closes one idle for
    /// all of it). Before, kept until the same endpoint was asked again: a decode that
    /// restarted (each start a new port) left its lanes open in CLOSE_WAIT for good.
    idle: Idle<TcpStream, Endpoint>,
    gates: Mutex<HashMap<Endpoint, Arc<Semaphore>>>,
    dials: AtomicU64,
}

impl std::fmt::Debug for Initiator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Initiator").field("session", &self.session).finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn io_err(peer: &AgentAddr, e: impl std::fmt::Display) -> TransferError {
    TransferError::Io { peer: peer.clone(), reason: e.to_string() }
}

impl Initiator {
    /// A client that names itself `session` in its requests, its connections leaving from
    /// `source` (see [`connect_from`]).
    pub(super) fn new(session: String, source: Option<IpAddr>, cfg: MooncakeConfig) -> Self {
        Initiator {
            session,
            source,
            descriptors: Mutex::default(),
            idle: Idle::new(cfg.lanes.clamp(1, 16), cfg.idle_timeout / 2),
            gates: Mutex::default(),
            dials: AtomicU64::new(0),
            cfg,
        }
    }

    /// Data connections opened so far (the rest were reused).
    pub fn dials(&self) -> u64 {
        self.dials.load(Ordering::Relaxed)
    }

    /// One handshake exchange with the segment at `peer`: a request frame, the reply's body.
    pub async fn exchange(
        &self,
        peer: &AgentAddr,
        t: FrameType,
        json: &[u8],
    ) -> Result<Vec<u8>, TransferError> {
        let run = async {
            let mut s = connect_from(self.source, &peer.ip, peer.port)
                .await
                .map_err(|e| io_err(peer, e))?;
            wire::write_frame(&mut s, t, json).await.map_err(|e| io_err(peer, e))?;
            let (got, body) = wire::read_frame(&mut s).await?;
            if got != t {
                return Err(TransferError::Malformed(format!(
                    "mooncake: reply of type {got:?} to {t:?}"
                )));
            }
            Ok(body)
        };
        tokio::time::timeout(self.cfg.handshake_timeout, run)
            .await
            .map_err(|_| TransferError::Timeout(format!("for the mooncake handshake of {peer}")))?
    }

    /// The descriptor of the segment at `peer` (cached; `fresh` asks again).
    pub async fn descriptor(
        &self,
        peer: &AgentAddr,
        fresh: bool,
    ) -> Result<Arc<SegmentDesc>, TransferError> {
        if !fresh && let Some(d) = lock(&self.descriptors).get(peer) {
            return Ok(d.clone());
        }
        // Our own descriptor is the request's body; the target ignores it, but it must parse.
        let me = SegmentDesc {
            buffers: Vec::new(),
            name: self.session.clone(),
            protocol: "tcp".into(),
            rdma_server_name: String::new(),
            tcp_data_host: None,
            tcp_data_port: 0,
            tcp_proto_version: 2,
            timestamp: String::new(),
        };
        let body = self.exchange(peer, FrameType::Metadata, &me.to_json()).await?;
        let d = Arc::new(SegmentDesc::parse(&body)?);
        let mut cache = lock(&self.descriptors);
        if cache.len() >= MAX_PEERS {
            cache.clear();
        }
        cache.insert(peer.clone(), d.clone());
        Ok(d)
    }

    /// Probes the segment at `peer` (as `send_probe` does).
    pub async fn probe(&self, peer: &AgentAddr) -> Result<(), TransferError> {
        self.exchange(peer, FrameType::Probe, b"{}\n").await.map(drop)
    }

    /// Sends `message` as a notification; the target must answer "success".
    pub(super) async fn notify<T: Serialize>(
        &self,
        peer: &AgentAddr,
        message: &T,
    ) -> Result<(), TransferError> {
        let text = serde_json::to_string(message)
            .map_err(|e| TransferError::Malformed(format!("notify: {e}")))?;
        let msg = NotifyMsg { name: self.session.clone(), notify_msg: text };
        let body = self.exchange(peer, FrameType::Notify, &wire::json_line(&msg)).await?;
        let reply: NotifyMsg = serde_json::from_slice(&body)
            .map_err(|e| TransferError::Malformed(format!("mooncake notify reply: {e}")))?;
        if reply.notify_msg == SUCCESS {
            Ok(())
        } else {
            Err(TransferError::Rejected(reply.notify_msg))
        }
    }

    /// Writes every `(bytes, offset)` pair at `base + offset` in the segment at `peer`,
    /// spread over its lanes, each write acked. Returns once every byte is applied there.
    pub async fn write(
        &self,
        peer: &AgentAddr,
        base: u64,
        pairs: &[(Bytes, u64)],
    ) -> Result<(), TransferError> {
        let d = self.descriptor(peer, false).await?;
        if d.tcp_proto_version < 2 {
            return Err(TransferError::Rejected(format!(
                "{peer} speaks Mooncake tcp v{} (writes unacked); v2 is required",
                d.tcp_proto_version
            )));
        }
        let host = d.tcp_data_host.clone().unwrap_or_else(|| peer.ip.clone());
        let endpoint: Endpoint = (host, d.tcp_data_port);
        let mut writes = Vec::with_capacity(pairs.len());
        for (b, off) in pairs.iter().filter(|(b, _)| !b.is_empty()) {
            let addr = base.checked_add(*off).ok_or_else(|| {
                TransferError::Malformed(format!("address {base:#x} + {off} overflows"))
            })?;
            writes.push((addr, b.clone()));
        }
        let lanes = self.cfg.lanes.clamp(1, 16).min(writes.len().max(1));
        let mut groups: Vec<Vec<(u64, Bytes)>> = vec![Vec::new(); lanes];
        for (i, w) in writes.into_iter().enumerate() {
            groups[i % lanes].push(w);
        }
        let lane = |g: Vec<(u64, Bytes)>| self.lane(peer, &endpoint, g);
        let done = try_join_all(groups.into_iter().map(lane)).await.map(drop);
        if done.is_err() {
            // The descriptor may be stale (a restarted peer): ask again next time.
            lock(&self.descriptors).remove(peer);
        }
        done
    }

    /// Sends one lane's writes in turn over one connection, each acked. At most `lanes`
    /// connections per endpoint are in use at once; a pooled connection that turns out dead
    /// on its first write is replaced once (a target counts a write only once all of it
    /// arrived, and the same write sent again takes the place of a first try it is still
    /// landing, so sending it again is safe).
    async fn lane(
        &self,
        peer: &AgentAddr,
        endpoint: &Endpoint,
        writes: Vec<(u64, Bytes)>,
    ) -> Result<(), TransferError> {
        if writes.is_empty() {
            return Ok(());
        }
        let gate = self.gate(endpoint);
        let _place = gate.acquire_owned().await.map_err(|e| io_err(peer, e))?;
        let (mut s, mut pooled) = match self.pooled(endpoint) {
            Some(s) => (s, true),
            None => (self.dial(peer, endpoint).await?, false),
        };
        for (addr, bytes) in &writes {
            let first = self.write_one(&mut s, peer, *addr, bytes).await;
            match first {
                Err(TransferError::Io { .. }) if pooled => {
                    s = self.dial(peer, endpoint).await?;
                    self.write_one(&mut s, peer, *addr, bytes).await?;
                }
                other => other?,
            }
            pooled = false;
        }
        self.checkin(endpoint, s);
        Ok(())
    }

    /// One v2 write on `s`, and its ack.
    async fn write_one(
        &self,
        s: &mut TcpStream,
        peer: &AgentAddr,
        addr: u64,
        bytes: &Bytes,
    ) -> Result<(), TransferError> {
        let h = Header { size: bytes.len() as u64, addr, opcode: OP_WRITE | OP_V2 };
        let one = async {
            s.write_all(&h.encode()).await?;
            s.write_all(bytes).await?;
            s.flush().await?;
            s.read_u64_le().await
        };
        let word = tokio::time::timeout(self.cfg.io_timeout, one)
            .await
            .map_err(|_| TransferError::Timeout(format!("for a mooncake write to {peer}")))?
            .map_err(|e| io_err(peer, e))?;
        match wire::status(word) {
            Status::Ok => Ok(()),
            Status::Rejected => Err(TransferError::Rejected(format!(
                "{peer} refused a write of {} bytes at {addr:#x}",
                h.size
            ))),
            Status::Unknown(w) => {
                Err(TransferError::Malformed(format!("mooncake: status {w:#x} from {peer}")))
            }
        }
    }

    /// The endpoint's gate: `lanes` places.
    fn gate(&self, endpoint: &Endpoint) -> Arc<Semaphore> {
        let mut gates = lock(&self.gates);
        if !gates.contains_key(endpoint) && gates.len() >= MAX_PEERS {
            gates.retain(|_, g| Arc::strong_count(g) > 1);
        }
        let lanes = self.cfg.lanes.clamp(1, 16);
        gates.entry(endpoint.clone()).or_insert_with(|| Arc::new(Semaphore::new(lanes))).clone()
    }

    /// An idle connection to `endpoint` that still looks alive.
    fn pooled(&self, endpoint: &Endpoint) -> Option<TcpStream> {
        self.idle.take(endpoint, |s| {
            // An idle connection must have nothing to read: data or EOF means it is stale.
            let mut probe = [0u8; 1];
            matches!(s.try_read(&mut probe), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
    }

    async fn dial(
        &self,
        peer: &AgentAddr,
        endpoint: &Endpoint,
    ) -> Result<TcpStream, TransferError> {
        self.dials.fetch_add(1, Ordering::Relaxed);
        let dial = connect_from(self.source, &endpoint.0, endpoint.1);
        let s = tokio::time::timeout(self.cfg.connect_timeout, dial)
            .await
            .map_err(|_| io_err(peer, "mooncake data connect timed out"))?
            .map_err(|e| io_err(peer, e))?;
        s.set_nodelay(true).map_err(|e| io_err(peer, e))?;
        Ok(s)
    }

    fn checkin(&self, endpoint: &Endpoint, s: TcpStream) {
        self.idle.put(endpoint, s);
    }
}

/// A connection to `host:port` leaving from `source` when given and of the same family and
/// scope (loopback to loopback, else beyond): a peer's target takes data and notices only from
/// the address its handshake named, so on a host with several addresses (or routes) the
/// kernel's choice of source would be refused. Unbound otherwise.
pub(super) async fn connect_from(
    source: Option<IpAddr>,
    host: &str,
    port: u16,
) -> std::io::Result<TcpStream> {
    let mut last = None;
    for to in tokio::net::lookup_host((host, port)).await? {
        let from = source.filter(|s| {
            s.is_ipv4() == to.is_ipv4() && s.is_loopback() == to.ip().to_canonical().is_loopback()
        });
        let socket = || if to.is_ipv4() { TcpSocket::new_v4() } else { TcpSocket::new_v6() };
        if let Some(ip) = from {
            // Bound, then (the address gone, no route from it) as the kernel chooses.
            let bound = socket()?;
            if bound.bind(SocketAddr::new(ip, 0)).is_ok()
                && let Ok(s) = bound.connect(to).await
            {
                return Ok(s);
            }
        }
        match socket()?.connect(to).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| std::io::Error::other(format!("{host} resolves to no address"))))
}
