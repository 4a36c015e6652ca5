//! [`ClusterTls`]: mutual TLS between a cluster's own processes, reloadable from its files.

use std::io;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::ServerName;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use super::files::Files;
use super::listener::Alpn;
use super::rechecked::{PeerCheck, PeerRole, Rechecked, Trust, Verifier};
use super::swap::{ClientTrust, KeyOf, ServerTrust, Swap};
use super::{
    ALPN_H2, Reloaded, TlsError, certified, expiry, invalid, provider, roots_of, unexpired,
};

/// One process's identity in the cluster and the cluster's CA (see the module docs of
/// [`crate::tls`]). Clones share their settings: a reload reaches every clone, and every
/// acceptor and connector taken from them, at its next handshake.
#[derive(Clone)]
pub struct ClusterTls {
    inner: Arc<Cluster>,
}

struct Cluster {
    key: Arc<Swap<CertifiedKey>>,
    clients: Arc<Swap<dyn ClientCertVerifier>>,
    servers: Arc<Swap<dyn ServerCertVerifier>>,
    trust: Arc<Trust>,
    acceptor: TlsAcceptor,
    grpc_acceptor: TlsAcceptor,
    connector: TlsConnector,
    grpc_connector: TlsConnector,
    files: Option<Files>,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls")
    }
}

/// What is built from the three PEMs, checked: the certificate with its key, and the
/// verifiers of clients and servers from the CA (whose PEM is kept, to tell a changed CA
/// file from a renewal that left it as it was).
struct Parts {
    key: Arc<CertifiedKey>,
    clients: Arc<dyn ClientCertVerifier>,
    servers: Arc<dyn ServerCertVerifier>,
    ca: Vec<u8>,
}

fn parts(chain: &[u8], key: &[u8], ca: &[u8]) -> Result<Parts, TlsError> {
    let key = certified(chain, key)?;
    let roots = Arc::new(roots_of(ca)?);
    let clients = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .build()
        .map_err(|e| invalid("client verifier", e))?;
    let servers = WebPkiServerVerifier::builder_with_provider(roots, provider())
        .build()
        .map_err(|e| invalid("server verifier", e))?;
    Ok(Parts { key, clients, servers, ca: ca.to_vec() })
}

impl ClusterTls {
    /// From PEM: this process's certificate chain and private key, and the cluster's CA.
    pub fn from_pem(chain: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, TlsError> {
        Self::built(parts(chain, key, ca)?, None)
    }

    /// From PEM files (see [`ClusterTls::from_pem`]), noting when the certificate expires
    /// ([`expiry`]); [`ClusterTls::reload`] reads them again.
    pub fn from_files(chain: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let paths = vec![chain.to_owned(), key.to_owned(), ca.to_owned()];
        let bytes = Files::read_all(&paths)?;
        let parts = parts(&bytes[0], &bytes[1], &bytes[2])?;
        expiry::note_pem(expiry::Shown::Cluster, &bytes[0], SystemTime::now());
        Self::built(parts, Some(Files::new(paths, Some(expiry::Shown::Cluster), bytes)))
    }

    fn built(p: Parts, files: Option<Files>) -> Result<Self, TlsError> {
        let key = Swap::new(p.key);
        let clients = Swap::new(p.clients);
        let servers = Swap::new(p.servers);
        let mut server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("server", e))?
            .with_client_cert_verifier(Arc::new(ClientTrust(clients.clone())))
            .with_cert_resolver(Arc::new(KeyOf(key.clone())));
        // No session is resumed, either way: the cluster's connections are long-lived (pooled
        // transfers, gRPC channels), and a reload's certificate and trust must reach every
        // new one (a client of a CA taken out of the bundle would otherwise go on resuming,
        // unchecked, for a day).
        server.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        server.send_tls13_tickets = 0;
        let mut client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("client", e))?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ServerTrust(servers.clone())))
            .with_client_cert_resolver(Arc::new(KeyOf(key.clone())));
        client.resumption = rustls::client::Resumption::disabled();
        let mut grpc_server = server.clone();
        grpc_server.alpn_protocols = vec![ALPN_H2.to_vec()];
        let mut grpc_client = client.clone();
        grpc_client.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(ClusterTls {
            inner: Arc::new(Cluster {
                key,
                clients,
                servers,
                trust: Trust::new(p.ca, expiry::Shown::Cluster),
                acceptor: TlsAcceptor::from(Arc::new(server)),
                grpc_acceptor: TlsAcceptor::from(Arc::new(grpc_server)),
                connector: TlsConnector::from(Arc::new(client)),
                grpc_connector: TlsConnector::from(Arc::new(grpc_client)),
                files,
            }),
        })
    }

    /// Reads the files again ([`ClusterTls::from_files`]; settings from PEM have none) and
    /// takes them when they changed and are usable: certificate, key and CA from then on,
    /// for every handshake; when the CA file changed, every connection's peer is checked
    /// again with it at its next use ([`super::Rechecked`]). Unusable ones (a key that is not
    /// the certificate's, a CA that does not parse) are refused, once, and the settings in use
    /// kept.
    pub fn reload(&self, now: SystemTime) -> Result<Reloaded, TlsError> {
        let Some(files) = &self.inner.files else { return Ok(Reloaded::Unchanged) };
        let build = |b: &[Vec<u8>]| {
            let p = parts(&b[0], &b[1], &b[2])?;
            unexpired(&p.key, now)?;
            Ok(p)
        };
        files.reload(now, build, |p| {
            let held = &self.inner;
            held.key.set(p.key);
            held.clients.set(p.clients);
            held.servers.set(p.servers);
            held.trust.taken(&p.ca);
        })
    }

    /// The check of a connection's peer against the trust in use, taken before its handshake
    /// and wrapped around it after ([`PeerCheck::wrap`]): a connection accepted (its peer a
    /// [`PeerRole::Client`]) or dialed ([`PeerRole::Server`], with the name it proved).
    pub fn peer_check(&self, role: PeerRole) -> PeerCheck {
        let held = &self.inner;
        let verifier = match role {
            PeerRole::Client => Verifier::Clients(held.clients.clone()),
            PeerRole::Server(name) => Verifier::Server(held.servers.clone(), name),
        };
        PeerCheck::new(held.trust.clone(), verifier)
    }

    /// Accepts connections from holders of a certificate the CA signed.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.inner.acceptor
    }

    /// [`ClusterTls::acceptor`] for gRPC: offers HTTP/2 by ALPN.
    pub fn grpc_acceptor(&self) -> &TlsAcceptor {
        &self.inner.grpc_acceptor
    }

    /// Dials with this process's certificate, trusting servers the CA signed; a connection
    /// made with it is not checked again after a change of the CA file: use
    /// [`ClusterTls::connect`] (this is for probes and tests).
    pub fn connector(&self) -> &TlsConnector {
        &self.inner.connector
    }

    /// A TLS client over `io` to `addr` (for the log) that proves `name` (the server's, as
    /// dialed) with this process's certificate, its handshake within `within`, asking for
    /// `alpn`: the stream comes out checked again after each change of the CA file
    /// ([`Rechecked`]; its check is taken before the handshake). A handshake not done in time
    /// is `TimedOut`.
    pub async fn connect<IO>(
        &self,
        name: ServerName<'static>,
        addr: impl std::fmt::Display,
        io: IO,
        alpn: Alpn,
        within: Duration,
    ) -> io::Result<Rechecked<tokio_rustls::client::TlsStream<IO>>>
    where
        IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
    {
        let check = self.peer_check(PeerRole::Server(name.clone())).of(addr);
        let connector = match alpn {
            Alpn::Unused => &self.inner.connector,
            Alpn::H2 => &self.inner.grpc_connector,
        };
        let shake = tokio::time::timeout(within, connector.connect(name, io)).await;
        let s = shake.map_err(|_| {
            let why = format!("TLS handshake not done within {within:?}");
            io::Error::new(io::ErrorKind::TimedOut, why)
        })??;
        Ok(check.wrap(s))
    }

    /// The certificate chain shown now (leaf first).
    pub fn chain(&self) -> Vec<rustls::pki_types::CertificateDer<'static>> {
        self.inner.key.get().cert.clone()
    }
}
