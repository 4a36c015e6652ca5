//! gRPC over our own TLS settings ([`handoff_core::tls`]), not tonic's: tonic builds its TLS
//! from PEM once, so a certificate renewed on disk would be taken only at a restart. Ours
//! resolve the certificate and the CA at each handshake, so a reload reaches the gRPC
//! servers and channels too.
//!
//! - Servers: each accepted connection becomes a [`LazyTls`], whose handshake runs in the
//!   connection's own task on its first read or write, within [`TLS_HANDSHAKE_TIMEOUT`], so a
//!   slow or silent client holds only its own place, never the accept loop. An internal
//!   service's client is checked again after each reload of the cluster's CA
//!   ([`Rechecked`]), as a channel checks its server.
//! - Channels: [`TlsDialer`] dials TCP (`TCP_NODELAY`; the host's addresses in turn, within
//!   the channel's connect timeout between them) and then TLS, proving the host dialed,
//!   within [`TLS_HANDSHAKE_TIMEOUT`] for the handshake.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use handoff_core::tls::{Alpn, ClusterTls, ListenerTls, Rechecked};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_stream::{Stream, StreamExt};
use tonic::codegen::http::Uri;
use tonic::transport::server::{Connected, TcpConnectInfo};

use super::{Placed, TLS_HANDSHAKE_TIMEOUT};

/// `incoming`'s connections over `tls`, each handshake left to the connection (a server
/// without TLS serves its `Placed` connections as they are: through one more layer they
/// measured slower, `cluster_incoming`).
pub fn with_tls(
    incoming: impl Stream<Item = io::Result<Placed>> + Send + 'static,
    tls: ListenerTls,
) -> impl Stream<Item = io::Result<LazyTls>> + Send + 'static {
    incoming.map(move |placed| Ok(LazyTls::new(&tls, placed?)))
}

type Handshake = Pin<Box<tokio::time::Timeout<tokio_rustls::Accept<Placed>>>>;
type Served = Rechecked<tokio_rustls::server::TlsStream<Placed>>;

/// A server's TLS connection whose handshake runs when it is first read or written.
pub struct LazyTls {
    info: TcpConnectInfo,
    stage: Stage,
}

enum Stage {
    Handshake(Handshake, Option<handoff_core::tls::PeerCheck>),
    Ready(Served),
    Failed,
}

impl std::fmt::Debug for LazyTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LazyTls").field("remote", &self.info.remote_addr()).finish()
    }
}

impl LazyTls {
    fn new(tls: &ListenerTls, placed: Placed) -> Self {
        let info = placed.connect_info();
        let peer = info.remote_addr().map_or_else(|| "?".to_owned(), |a| a.to_string());
        let (accept, check) = tls.accept(placed, Alpn::H2, peer);
        let handshake = tokio::time::timeout(TLS_HANDSHAKE_TIMEOUT, accept);
        LazyTls { info, stage: Stage::Handshake(Box::pin(handshake), check) }
    }

    /// The stream once its handshake is done (driving it).
    fn poll_stream(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<&mut Served>> {
        if let Stage::Handshake(h, check) = &mut self.stage {
            let done = ready!(h.as_mut().poll(cx));
            match done {
                Ok(Ok(s)) => self.stage = Stage::Ready(Rechecked::new(s, check.take())),
                Ok(Err(e)) => {
                    self.stage = Stage::Failed;
                    tracing::debug!(remote = ?self.info.remote_addr(), error = %e, "gRPC TLS handshake failed");
                    return Poll::Ready(Err(e));
                }
                Err(_) => {
                    self.stage = Stage::Failed;
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("TLS handshake not done within {TLS_HANDSHAKE_TIMEOUT:?}"),
                    )));
                }
            }
        }
        match &mut self.stage {
            Stage::Ready(s) => Poll::Ready(Ok(s)),
            _ => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "TLS handshake failed",
            ))),
        }
    }
}

impl Connected for LazyTls {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.info.clone()
    }
}

impl AsyncRead for LazyTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let s = ready!(self.get_mut().poll_stream(cx))?;
        Pin::new(s).poll_read(cx, buf)
    }
}

impl AsyncWrite for LazyTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let s = ready!(self.get_mut().poll_stream(cx))?;
        Pin::new(s).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let s = ready!(self.get_mut().poll_stream(cx))?;
        Pin::new(s).poll_write_vectored(cx, bufs)
    }

    /// Asked once, when the connection is set up (before the handshake): tokio-rustls's
    /// stream always says yes.
    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stage {
            Stage::Ready(s) => Pin::new(s).poll_flush(cx),
            _ => Poll::Ready(Ok(())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().stage {
            Stage::Ready(s) => Pin::new(s).poll_shutdown(cx),
            _ => Poll::Ready(Ok(())),
        }
    }
}

/// TCP to `host:port`: its addresses tried in turn, each within an equal share of `within`.
async fn tcp_to(host: &str, port: u16, within: Duration) -> io::Result<TcpStream> {
    let addrs: Vec<_> = tokio::net::lookup_host((host, port)).await?.collect();
    first_of(&addrs, within).await
}

/// TCP to the first of `addrs` that answers, each tried within an equal share of `within`
/// (one that drops packets costs its share, not the whole).
async fn first_of(addrs: &[std::net::SocketAddr], within: Duration) -> io::Result<TcpStream> {
    let share = within / u32::try_from(addrs.len().max(1)).unwrap_or(u32::MAX);
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address");
    for &addr in addrs {
        match tokio::time::timeout(share, TcpStream::connect(addr)).await {
            Ok(Ok(tcp)) => return Ok(tcp),
            Ok(Err(e)) => last = e,
            Err(_) => {
                last = io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("{addr}: not connected within {share:?}"),
                );
            }
        }
    }
    Err(last)
}

/// Dials a gRPC server over the cluster's TLS (see the module docs): the connector of a
/// channel.
#[derive(Clone)]
pub struct TlsDialer {
    tls: ClusterTls,
    connect_timeout: Duration,
}

impl TlsDialer {
    /// Dials with `tls`, TCP within `connect_timeout` (shared by the host's addresses, tried
    /// in turn), then the handshake within [`TLS_HANDSHAKE_TIMEOUT`].
    pub fn new(tls: ClusterTls, connect_timeout: Duration) -> Self {
        TlsDialer { tls, connect_timeout }
    }
}

/// A dialed TLS connection, as hyper reads and writes it.
pub type Dialed = hyper_util::rt::TokioIo<Rechecked<tokio_rustls::client::TlsStream<TcpStream>>>;

impl tower::Service<Uri> for TlsDialer {
    type Response = Dialed;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<Dialed>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (tls, within) = (self.tls.clone(), self.connect_timeout);
        Box::pin(async move {
            let bad = |what: &str| {
                io::Error::new(io::ErrorKind::InvalidInput, format!("{what} in {uri}"))
            };
            let host = uri.host().ok_or_else(|| bad("no host"))?;
            let port = uri.port_u16().ok_or_else(|| bad("no port"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            let name = handoff_core::tls::server_name(host).map_err(io::Error::other)?;
            let tcp = tcp_to(host, port, within).await?;
            // Best effort: a socket that refuses the option still works, only slower.
            let _ = tcp.set_nodelay(true);
            let s = tls.connect(name, &uri, tcp, Alpn::H2, TLS_HANDSHAKE_TIMEOUT).await?;
            Ok(hyper_util::rt::TokioIo::new(s))
        })
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::net::{TcpListener, TcpSocket, TcpStream};

    use super::first_of;

    /// An address whose connects hang (a listener whose backlog is full and which never
    /// accepts drops further SYNs, as a blackholed address does), then one that answers: the
    /// second is reached within the time, the first costing only its share.
    #[tokio::test]
    async fn an_address_that_drops_packets_costs_only_its_share() {
        let full = TcpSocket::new_v4().unwrap();
        full.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let full = full.listen(1).unwrap();
        let hung = full.local_addr().unwrap();
        let mut fillers = Vec::new();
        for _ in 0..4 {
            let c = tokio::time::timeout(Duration::from_millis(200), TcpStream::connect(hung));
            if let Ok(Ok(c)) = c.await {
                fillers.push(c);
            }
        }
        let good = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let to = good.local_addr().unwrap();
        // Without a limit per address, the first would hold the dial for the OS's own SYN
        // retries (about two minutes).
        let addrs = [hung, to];
        let dial = first_of(&addrs, Duration::from_secs(4));
        let got = tokio::time::timeout(Duration::from_secs(20), dial).await.expect("not held up");
        assert_eq!(got.expect("the second address reached").peer_addr().unwrap(), to);
        drop(fillers);
    }
}
