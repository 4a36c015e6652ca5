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
//! - [`reload`]: certificates read from files are read again while the process runs and
//!   taken at the next handshake when they changed ([`swap`]), so a renewed certificate (or
//!   a CA bundle changed for a CA rotation) needs no restart; connections already up check
//!   their peer again with the new trust at their next use ([`Rechecked`]).
//! - [`HandedTls`]: files handed as PEM to a client library that builds its own TLS (etcd's),
//!   checked and read again likewise; its owner makes the library's client again.

pub mod expiry;
pub mod reload;
#[cfg(any(test, feature = "test-certs"))]
pub mod test_certs;

mod cluster;
mod files;
mod handed;
mod listener;
mod public;
mod rechecked;
mod swap;
#[cfg(test)]
mod tests;

pub use cluster::ClusterTls;
pub use handed::{HandedPem, HandedTls};
pub use listener::{Accepted, Alpn, HANDSHAKES_PER_HOST, ListenerTls, TlsListener};
pub use public::{ServerTls, public_client};
pub use rechecked::{PeerChain, PeerCheck, PeerRole, Rechecked};

use std::path::Path;
use std::sync::Arc;

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::sign::CertifiedKey;

/// The ALPN name of HTTP/2, which gRPC's servers offer and its clients ask for.
const ALPN_H2: &[u8] = b"h2";

/// What a reload of certificate files did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reloaded {
    /// The files are as they were taken, or as they were last refused, or unreadable for the
    /// reason they were at the last look: nothing to do.
    Unchanged,
    /// The files changed and are in use from now on.
    Taken,
}

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
    /// A connection's peer is refused by the trust now in use (after a reload took a CA
    /// file that does not trust it).
    #[error("TLS peer no longer trusted: {0}")]
    PeerRefused(#[source] rustls::Error),
    /// A certificate read again has expired already (at a reload, where the one in use is
    /// kept).
    #[error("TLS certificate expired already")]
    Expired,
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

/// The certificate chain with its private key, checked to belong together.
fn certified(chain: &[u8], key: &[u8]) -> Result<Arc<CertifiedKey>, TlsError> {
    CertifiedKey::from_der(chain_of(chain)?, key_of(key)?, &provider())
        .map(Arc::new)
        .map_err(|e| invalid("certificate and key", e))
}

/// At a reload, a certificate that has already ended by `now` is refused: the one in use may
/// not have (at startup one is taken, with a warning: there is nothing else to show).
fn unexpired(key: &CertifiedKey, now: std::time::SystemTime) -> Result<(), TlsError> {
    match key.cert.first().and_then(expiry::not_after) {
        Some(end) if end <= now => Err(TlsError::Expired),
        _ => Ok(()),
    }
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
        // An I/O error holds the TLS error it stands for (not as its source), or, through
        // other transports, only its text.
        if let Some(io) = e.downcast_ref::<std::io::Error>() {
            let inner = io.get_ref().and_then(|i| i.downcast_ref::<rustls::Error>());
            if let Some(rustls::Error::AlertReceived(a)) = inner {
                return HOLDERS_FAULT_ALERTS.contains(a);
            }
            if let Some(name) = io.to_string().strip_prefix("received fatal alert: ") {
                return HOLDERS_FAULT_ALERTS.iter().any(|a| a.as_str() == Some(name));
            }
        }
        at = e.source();
    }
    false
}
