//! [`TransferTls`]: mutual TLS for the tcp transfer. Both ends hold a certificate signed by
//! the cluster's CA and accept only peers that do: a listener refuses clients without one,
//! and a sender refuses a receiver that cannot prove the address it dials.

use std::sync::Arc;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, RootCertStore, ServerConfig};
use tokio_rustls::{TlsAcceptor, TlsConnector};

use crate::TransferError;

/// The acceptor and connector of one agent (see the module docs).
#[derive(Clone)]
pub struct TransferTls {
    pub(super) acceptor: TlsAcceptor,
    pub(super) connector: TlsConnector,
}

impl std::fmt::Debug for TransferTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferTls")
    }
}

fn bad(what: &str, e: impl std::fmt::Display) -> TransferError {
    TransferError::Malformed(format!("TLS {what}: {e}"))
}

impl TransferTls {
    /// From PEM: this agent's certificate chain and private key, and the cluster's CA.
    pub fn from_pem(chain: &[u8], key: &[u8], ca: &[u8]) -> Result<Self, TransferError> {
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(chain)
            .collect::<Result<_, _>>()
            .map_err(|e| bad("certificate", e))?;
        if chain.is_empty() {
            return Err(bad("certificate", "no certificate in the PEM"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad("key", e))?;
        let mut roots = RootCertStore::empty();
        for ca in CertificateDer::pem_slice_iter(ca) {
            roots.add(ca.map_err(|e| bad("CA", e))?).map_err(|e| bad("CA", e))?;
        }
        if roots.is_empty() {
            return Err(bad("CA", "no certificate in the PEM"));
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
            .build()
            .map_err(|e| bad("client verifier", e))?;
        let server = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("server", e))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(|e| bad("server certificate", e))?;
        let client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| bad("client", e))?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(|e| bad("client certificate", e))?;
        Ok(TransferTls {
            acceptor: TlsAcceptor::from(Arc::new(server)),
            connector: TlsConnector::from(Arc::new(client)),
        })
    }

    /// From PEM files (see [`TransferTls::from_pem`]).
    pub fn from_files(
        chain: &std::path::Path,
        key: &std::path::Path,
        ca: &std::path::Path,
    ) -> Result<Self, TransferError> {
        let read = |p: &std::path::Path| {
            std::fs::read(p).map_err(|e| bad("file", format!("{}: {e}", p.display())))
        };
        Self::from_pem(&read(chain)?, &read(key)?, &read(ca)?)
    }

    /// The name a receiver at `host` must prove.
    pub(super) fn server_name(host: &str) -> Result<ServerName<'static>, TransferError> {
        ServerName::try_from(host.to_owned()).map_err(|e| bad("peer name", e))
    }
}
