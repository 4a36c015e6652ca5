//! The `tcp` backend: real bytes over TCP. Each agent listens on its own port (the rank port
//! a directory publishes); senders keep a pool of connections per peer and run one exchange
//! at a time on a connection (frames, then the peer's ack). A connection that breaks or
//! sends a malformed frame is closed, and every region it was filling is failed.
//!
//! With a token configured, every connection's first frame is a hello carrying it; until
//! then nothing else is accepted, and no frame larger than a hello is read. A connection
//! that writes over another's binding, or keeps writing to regions that do not exist (a
//! peer guessing ids), is closed; the regions it named are not touched.

mod pool;
mod receive;
mod serve;
mod shm;
mod stream;
mod wire;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use handoff_core::Tasks;
use handoff_core::tls::{Alpn, ClusterTls, ListenerTls, Rechecked};
use tokio::io::{AsyncRead, AsyncWriteExt, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tracing::debug;

use crate::listen::Places;
use crate::{AgentAddr, ConnectRequest, Inbox, TransferBackend, TransferError, WriteRequest};
pub use serve::apply_frames;

use crate::idle::Idle;
use pool::{ClientIo, io_err, read_ack, reusable};
use serve::{ConnCfg, Inbound, serve_conn};
use shm::ShmPool;

/// How long an idle pooled connection gets to answer a handshake before a fresh one is tried.
const POOLED_ACK_TIMEOUT: Duration = Duration::from_secs(1);

/// Settings of the tcp backend.
#[derive(Debug, Clone)]
pub struct TcpConfig {
    /// Largest frame accepted or sent. A write's segments are up to [`crate::MAX_SEGMENT`]
    /// bytes (16 MiB) each, and one that does not fit a frame of its own is refused before it
    /// is sent (`Malformed`): below 16 MiB and 29 bytes, long writes fail.
    pub max_frame: usize,
    /// Time to establish a connection.
    pub connect_timeout: Duration,
    /// Time for one exchange (a handshake, or a whole write and its ack).
    pub io_timeout: Duration,
    /// Idle connections kept per peer.
    pub max_idle_per_peer: usize,
    /// Inbound connections served at once.
    pub max_inbound: usize,
    /// How long an inbound connection may go without showing the token before a newer one,
    /// with every place held, may take its place (see `listen.rs`).
    pub unproven_grace: Duration,
    /// When set, connections authenticate with it in their first frame, both ways: this
    /// agent requires it of inbound connections and sends it on the ones it dials.
    pub token: Option<String>,
    /// Writes to unknown regions a connection may send in a row (no accepted write between)
    /// before it is closed: a sender can legitimately trail a region its receiver gave up on;
    /// a peer guessing ids cannot.
    pub max_unknown_writes: u32,
    /// An inbound connection with no frame begun for this long is closed; a connection this
    /// agent dialed waits in its pool at most half as long (peers configured alike close it
    /// at the whole).
    pub idle_timeout: Duration,
    /// An inbound frame must arrive whole within this long once begun (a peer trickling
    /// bytes is cut off).
    pub frame_timeout: Duration,
    /// With a token, a connection must begin its hello within this long of being accepted
    /// (with TLS, its handshake too).
    pub hello_timeout: Duration,
    /// Mutual TLS with the cluster's CA, on every connection both ways.
    pub tls: Option<ClusterTls>,
    /// Writes to a peer on the same host go through shared memory ([`shm`]), and this agent
    /// listens for such writes. Off: every byte over the socket. Off as well with `tls`: an
    /// agent with TLS sends and takes every byte over TLS.
    pub shared_memory: bool,
}

impl Default for TcpConfig {
    fn default() -> Self {
        TcpConfig {
            max_frame: 64 << 20,
            connect_timeout: Duration::from_secs(5),
            io_timeout: Duration::from_secs(60),
            max_idle_per_peer: 32,
            max_inbound: 1024,
            unproven_grace: Duration::from_secs(1),
            token: None,
            max_unknown_writes: 64,
            idle_timeout: Duration::from_secs(120),
            frame_timeout: Duration::from_secs(30),
            hello_timeout: Duration::from_secs(5),
            tls: None,
            shared_memory: true,
        }
    }
}

/// A tcp agent (see the module docs).
#[derive(Debug)]
pub struct TcpTransfer {
    addr: AgentAddr,
    cfg: TcpConfig,
    idle: Arc<Idle<Box<dyn ClientIo>>>,
    /// The same-host fast path, when on.
    shm: Option<Arc<ShmPool>>,
}

impl TcpTransfer {
    /// Serves `listener` into `inbox` on `tasks` until they shut down. `advertise_ip` is the
    /// IP peers should dial (defaults to the listener's).
    pub fn serve(
        listener: TcpListener,
        advertise_ip: Option<String>,
        inbox: Arc<Inbox>,
        cfg: TcpConfig,
        tasks: &Tasks,
    ) -> std::io::Result<Self> {
        let local = listener.local_addr()?;
        let addr = AgentAddr {
            ip: advertise_ip.unwrap_or_else(|| local.ip().to_string()),
            port: local.port(),
        };
        let conn_cfg = Arc::new(ConnCfg {
            max_frame: cfg.max_frame,
            token: cfg.token.clone(),
            max_unknown_writes: cfg.max_unknown_writes,
            idle_timeout: cfg.idle_timeout,
            frame_timeout: cfg.frame_timeout,
            hello_timeout: cfg.hello_timeout,
        });
        let server_tls = cfg.tls.clone().map(ListenerTls::Cluster);
        let places = Places { max: cfg.max_inbound, grace: cfg.unproven_grace };
        let shared_memory = cfg.shared_memory && cfg.tls.is_none();
        if shared_memory {
            // As many places as tcp's: senders pool up to `max_idle_per_peer` connections
            // each, and a listener out of places leaves a dialing sender waiting for its
            // hello's answer (a second, then tcp) on every write.
            shm::serve(&addr, inbox.clone(), conn_cfg.clone(), places, tasks);
        }
        crate::listen::serve_accepts(
            listener,
            places,
            tasks,
            "tcp transfer",
            move |stream, peer, conn, place| {
                let (inbox, cc, tls) = (inbox.clone(), conn_cfg.clone(), server_tls.clone());
                async move {
                    let peer = peer.to_string();
                    let place = Some(&place);
                    let inbound =
                        Inbound { peer: &peer, id: conn, authed: false, window: None, place };
                    let Some(tls) = tls else {
                        return serve_conn(stream, inbound, inbox, &cc).await;
                    };
                    // The TLS handshake is part of the hello's time. The sender is checked
                    // again after each change of the CA file for as long as its connection
                    // stays up.
                    let (shake, check) = tls.accept(stream, Alpn::Unused, &peer);
                    match tokio::time::timeout(cc.hello_timeout, shake).await {
                        Ok(Ok(s)) => {
                            serve_conn(Rechecked::new(s, check), inbound, inbox, &cc).await
                        }
                        Ok(Err(e)) => debug!(%peer, error = %e, "TLS handshake refused"),
                        Err(_) => debug!(%peer, "TLS handshake too slow"),
                    }
                }
            },
        );
        // A dialed connection waits idle at most half the time after which receivers
        // configured alike close it (`idle_timeout`), so it is not taken as it is closed.
        let idle_for = cfg.idle_timeout / 2;
        let shm = shared_memory.then(|| {
            let (token, max_idle) = (cfg.token.clone(), cfg.max_idle_per_peer);
            let (max_frame, connect) = (cfg.max_frame, cfg.connect_timeout);
            Arc::new(ShmPool::new(token, max_idle, idle_for, max_frame, connect))
        });
        let idle = Arc::new(Idle::new(cfg.max_idle_per_peer, idle_for));
        Ok(TcpTransfer { addr, cfg, idle, shm })
    }

    /// Binds `bind` and serves it (see [`TcpTransfer::serve`]).
    pub async fn bind(
        bind: SocketAddr,
        inbox: Arc<Inbox>,
        cfg: TcpConfig,
        tasks: &Tasks,
    ) -> std::io::Result<Self> {
        Self::serve(TcpListener::bind(bind).await?, None, inbox, cfg, tasks)
    }

    fn io_err(peer: &AgentAddr, e: impl std::fmt::Display) -> TransferError {
        io_err(peer, e)
    }

    async fn checkout(&self, peer: &AgentAddr) -> Result<Box<dyn ClientIo>, TransferError> {
        match self.pooled(peer) {
            Some(s) => Ok(s),
            None => self.dial(peer).await,
        }
    }

    /// An idle connection to `peer` that still looks alive, if any.
    fn pooled(&self, peer: &AgentAddr) -> Option<Box<dyn ClientIo>> {
        // An idle connection must have nothing to read: data or EOF means it is stale (a
        // byte taken from under TLS here only ever belongs to a connection thrown away). Its
        // peer must still be trusted, after a reload of the cluster's CA (else a dial gives
        // the refusal its handshake's error).
        self.idle.take(peer, |s| {
            if !s.trusted() {
                return false;
            }
            let mut probe = [0u8; 1];
            let idle = s.socket().try_read(&mut probe);
            matches!(idle, Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
        })
    }

    /// A new connection to `peer`, authenticated when the agent has a token.
    async fn dial(&self, peer: &AgentAddr) -> Result<Box<dyn ClientIo>, TransferError> {
        let unreachable =
            |reason: String| TransferError::Unreachable { peer: peer.clone(), reason };
        // A name that does not resolve (yet: a new pod's DNS) is the peer's side, as a
        // refused connect is.
        let lookup = tokio::net::lookup_host((peer.ip.as_str(), peer.port));
        let addrs: Vec<std::net::SocketAddr> =
            tokio::time::timeout(self.cfg.connect_timeout, lookup)
                .await
                .map_err(|_| unreachable("name lookup timed out".into()))?
                .map_err(|e| unreachable(format!("name lookup: {e}")))?
                .collect();
        let dial = TcpStream::connect(&addrs[..]);
        let s = tokio::time::timeout(self.cfg.connect_timeout, dial)
            .await
            .map_err(|_| unreachable("connect timed out".into()))?
            .map_err(|e| {
                use std::io::ErrorKind::*;
                match e.kind() {
                    ConnectionRefused | HostUnreachable | NetworkUnreachable | TimedOut => {
                        unreachable(e.to_string())
                    }
                    _ => Self::io_err(peer, e),
                }
            })?;
        s.set_nodelay(true).map_err(|e| Self::io_err(peer, e))?;
        let mut s: Box<dyn ClientIo> = match &self.cfg.tls {
            None => Box::new(s),
            Some(tls) => {
                let name = handoff_core::tls::server_name(&peer.ip)
                    .map_err(|e| TransferError::Malformed(e.to_string()))?;
                let shake = tls.connect(name, peer, s, Alpn::Unused, self.cfg.connect_timeout);
                Box::new(shake.await.map_err(|e| {
                    if e.kind() == std::io::ErrorKind::TimedOut {
                        return Self::io_err(peer, "TLS handshake timed out");
                    }
                    // The peer's certificate refused here (renewed without the name it
                    // advertises, expired, another CA's) is the peer's side, as a refused
                    // connect is: a receiver's bad certificate must not count against the
                    // prefill sending to it.
                    if handoff_core::tls::refused_peer_certificate(&e) {
                        unreachable(format!("TLS: its certificate was refused: {e}"))
                    } else {
                        Self::io_err(peer, format!("TLS: {e}"))
                    }
                })?)
            }
        };
        if let Some(token) = &self.cfg.token {
            let hello = async {
                wire::write_hello(&mut s, token).await.map_err(|e| Self::io_err(peer, e))?;
                self.read_ack(peer, &mut s).await
            };
            tokio::time::timeout(self.cfg.connect_timeout, hello)
                .await
                .map_err(|_| Self::io_err(peer, "hello timed out"))??;
        }
        Ok(s)
    }

    /// Sends `req` over `s` and reads its ack within `within`; `s` goes back to the pool
    /// when the exchange completed.
    async fn handshake(
        &self,
        peer: &AgentAddr,
        mut s: Box<dyn ClientIo>,
        req: &ConnectRequest,
        within: Duration,
    ) -> Result<(), TransferError> {
        let exchange = async {
            wire::write_connect(&mut s, req).await.map_err(|e| Self::io_err(peer, e))?;
            self.read_ack(peer, &mut s).await
        };
        let res = tokio::time::timeout(within, exchange)
            .await
            .map_err(|_| TransferError::Timeout(format!("handshake with {peer}")))?;
        if reusable(&res) {
            self.idle.put(peer, s);
        }
        res
    }

    async fn read_ack<S: AsyncRead + Unpin>(
        &self,
        peer: &AgentAddr,
        s: &mut S,
    ) -> Result<(), TransferError> {
        read_ack(peer, s, self.cfg.max_frame).await
    }
}

#[async_trait]
impl TransferBackend for TcpTransfer {
    fn name(&self) -> &'static str {
        "tcp"
    }

    fn local_addr(&self) -> AgentAddr {
        self.addr.clone()
    }

    /// A tcp handshake is its request alone; TLS and shared memory change nothing in it.
    fn handshake_in_call(&self) -> bool {
        true
    }

    async fn connect(&self, peer: &AgentAddr, req: ConnectRequest) -> Result<(), TransferError> {
        // An idle connection gets a short leash: one the network lost (a partition, a peer
        // gone without a FIN) would otherwise hold the handshake for the whole I/O timeout.
        // One that broke (an I/O error: the request did not get through) is replaced by a
        // fresh connection; one that did not answer in time fails the handshake, which is not
        // sent again: the peer may have taken it, and a second copy would be a second sender.
        if let Some(s) = self.pooled(peer) {
            match self.handshake(peer, s, &req, POOLED_ACK_TIMEOUT).await {
                Err(TransferError::Io { .. }) => {}
                done => return done,
            }
        }
        let s = self.dial(peer).await?;
        self.handshake(peer, s, &req, self.cfg.io_timeout).await
    }

    async fn open_stream(
        &self,
        peer: &AgentAddr,
    ) -> Result<Option<Box<dyn crate::StreamConn>>, TransferError> {
        if let Some(pool) = &self.shm
            && let Some(c) = pool.open(peer).await
        {
            let s = shm::ShmStream::new(c, pool.clone(), self.cfg.io_timeout);
            return Ok(Some(Box::new(s)));
        }
        let conn = self.checkout(peer).await?;
        Ok(Some(Box::new(stream::TcpStreamConn::new(peer, conn, self))))
    }

    async fn post_write(&self, peer: &AgentAddr, req: WriteRequest) -> Result<(), TransferError> {
        if let Some(pool) = &self.shm
            && let Some(mut c) = pool.open(peer).await
        {
            let res = tokio::time::timeout(self.cfg.io_timeout, c.write(&req))
                .await
                .map_err(|_| TransferError::Timeout(format!("write to {peer}")))?;
            if reusable(&res) {
                pool.checkin(c);
            }
            return res;
        }
        let max_frame = self.cfg.max_frame;
        wire::check_fits(&req.pairs, max_frame)?;
        let mut s = self.checkout(peer).await?;
        let exchange = async {
            let mut w = BufWriter::with_capacity(wire::BUFFERED, &mut s);
            let io = |e| Self::io_err(peer, e);
            wire::write_pairs(&mut w, req.region, req.sender, &req.pairs, max_frame)
                .await
                .map_err(io)?;
            if let Some(n) = &req.notice {
                wire::write_notice(&mut w, req.region, n).await.map_err(io)?;
            }
            w.flush().await.map_err(io)?;
            drop(w);
            match req.notice {
                Some(_) => self.read_ack(peer, &mut s).await,
                None => Ok(()),
            }
        };
        let res = tokio::time::timeout(self.cfg.io_timeout, exchange)
            .await
            .map_err(|_| TransferError::Timeout(format!("write to {peer}")))?;
        if reusable(&res) {
            self.idle.put(peer, s);
        }
        res
    }
}

#[cfg(test)]
mod tests;
