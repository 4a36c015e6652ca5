//! [`Rechecked`]: a TLS connection whose peer is checked again after a reload changed the CA
//! it was trusted by (the cluster's, or a public endpoint's client CA).
//!
//! A handshake checks the peer's certificate once. A connection that stays up (a pooled
//! transfer, a gRPC channel, a peer's connection to a listener) would otherwise keep a trust
//! the files no longer give: a CA taken out of the bundle would go on being trusted on it
//! until a restart. Each reload that took a changed CA file moves a generation
//! ([`ClusterTls::reload`], [`ServerTls::reload`]); a connection whose check is older than it
//! checks its peer's chain again with the CA now in use, at its next read or write, and
//! fails that read or write (and every one after it) when the peer is refused. The chain is
//! checked at the time of the connection's handshake: what is checked again is the trust,
//! not the certificate's validity, so a peer certificate that expired while its connection
//! was up is not cut (as before), and a renewal that leaves the CA file as it was checks
//! nothing. A transfer's pooled connection is checked before it is taken from the pool
//! ([`Rechecked::still_trusted`]).
//!
//! [`ClusterTls::reload`]: super::ClusterTls::reload
//! [`ServerTls::reload`]: super::ServerTls::reload

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::task::{Context, Poll};
use std::time::SystemTime;

use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::TlsError;
use super::expiry::{Shown, cuts};
use super::swap::Swap;

/// The CA file a process's verifiers were built from, and how many reloads have changed it.
pub(crate) struct Trust {
    ca: Mutex<Vec<u8>>,
    generation: AtomicU64,
    /// Whose trust (the cluster's, or a public endpoint's client CA), for the count of cuts.
    shown: Shown,
}

impl Trust {
    pub(crate) fn new(ca: Vec<u8>, shown: Shown) -> Arc<Self> {
        // Shown at 0 from the start: a series that first appears at 1 hides its first cuts
        // from a rate.
        cuts().with(&[shown.label()]);
        Arc::new(Trust { ca: Mutex::new(ca), generation: AtomicU64::new(0), shown })
    }

    /// Notes the CA file of verifiers just put in use: when it differs from the last,
    /// every connection checks its peer again at its next use.
    pub(crate) fn taken(&self, ca: &[u8]) {
        let mut held = self.ca.lock().unwrap_or_else(PoisonError::into_inner);
        if *held != ca {
            *held = ca.to_vec();
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
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

/// The verifier a peer is checked with: the one in use at each check.
#[derive(Clone)]
pub(crate) enum Verifier {
    /// A listener's, of its clients.
    Clients(Arc<Swap<dyn ClientCertVerifier>>),
    /// A dialer's, of the server that proved `name`.
    Server(Arc<Swap<dyn ServerCertVerifier>>, ServerName<'static>),
}

/// A connection's check of its peer, taken before its handshake
/// ([`super::ClusterTls::peer_check`], [`super::ServerTls::peer_check`]): a reload during the
/// handshake is checked again at the first use.
#[derive(Clone)]
pub struct PeerCheck {
    trust: Arc<Trust>,
    verifier: Verifier,
    /// The generation of the trust when the check was taken.
    taken_at: u64,
    /// Who the peer is, for the log.
    peer: String,
}

impl std::fmt::Debug for PeerCheck {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCheck").field("peer", &self.peer).finish_non_exhaustive()
    }
}

impl PeerCheck {
    pub(crate) fn new(trust: Arc<Trust>, verifier: Verifier) -> Self {
        let taken_at = trust.generation();
        let peer = match &verifier {
            Verifier::Clients(_) => "a client".to_owned(),
            Verifier::Server(_, name) => format!("server {}", name.to_str()),
        };
        PeerCheck { trust, verifier, taken_at, peer }
    }

    /// Names the peer by its address (`host:port`) in the log when it is refused.
    pub fn of(mut self, addr: impl std::fmt::Display) -> Self {
        self.peer = match &self.verifier {
            Verifier::Clients(_) => format!("client {addr}"),
            Verifier::Server(..) => format!("server {addr}"),
        };
        self
    }

    /// `stream`, whose handshake was done after this check was taken, checked again when the
    /// trust changes.
    pub fn wrap<S: PeerChain>(self, stream: S) -> Rechecked<S> {
        Rechecked::new(stream, Some(self))
    }

    /// Checks `chain` (leaf first) with the verifier in use, at `shaken_at` (the time of the
    /// connection's handshake).
    fn verify(
        &self,
        chain: &[CertificateDer<'static>],
        shaken_at: SystemTime,
    ) -> Result<(), rustls::Error> {
        let Some((leaf, intermediates)) = chain.split_first() else {
            return Err(rustls::Error::NoCertificatesPresented);
        };
        let since = shaken_at.duration_since(SystemTime::UNIX_EPOCH).unwrap_or_default();
        let at = UnixTime::since_unix_epoch(since);
        match &self.verifier {
            Verifier::Clients(v) => v.get().verify_client_cert(leaf, intermediates, at).map(drop),
            Verifier::Server(v, name) => {
                v.get().verify_server_cert(leaf, intermediates, name, &[], at).map(drop)
            }
        }
    }
}

/// A TLS stream that can show its peer's certificate chain.
pub trait PeerChain: AsyncRead + AsyncWrite + Unpin {
    /// The chain the peer showed in the handshake (leaf first), if any.
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]>;

    /// Whether the handshake resumed an earlier session (whose chain was checked then, by
    /// the trust of that time).
    fn resumed(&self) -> bool;
}

impl<S: AsyncRead + AsyncWrite + Unpin> PeerChain for tokio_rustls::server::TlsStream<S> {
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]> {
        self.get_ref().1.peer_certificates()
    }

    fn resumed(&self) -> bool {
        self.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> PeerChain for tokio_rustls::client::TlsStream<S> {
    fn peer_chain(&self) -> Option<&[CertificateDer<'static>]> {
        self.get_ref().1.peer_certificates()
    }

    fn resumed(&self) -> bool {
        self.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed)
    }
}

/// A generation no trust reaches: a resumed connection's first use checks its chain.
const UNCHECKED: u64 = u64::MAX;

/// A TLS stream whose peer is checked again after each change of trust (see the module
/// docs).
pub struct Rechecked<S> {
    inner: S,
    /// None: never checked again (a public listener's clients).
    check: Option<PeerCheck>,
    /// When the handshake ended (as the stream was wrapped, right after it): the time the
    /// peer's chain is checked at.
    shaken_at: SystemTime,
    /// The generation of the trust the peer was last found trusted by.
    at: AtomicU64,
    /// Why the peer was refused, once it was: every read, write, flush and shutdown fails
    /// with it.
    refused: OnceLock<rustls::Error>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for Rechecked<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rechecked").field("inner", &self.inner).finish_non_exhaustive()
    }
}

impl<S: PeerChain> Rechecked<S> {
    /// `stream`, whose handshake has just ended (its time is the one the chain is checked
    /// at), checked again after each change of trust with `check`, or, without one, never (a
    /// public listener without a client CA). A resumed session's chain was checked by the
    /// trust of its first handshake, which may be older than the check: it is checked again
    /// at the first use.
    pub fn new(stream: S, check: Option<PeerCheck>) -> Self {
        let at = match &check {
            Some(_) if stream.resumed() => UNCHECKED,
            Some(c) => c.taken_at,
            None => 0,
        };
        let (at, refused) = (AtomicU64::new(at), OnceLock::new());
        Rechecked { inner: stream, check, shaken_at: SystemTime::now(), at, refused }
    }

    /// The stream under it.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Whether the peer is trusted now (checked again when the trust changed since its last
    /// check): a pool asks before it hands the connection out.
    pub fn still_trusted(&self) -> Result<(), TlsError> {
        self.recheck().map_err(TlsError::PeerRefused)
    }

    fn recheck(&self) -> Result<(), rustls::Error> {
        if let Some(e) = self.refused.get() {
            return Err(e.clone());
        }
        let Some(check) = &self.check else { return Ok(()) };
        let now = check.trust.generation();
        if self.at.load(Ordering::Acquire) == now {
            return Ok(());
        }
        let chain = self.inner.peer_chain().unwrap_or_default();
        if let Err(e) = check.verify(chain, self.shaken_at) {
            if self.refused.set(e.clone()).is_ok() {
                tracing::debug!(peer = %check.peer, error = %e,
                    "a connection's peer is no longer trusted after a TLS reload: closed");
                cuts().with(&[check.trust.shown.label()]).inc();
            }
            return Err(e);
        }
        self.at.store(now, Ordering::Release);
        Ok(())
    }

    /// [`Rechecked::recheck`], kept as an I/O error once it fails (the refusal inside it, as
    /// a handshake's would be).
    fn usable(&self) -> io::Result<()> {
        let Err(e) = self.recheck() else { return Ok(()) };
        Err(io::Error::new(io::ErrorKind::PermissionDenied, e))
    }

    /// The refusal, once the peer was refused: nothing more is flushed or sent to it.
    fn refusal(&self) -> io::Result<()> {
        match self.refused.get() {
            None => Ok(()),
            Some(e) => Err(io::Error::new(io::ErrorKind::PermissionDenied, e.clone())),
        }
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
        let me = self.get_mut();
        me.refusal()?;
        Pin::new(&mut me.inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let me = self.get_mut();
        me.refusal()?;
        Pin::new(&mut me.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests;
