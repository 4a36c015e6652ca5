//! TLS for every listener and client of a cluster (rustls with ring).
//!
//! - [`ClusterTls`]: mutual TLS between a cluster's own processes. Each holds a certificate
//!   signed by the cluster's CA and accepts only peers that do: listeners refuse clients
//!   without one, and clients refuse a server that cannot prove the address they dialed. The
//!   tcp transfer, the bootstrap directory and the internal gRPC services use it.
//! - [`ServerTls`]: a public endpoint's certificate, for clients that hold none (the frontend's
//!   Generate and OpenAI listeners).
//! - [`TlsListener`]: an axum listener that hands out only connections whose handshake
//!   finished, running handshakes side by side with a deadline each, so a slow or silent
//!   peer holds neither the accept loop nor a slot for long.

pub mod expiry;
#[cfg(any(test, feature = "test-certs"))]
pub mod test_certs;

mod listener;
#[cfg(test)]
mod tests;

pub use listener::{HANDSHAKES_PER_HOST, TlsListener};

use std::path::Path;
use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// Why TLS settings could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("TLS file {path}: {source}")]
    File {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The PEM or the settings built from it are unusable.
    #[error("TLS {what}: {reason}")]
    Invalid {
        /// Which part (certificate, key, CA, ...).
        what: &'static str,
        /// Why.
        reason: String,
    },
}

fn invalid(what: &'static str, e: impl std::fmt::Display) -> TlsError {
    TlsError::Invalid { what, reason: e.to_string() }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path)
        .map_err(|source| TlsError::File { path: path.display().to_string(), source })
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn chain_of(pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain: Vec<_> = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<_, _>>()
        .map_err(|e| invalid("certificate", e))?;
    if chain.is_empty() {
        return Err(invalid("certificate", "no certificate in the PEM"));
    }
    Ok(chain)
}

fn key_of(pem: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| invalid("key", e))
}

fn roots_of(ca: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca) {
        roots.add(c.map_err(|e| invalid("CA", e))?).map_err(|e| invalid("CA", e))?;
    }
    if roots.is_empty() {
        return Err(invalid("CA", "no certificate in the PEM"));
    }
    Ok(roots)
}

/// One process's identity in the cluster and the cluster's CA (see the module docs).
#[derive(Clone)]
pub struct ClusterTls {
    chain: Arc<[u8]>,
    key: Arc<[u8]>,
    ca: Arc<[u8]>,
    acceptor: TlsAcceptor,
    connector: TlsConnector,
}

impl std::fmt::Debug for ClusterTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClusterTls")
    }
}

impl ClusterTls {
    /// From PEM: this process's certificate chain and private key, and the cluster's CA.
    pub fn from_pem(chain: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, TlsError> {
        let certs = chain_of(chain)?;
        let private = key_of(key)?;
        let roots = Arc::new(roots_of(ca)?);
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
            .build()
            .map_err(|e| invalid("client verifier", e))?;
        let server = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("server", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), private.clone_key())
            .map_err(|e| invalid("server certificate", e))?;
        let client = ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("client", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, private)
            .map_err(|e| invalid("client certificate", e))?;
        Ok(ClusterTls {
            chain: chain.into(),
            key: key.into(),
            ca: ca.into(),
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// From PEM files (see [`ClusterTls::from_pem`]), noting when the certificate expires
    /// ([`expiry`]).
    pub fn from_files(chain: &Path, key: &Path, ca: &Path) -> Result<Self, TlsError> {
        let chain = read(chain)?;
        let tls = Self::from_pem(&chain, &read(key)?, &read(ca)?)?;
        expiry::note_pem(expiry::Shown::Cluster, &chain, std::time::SystemTime::now());
        Ok(tls)
    }

    /// Accepts connections from holders of a certificate the CA signed.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// Dials with this process's certificate, trusting servers the CA signed.
    pub fn connector(&self) -> &TlsConnector {
        &self.connector
    }

    /// The client settings behind [`ClusterTls::connector`] (for HTTP clients).
    pub fn client_config(&self) -> &Arc<ClientConfig> {
        self.connector.config()
    }

    /// The certificate chain, PEM (for libraries that build their own TLS settings).
    pub fn chain_pem(&self) -> &[u8] {
        &self.chain
    }

    /// The private key, PEM.
    pub fn key_pem(&self) -> &[u8] {
        &self.key
    }

    /// The CA, PEM.
    pub fn ca_pem(&self) -> &[u8] {
        &self.ca
    }
}

/// The name a server at `host` (a DNS name or an IP address) must prove.
pub fn server_name(host: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(host.to_owned()).map_err(|e| invalid("peer name", e))
}

/// Whether a certificate refused for `c` is at fault itself, whoever holds it: not valid
/// for the name dialled (renewed without it), expired or not yet valid, revoked, badly
/// encoded or for another purpose. An unknown issuer or an unverified signature is not
/// (mid-way through a CA change the refusing side's bundle may be the stale one).
fn holders_fault(c: &rustls::CertificateError) -> bool {
    use rustls::CertificateError as C;
    matches!(
        c,
        C::NotValidForName
            | C::NotValidForNameContext { .. }
            | C::Expired
            | C::ExpiredContext { .. }
            | C::NotValidYet
            | C::NotValidYetContext { .. }
            | C::Revoked
            | C::BadEncoding
            | C::UnhandledCriticalExtension
            | C::InvalidPurpose
            | C::InvalidPurposeContext { .. }
    )
}

/// The alerts a peer sends for a certificate refused for [`holders_fault`] (as rustls maps
/// them), and for none shown.
const HOLDERS_FAULT_ALERTS: [rustls::AlertDescription; 5] = [
    rustls::AlertDescription::BadCertificate,
    rustls::AlertDescription::CertificateExpired,
    rustls::AlertDescription::CertificateRevoked,
    rustls::AlertDescription::UnsupportedCertificate,
    rustls::AlertDescription::CertificateRequired,
];

/// Whether a TLS handshake failed with `e` because this side refused the peer's certificate
/// for what is the peer's own ([`holders_fault`]), not this side's; a refusal of this side's
/// own certificate (an alert) is not this.
pub fn refused_peer_certificate(e: &std::io::Error) -> bool {
    let refused = e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>());
    matches!(refused, Some(rustls::Error::InvalidCertificate(c)) if holders_fault(c))
}

/// Whether `e` (or an error under it) says the peer refused this side's certificate for
/// what is this side's own ([`holders_fault`], by the alert it sent back): this side is at
/// fault, not the peer. The same rule as [`refused_peer_certificate`], from the other end.
pub fn own_certificate_refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(e) = at {
        if let Some(rustls::Error::AlertReceived(a)) = e.downcast_ref::<rustls::Error>() {
            return HOLDERS_FAULT_ALERTS.contains(a);
        }
        // Through tonic's transport the alert arrives as its text only, in an I/O error.
        if let Some(io) = e.downcast_ref::<std::io::Error>()
            && let Some(name) = io.to_string().strip_prefix("received fatal alert: ")
        {
            return HOLDERS_FAULT_ALERTS.iter().any(|a| a.as_str() == Some(name));
        }
        at = e.source();
    }
    false
}

/// A public endpoint's certificate and key; clients need no certificate of their own unless
/// a client CA is given.
#[derive(Clone)]
pub struct ServerTls {
    chain: Arc<[u8]>,
    key: Arc<[u8]>,
    client_ca: Option<Arc<[u8]>>,
    acceptor: TlsAcceptor,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ServerTls")
    }
}

impl ServerTls {
    /// From PEM: the certificate chain and its private key; with `client_ca`, clients must
    /// present a certificate it signed.
    pub fn from_pem(chain: &[u8], key: &[u8], client_ca: Option<&[u8]>) -> Result<Self, TlsError> {
        let builder = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| invalid("server", e))?;
        let builder = match client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let roots = Arc::new(roots_of(ca)?);
                let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider())
                    .build()
                    .map_err(|e| invalid("client verifier", e))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let server = builder
            .with_single_cert(chain_of(chain)?, key_of(key)?)
            .map_err(|e| invalid("server certificate", e))?;
        Ok(ServerTls {
            chain: chain.into(),
            key: key.into(),
            client_ca: client_ca.map(Arc::from),
            acceptor: TlsAcceptor::from(Arc::new(server)),
        })
    }

    /// From PEM files (see [`ServerTls::from_pem`]).
    pub fn from_files(
        chain: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let ca = client_ca.map(read).transpose()?;
        let chain = read(chain)?;
        let tls = Self::from_pem(&chain, &read(key)?, ca.as_deref())?;
        expiry::note_pem(expiry::Shown::Public, &chain, std::time::SystemTime::now());
        Ok(tls)
    }

    /// The CA clients' certificates must come from, PEM, when clients need one.
    pub fn client_ca_pem(&self) -> Option<&[u8]> {
        self.client_ca.as_deref()
    }

    /// Accepts any client.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }

    /// The certificate chain, PEM.
    pub fn chain_pem(&self) -> &[u8] {
        &self.chain
    }

    /// The private key, PEM.
    pub fn key_pem(&self) -> &[u8] {
        &self.key
    }
}
