//! What a process's TLS settings hold that a reload replaces: its certificate and key, and
//! the verifiers built from its CA. rustls takes them through the traits below, asked once
//! per handshake, so every acceptor and connector built once at startup (the transfers', the
//! directories', the gRPC servers' and channels') takes a reloaded certificate at its next
//! handshake; connections already up keep the one they began with.

use std::sync::{Arc, PoisonError, RwLock};

use rustls::client::ResolvesClientCert;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert};
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
