//! [`ServerTls`]: a public endpoint's certificate, reloadable from its files.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustls::ServerConfig;
use rustls::server::WebPkiClientVerifier;
use rustls::server::danger::ClientCertVerifier;
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use super::files::Files;
use super::rechecked::{PeerCheck, Trust, Verifier};
use super::swap::{ClientTrust, KeyOf, ServerSessions, Swap, server_sessions};
use super::{
    ALPN_H2, Reloaded, TlsError, certified, expiry, invalid, provider, roots_of, unexpired,
};

/// A public endpoint's certificate and key; clients need no certificate of their own unless
/// a client CA is given. Clones share their settings, as [`super::ClusterTls`]'s do.
#[derive(Clone)]
pub struct ServerTls {
    inner: Arc<Public>,
}

struct Public {
    key: Arc<Swap<CertifiedKey>>,
    /// With a client CA: the clients trusted.
    clients: Option<ClientCa>,
    resumed: Arc<Swap<dyn rustls::server::StoresServerSessions>>,
    acceptor: TlsAcceptor,
    grpc_acceptor: TlsAcceptor,
    files: Option<Files>,
}

/// A public endpoint's client CA: its verifier, and the CA file it was built from.
struct ClientCa {
    verifier: Arc<Swap<dyn ClientCertVerifier>>,
    trust: Arc<Trust>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

fn client_verifier(ca: &[u8]) -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
    WebPkiClientVerifier::builder_with_provider(Arc::new(roots_of(ca)?), provider())
        .build()
        .map_err(|e| invalid("client verifier", e))
}

/// A client of a public endpoint whose certificate `ca` (PEM) signed, showing `identity` (a
/// certificate chain and its key, PEM) when given (`handoff ctl trace` asking a frontend with
/// `--public-tls-cert`, and `--public-tls-client-ca`).
pub fn public_client(
    ca: &[u8],
    identity: Option<(&[u8], &[u8])>,
) -> Result<tokio_rustls::TlsConnector, TlsError> {
    let trusting = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid("client", e))?
        .with_root_certificates(roots_of(ca)?);
    let config = match identity {
        None => trusting.with_no_client_auth(),
        Some((chain, key)) => {
            let key = certified(chain, key)?;
            trusting.with_client_cert_resolver(Arc::new(KeyOf(Swap::new(key))))
        }
    };
    Ok(tokio_rustls::TlsConnector::from(Arc::new(config)))
}

impl ServerTls {
    /// From PEM: the certificate chain and its private key; with `client_ca`, clients must
    /// present a certificate it signed.
    pub fn from_pem(chain: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> Result<Self, TlsError> {
        let clients = client_ca.map(|ca| client_verifier(ca).map(|v| (v, ca.to_vec())));
        Self::built(certified(chain, key)?, clients.transpose()?, None)
    }

    /// From PEM files (see [`ServerTls::from_pem`]); [`ServerTls::reload`] reads them again.
    pub fn from_files(
        chain: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let mut paths: Vec<PathBuf> = vec![chain.to_owned(), key.to_owned()];
        paths.extend(client_ca.map(Path::to_owned));
        let bytes = Files::read_all(&paths)?;
        let key = certified(&bytes[0], &bytes[1])?;
        let clients = bytes.get(2).map(|ca| client_verifier(ca).map(|v| (v, ca.clone())));
        let clients = clients.transpose()?;
        expiry::note_pem(expiry::Shown::Public, &bytes[0], SystemTime::now());
        Self::built(key, clients, Some(Files::new(paths, Some(expiry::Shown::Public), bytes)))
    }

    fn built(
        key: Arc<CertifiedKey>,
        clients: Option<(Arc<dyn ClientCertVerifier>, Vec<u8>)>,
        files: Option<Files>,
    ) -> Result<Self, TlsError> {
        let key = Swap::new(key);
        let clients = clients.map(|(v, ca)| ClientCa {
            verifier: Swap::new(v),
            trust: Trust::new(ca, expiry::Shown::Public),
        });
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("server", e))?;
        let builder = match &clients {
            None => builder.with_no_client_auth(),
            Some(c) => builder.with_client_cert_verifier(Arc::new(ClientTrust(c.verifier.clone()))),
        };
        let mut server = builder.with_cert_resolver(Arc::new(KeyOf(key.clone())));
        let resumed = Swap::new(server_sessions());
        server.session_storage = Arc::new(ServerSessions(resumed.clone()));
        let mut grpc = server.clone();
        grpc.alpn_protocols = vec![ALPN_H2.to_vec()];
        Ok(ServerTls {
            inner: Arc::new(Public {
                key,
                clients,
                resumed,
                acceptor: TlsAcceptor::from(Arc::new(server)),
                grpc_acceptor: TlsAcceptor::from(Arc::new(grpc)),
                files,
            }),
        })
    }

    /// Reads the files again and takes them when they changed and are usable, as
    /// [`super::ClusterTls::reload`] does (the client CA too, when one was given).
    pub fn reload(&self, now: SystemTime) -> Result<Reloaded, TlsError> {
        let Some(files) = &self.inner.files else { return Ok(Reloaded::Unchanged) };
        let build = |b: &[Vec<u8>]| {
            let key = certified(&b[0], &b[1])?;
            unexpired(&key, now)?;
            let clients = b.get(2).map(|ca| client_verifier(ca).map(|v| (v, ca.clone())));
            Ok((key, clients.transpose()?))
        };
        files.reload(now, build, |(key, clients)| {
            self.inner.key.set(key);
            // The sessions first: a handshake that sees the new generation resumes none begun
            // before it (a resumed session's client is not verified again).
            self.inner.resumed.set(server_sessions());
            if let (Some(held), Some((v, ca))) = (&self.inner.clients, clients) {
                held.verifier.set(v);
                held.trust.taken(&ca);
            }
        })
    }

    /// With a client CA, the check of a connection's client against the CA in use, taken
    /// before its handshake and wrapped around it after, as [`super::ClusterTls::peer_check`]
    /// does; without one there is nothing to check again.
    pub fn peer_check(&self) -> Option<PeerCheck> {
        let c = self.inner.clients.as_ref()?;
        Some(PeerCheck::new(c.trust.clone(), Verifier::Clients(c.verifier.clone())))
    }

    /// Accepts clients (those with a certificate the client CA signed, when one was given).
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.inner.acceptor
    }

    /// [`ServerTls::acceptor`] for gRPC: offers HTTP/2 by ALPN.
    pub fn grpc_acceptor(&self) -> &TlsAcceptor {
        &self.inner.grpc_acceptor
    }

    /// The certificate chain shown now (leaf first).
    pub fn chain(&self) -> Vec<rustls::pki_types::CertificateDer<'static>> {
        self.inner.key.get().cert.clone()
    }
}
