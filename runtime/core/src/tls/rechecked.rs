//! [`Rechecked`]: a cluster TLS connection whose peer is checked again after a reload
//! changed what the process trusts.
//!
//! A handshake checks the peer's certificate once. A connection that stays up (a pooled
//! transfer, a gRPC channel, a peer's connection to a listener) would otherwise keep a
//! trust the files no longer give: a CA taken out of the bundle, or a peer's expired
//! certificate, would still be served until a restart. Each reload of the cluster's files
//! moves a generation ([`ClusterTls::reload`]); a connection whose check is older than it
//! checks its peer's chain again, with the trust now in use, at its next read or write, and
//! fails that read or write (and every one after it) when the peer is refused, before a
//! byte more is read or written. An idle connection is cut at its next use: gRPC's pings
//! (every 5 s both ways) make that within seconds; a transfer's pooled one is checked before
//! it is taken from the pool ([`Rechecked::still_trusted`]).
//!
//! [`ClusterTls::reload`]: super::ClusterTls::reload

use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::SystemTime;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::swap::Swap;

/// What a process trusts now (the cluster's CA, or a public endpoint's client CA), and how
/// many reloads have changed it.
pub(crate) struct Trust {
    pub(crate) clients: Arc<Swap<dyn ClientCertVerifier>>,
    /// None: a listener's alone (a public endpoint's), which dials no one.
    pub(crate) servers: Option<Arc<Swap<dyn ServerCertVerifier>>>,
    generation: AtomicU64,
}

impl Trust {
    pub(crate) fn new(
        clients: Arc<Swap<dyn ClientCertVerifier>>,
        servers: Option<Arc<Swap<dyn ServerCertVerifier>>>,
    ) -> Self {
        Trust { clients, servers, generation: AtomicU64::new(0) }
    }

    /// Takes new verifiers: every connection checks its peer again at its next use.
    pub(crate) fn set(
        &self,
        clients: Arc<dyn ClientCertVerifier>,
        servers: Option<Arc<dyn ServerCertVerifier>>,
    ) {
        self.clients.set(clients);
        if let (Some(swap), Some(s)) = (&self.servers, servers) {
            swap.set(s);
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }
}

/// The end of a connection whose certificate is checked again.
#[derive(Debug, Clone)]
pub enum PeerRole {
    /// A client that connected to this process's listener.
    Client,
    /// A server this process dialed, which proved this name.
    Server(ServerName<'static>),
}

/// A connection's check of its peer against the cluster's trust, taken before its handshake
/// ([`super::ClusterTls::peer_check`]): a reload during the handshake is checked again at the
/// first use.
#[derive(Clone)]
pub struct PeerCheck {
    trust: Arc<Trust>,
    role: PeerRole,
    /// The generation of the trust when the check was taken.
    taken_at: u64,
}

impl std::fmt::Debug for PeerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCheck").field("role", &self.role).finish_non_exhaustive()
    }
}

impl PeerCheck {
    pub(crate) fn new(trust: Arc<Trust>, role: PeerRole) -> Self {
        let taken_at = trust.generation();
        PeerCheck { trust, role, taken_at }
    }

    /// `stream`, whose handshake was done after this check was taken, checked again when the
    /// trust changes.
    pub fn wrap<S: PeerChain>(self, stream: S) -> Rechecked<S> {
        Rechecked::maybe(Some(self), stream)
    }

    /// Checks `chain` (leaf first) with the trust in use, at `now`.
    fn verify(
        &self,
        chain: &[CertificateDer<'static>],
        now: SystemTime,
    ) -> Result<(), rustls::Error> {
        let Some((leaf, intermediates)) = chain.split_first() else {
            return Err(rustls::Error::NoCertificatesPresented);
        };
        let now = UnixTime::since_unix_epoch(
            now.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default(),
        );
        match &self.role {
            PeerRole::Client => {
                self.trust.clients.get().verify_client_cert(leaf, intermediates, now).map(drop)
            }
            PeerRole::Server(name) => match &self.trust.servers {
                Some(servers) => {
                    servers.get().verify_server_cert(leaf, intermediates, name, &[], now).map(drop)
                }
                None => Err(rustls::Error::General("no servers are trusted here".into())),
            },
        }
    }
}

/// A TLS stream that can show its peer's certificate chain.
pub trait PeerChain: AsyncRead + AsyncWrite + Unpin {
    /// The chain the peer showed in the handshake (leaf first), if any.
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]>;
}

impl<S: AsyncRead + AsyncWrite + Unpin> PeerChain for tokio_rustls::server::TlsStream<S> {
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]> {
        self.get_ref().1.peer_certificates()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> PeerChain for tokio_rustls::client::TlsStream<S> {
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]> {
        self.get_ref().1.peer_certificates()
    }
}

/// A TLS stream whose peer is checked again after each change of trust (see the module
/// docs).
pub struct Rechecked<S> {
    inner: S,
    /// None: never checked again (a public listener's clients).
    check: Option<PeerCheck>,
    /// The generation of the trust the peer was last found trusted by.
    at: AtomicU64,
    /// Why the peer was refused, once it was: every read and write fails with it.
    refused: Option<rustls::Error>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Rechecked<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rechecked").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S: PeerChain> Rechecked<S> {
    /// `stream` checked again after each change of trust with `check`, or, without one,
    /// never.
    pub fn maybe(check: Option<PeerCheck>, stream: S) -> Self {
        let at = AtomicU64::new(check.as_ref().map_or(0, |c| c.taken_at));
        Rechecked { inner: stream, check, at, refused: None }
    }

    /// The stream under it.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Whether the peer is trusted now (checked again when the trust changed since its last
    /// check): a pool asks before it hands the connection out.
    pub fn still_trusted(&self) -> Result<(), rustls::Error> {
        if let Some(e) = &self.refused {
            return Err(e.clone());
        }
        let Some(check) = &self.check else { return Ok(()) };
        let now = check.trust.generation();
        if self.at.load(Ordering::Acquire) == now {
            return Ok(());
        }
        let chain = self.inner.peer_chain().unwrap_or_default();
        check.verify(chain, SystemTime::now())?;
        self.at.store(now, Ordering::Release);
        Ok(())
    }

    /// [`Rechecked::still_trusted`], kept as an I/O error once it fails.
    fn usable(&mut self) -> io::Result<()> {
        let Err(e) = self.still_trusted() else { return Ok(()) };
        if self.refused.is_none() {
            let role = self.check.as_ref().map(|c| &c.role);
            tracing::warn!(peer = ?role, error = %e,
                "a connection's peer is no longer trusted after a TLS reload: closed");
            self.refused = Some(e.clone());
        }
        Err(io::Error::new(io::ErrorKind::PermissionDenied, e))
    }
}

impl<S: PeerChain> AsyncRead for Rechecked<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        me.usable()?;
        Pin::new(&mut me.inner).poll_read(cx, buf)
    }
}

impl<S: PeerChain> AsyncWrite for Rechecked<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        me.usable()?;
        Pin::new(&mut me.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let me = self.get_mut();
        me.usable()?;
        Pin::new(&mut me.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
