//! What a process's TLS settings hold that a reload replaces: its certificate and key, and
//! the verifiers built from its CA. rustls takes them through the traits below, asked once
//! per handshake, so every acceptor and connector built once at startup (the transfers', the
//! directories', the gRPC servers' and channels') takes a reloaded certificate at its next
//! handshake; connections already up keep the one they began with, and check their peer
//! again with the new verifiers at their next use ([`super::Rechecked`]). A public listener's store
//! of TLS sessions to resume is replaced empty at each reload too (the cluster's own
//! connections resume none).

use std::sync::{Arc, PoisonError, RwLock};

use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{
    ClientHello, ResolvesServerCert, ServerSessionMemoryCache, StoresServerSessions,
};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, SignatureScheme};

/// A value replaced whole, read by every handshake.
#[derive(Debug)]
pub(crate) struct Swap<T: ?Sized>(RwLock<Arc<T>>);

impl<T: ?Sized> Swap<T> {
    pub(crate) fn new(v: Arc<T>) -> Arc<Self> {
        Arc::new(Swap(RwLock::new(v)))
    }

    pub(crate) fn get(&self) -> Arc<T> {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    pub(crate) fn set(&self, v: Arc<T>) {
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = v;
    }
}

/// The certificate and key shown now, to clients and to servers.
#[derive(Debug)]
pub(crate) struct KeyOf(pub(crate) Arc<Swap<CertifiedKey>>);

impl ResolvesServerCert for KeyOf {
    fn resolve(&self, _: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get())
    }
}

impl ResolvesClientCert for KeyOf {
    fn resolve(&self, _: &[&[u8]], _: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.get())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The clients trusted now (a listener's side).
#[derive(Debug)]
pub(crate) struct ClientTrust(pub(crate) Arc<Swap<dyn ClientCertVerifier>>);

impl ClientCertVerifier for ClientTrust {
    /// No hints of the CA's names: they would have to outlive a reload. A client then shows
    /// the certificate it has (each of ours has one).
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        self.0.get().verify_client_cert(end_entity, intermediates, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.get().supported_verify_schemes()
    }
}

/// The servers trusted now (a dialer's side).
#[derive(Debug)]
pub(crate) struct ServerTrust(pub(crate) Arc<Swap<dyn ServerCertVerifier>>);

impl ServerCertVerifier for ServerTrust {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        self.0.get().verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.get().verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.get().supported_verify_schemes()
    }
}

/// The sessions a listener can resume, a fresh store from each reload on: a session begun
/// under the certificate or the trust before it is not resumed past it (a client of a CA
/// taken out of the bundle would otherwise go on resuming, unchecked, for a day). A session
/// is stored as its handshake ends, which the client decides: one whose client was checked
/// before a reload and stored after it lands in the new store. A connection that resumes it
/// has its client's chain checked again at its first use ([`super::Rechecked`]).
#[derive(Debug)]
pub(crate) struct ServerSessions(pub(crate) Arc<Swap<dyn StoresServerSessions>>);

/// Sessions a listener keeps (rustls's default).
pub(crate) fn server_sessions() -> Arc<dyn StoresServerSessions> {
    ServerSessionMemoryCache::new(256)
}

impl StoresServerSessions for ServerSessions {
    fn put(&self, key: Vec<u8>, value: Vec<u8>) -> bool {
        self.0.get().put(key, value)
    }

    fn get(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.0.get().get(key)
    }

    fn take(&self, key: &[u8]) -> Option<Vec<u8>> {
        self.0.get().take(key)
    }

    fn can_cache(&self) -> bool {
        self.0.get().can_cache()
    }
}
