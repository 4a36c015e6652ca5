//! [`TlsListener`]: accepted TCP connections, handed out once their TLS handshake is done.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::time::Duration;

use futures::StreamExt;
use futures::stream::FuturesUnordered;
use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::Accept;
use tokio_rustls::server::TlsStream;
use tracing::debug;

use super::{ClusterTls, PeerCheck, PeerRole, Rechecked, ServerTls};

/// A connection a [`TlsListener`] hands out.
pub type Accepted = Rechecked<TlsStream<TcpStream>>;

type Handshake = Pin<Box<dyn Future<Output = (SocketAddr, Option<Accepted>)> + Send>>;

/// The TLS a listener speaks. Each connection's client is checked again after each reload
/// of the CA it was trusted by ([`Rechecked`]): the cluster's, or a public endpoint's client
/// CA.
#[derive(Clone)]
pub enum ListenerTls {
    /// The cluster's mutual TLS.
    Cluster(ClusterTls),
    /// A public endpoint's (clients need a certificate only with a client CA).
    Public(ServerTls),
}

/// The protocol a TLS connection names by ALPN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Alpn {
    /// None: a KV transfer, or HTTP whose version the client's first bytes tell.
    Unused,
    /// HTTP/2, for gRPC.
    H2,
}

impl ListenerTls {
    /// The handshake of `stream` from `peer`, and the check of that client after reloads
    /// (taken before the handshake: see [`PeerCheck`]), to wrap around the stream once it is
    /// done.
    pub fn accept<IO>(
        &self,
        stream: IO,
        alpn: Alpn,
        peer: impl std::fmt::Display,
    ) -> (Accept<IO>, Option<PeerCheck>)
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let (acceptor, check) = match (self, alpn) {
            (ListenerTls::Cluster(t), Alpn::Unused) => {
                (t.acceptor(), Some(t.peer_check(PeerRole::Client)))
            }
            (ListenerTls::Cluster(t), Alpn::H2) => {
                (t.grpc_acceptor(), Some(t.peer_check(PeerRole::Client)))
            }
            (ListenerTls::Public(t), Alpn::Unused) => (t.acceptor(), t.peer_check()),
            (ListenerTls::Public(t), Alpn::H2) => (t.grpc_acceptor(), t.peer_check()),
        };
        (acceptor.accept(stream), check.map(|c| c.of(peer)))
    }
}

/// Handshakes one address may have in progress; more from it are closed at once.
pub const HANDSHAKES_PER_HOST: usize = 8;

/// A TCP listener whose connections come out TLS-wrapped (see the module docs). Handshakes
/// run side by side, each within `handshake_timeout`; at most `max_handshakes` at once, beyond
/// which accepting waits, and at most [`HANDSHAKES_PER_HOST`] from one address, beyond which
/// its new connections are closed (one host cannot take every place).
pub struct TlsListener {
    tcp: TcpListener,
    tls: ListenerTls,
    handshakes: FuturesUnordered<Handshake>,
    per_host: HashMap<IpAddr, usize>,
    handshake_timeout: Duration,
    max_handshakes: usize,
}

impl std::fmt::Debug for ListenerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            ListenerTls::Cluster(_) => "ListenerTls::Cluster",
            ListenerTls::Public(_) => "ListenerTls::Public",
        })
    }
}

impl std::fmt::Debug for TlsListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsListener")
            .field("tcp", &self.tcp)
            .field("handshakes", &self.handshakes.len())
            .finish_non_exhaustive()
    }
}

impl TlsListener {
    /// Wraps `tcp`'s connections with `tls`: a handshake gets 10 s, 256 run at once.
    pub fn new(tcp: TcpListener, tls: ListenerTls) -> Self {
        Self::with_limits(tcp, tls, Duration::from_secs(10), 256)
    }

    /// As [`TlsListener::new`], with the handshake deadline and concurrency given.
    pub fn with_limits(
        tcp: TcpListener,
        tls: ListenerTls,
        handshake_timeout: Duration,
        max_handshakes: usize,
    ) -> Self {
        TlsListener {
            tcp,
            tls,
            handshakes: FuturesUnordered::new(),
            per_host: HashMap::new(),
            handshake_timeout,
            max_handshakes: max_handshakes.max(1),
        }
    }

    fn begin(&mut self, stream: TcpStream, peer: SocketAddr) {
        let host = peer.ip().to_canonical();
        let busy = self.per_host.entry(host).or_default();
        if *busy >= HANDSHAKES_PER_HOST {
            debug!(%peer, "too many TLS handshakes from this host; closed");
            return;
        }
        *busy += 1;
        // Best effort, as for plain listeners: request/response traffic must not wait on Nagle.
        let _ = stream.set_nodelay(true);
        let (shake, check) = self.tls.accept(stream, Alpn::Unused, peer);
        let deadline = self.handshake_timeout;
        self.handshakes.push(Box::pin(async move {
            match tokio::time::timeout(deadline, shake).await {
                Ok(Ok(tls)) => (peer, Some(Rechecked::new(tls, check))),
                Ok(Err(e)) => {
                    debug!(%peer, error = %e, "TLS handshake refused");
                    (peer, None)
                }
                Err(_) => {
                    debug!(%peer, "TLS handshake timed out");
                    (peer, None)
                }
            }
        }));
    }

    fn end(&mut self, peer: SocketAddr) {
        let host = peer.ip().to_canonical();
        if let Some(n) = self.per_host.get_mut(&host) {
            *n -= 1;
            if *n == 0 {
                self.per_host.remove(&host);
            }
        }
    }

    /// The next connection whose handshake succeeded. Cancel-safe: handshakes in progress
    /// stay with the listener.
    pub async fn accept_tls(&mut self) -> (Accepted, SocketAddr) {
        loop {
            let room = self.handshakes.len() < self.max_handshakes;
            tokio::select! {
                Some((peer, done)) = self.handshakes.next(), if !self.handshakes.is_empty() => {
                    self.end(peer);
                    if let Some(tls) = done {
                        return (tls, peer);
                    }
                }
                accepted = self.tcp.accept(), if room => match accepted {
                    Ok((stream, peer)) => self.begin(stream, peer),
                    Err(e) => {
                        // As axum does: out of descriptors and the like pass; don't spin.
                        debug!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                },
            }
        }
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = Accepted;
    type Addr = SocketAddr;

    fn accept(&mut self) -> impl Future<Output = (Self::Io, Self::Addr)> + Send {
        self.accept_tls()
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.tcp.local_addr()
    }
}
