//! Certificates made on the spot, for tests and benchmarks (feature `test-certs`).

use std::time::Duration;

use super::{ClusterTls, ServerTls};

/// A throwaway CA that signs certificates for `127.0.0.1` and `localhost`.
pub struct TestCa {
    params: rcgen::CertificateParams,
    key: rcgen::KeyPair,
    pem: String,
}

impl std::fmt::Debug for TestCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TestCa")
    }
}

/// A signed certificate and its key, PEM.
#[derive(Debug, Clone)]
pub struct TestCert {
    /// The certificate.
    pub cert: String,
    /// Its private key.
    pub key: String,
    /// The CA that signed it.
    pub ca: String,
}

impl TestCert {
    /// As the cluster's TLS settings.
    pub fn cluster(&self) -> ClusterTls {
        self.trusting(&self.ca)
    }

    /// As the cluster's TLS settings of a peer that shows this certificate and trusts the
    /// CA `ca_pem` (another than its signer: a stranger, or a cluster in a CA change).
    pub fn trusting(&self, ca_pem: &str) -> ClusterTls {
        ClusterTls::from_pem(self.cert.as_bytes(), self.key.as_bytes(), ca_pem.as_bytes())
            .expect("a test certificate is usable")
    }

    /// As a public endpoint's.
    pub fn server(&self) -> ServerTls {
        ServerTls::from_pem(self.cert.as_bytes(), self.key.as_bytes(), None)
            .expect("a test certificate is usable")
    }
}

impl TestCa {
    /// A new CA.
    pub fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().expect("CA key");
        let pem = params.self_signed(&key).expect("self-signed CA").pem();
        TestCa { params, key, pem }
    }

    /// The CA's certificate, PEM.
    pub fn pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for `127.0.0.1` and `localhost`, signed by this CA.
    pub fn issue(&self) -> TestCert {
        self.issue_for(&["127.0.0.1", "localhost"])
    }

    /// A certificate for `names` only, signed by this CA.
    pub fn issue_for(&self, names: &[&str]) -> TestCert {
        self.sign(names, |_| {})
    }

    /// A certificate for `127.0.0.1` and `localhost` that expired in 2001.
    pub fn issue_expired(&self) -> TestCert {
        self.sign(&["127.0.0.1", "localhost"], |p| {
            p.not_before = rcgen::date_time_ymd(2000, 1, 1);
            p.not_after = rcgen::date_time_ymd(2001, 1, 1);
        })
    }

    /// A certificate for `127.0.0.1` and `localhost` valid until `after` past midnight
    /// (UTC) of the day `(year, month, day)`, and from a year before that.
    pub fn issue_until(&self, (year, month, day): (i32, u8, u8), after: Duration) -> TestCert {
        self.sign(&["127.0.0.1", "localhost"], |p| {
            p.not_after = rcgen::date_time_ymd(year, month, day) + after;
            p.not_before = p.not_after - Duration::from_secs(365 * 86_400);
        })
    }

    /// A certificate for `127.0.0.1` and `localhost` valid from 2000 until midnight (UTC)
    /// of the day `(year, month, day)`.
    pub fn issue_valid_until(&self, (year, month, day): (i32, u8, u8)) -> TestCert {
        self.sign(&["127.0.0.1", "localhost"], |p| {
            p.not_before = rcgen::date_time_ymd(2000, 1, 1);
            p.not_after = rcgen::date_time_ymd(year, month, day);
        })
    }

    fn sign(&self, names: &[&str], adjust: impl FnOnce(&mut rcgen::CertificateParams)) -> TestCert {
        let issuer = rcgen::Issuer::from_params(&self.params, &self.key);
        let key = rcgen::KeyPair::generate().expect("key");
        let names = names.iter().map(|&n| n.to_owned()).collect::<Vec<_>>();
        let mut params = rcgen::CertificateParams::new(names).expect("params");
        adjust(&mut params);
        let cert = params.signed_by(&key, &issuer).expect("signed");
        TestCert { cert: cert.pem(), key: key.serialize_pem(), ca: self.pem.clone() }
    }
}

/// Certificate files in a directory of their own (removed when dropped), as a process reads
/// them: `tls.crt`, `tls.key` and `ca.crt`, as in a Kubernetes TLS Secret.
#[derive(Debug)]
pub struct CertFiles {
    dir: std::path::PathBuf,
}

impl CertFiles {
    /// An empty directory.
    pub fn empty() -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("handoff-cert-files-{}-{n}", std::process::id());
        let dir = std::env::temp_dir().join(name);
        std::fs::create_dir_all(&dir).expect("a directory for certificate files");
        CertFiles { dir }
    }

    /// `cert` and its key, with `ca` (PEM, a bundle or one CA) as the CA file.
    pub fn new(cert: &TestCert, ca: &str) -> Self {
        let files = Self::empty();
        files.put("ca.crt", ca);
        files.put_cert(cert);
        files
    }

    /// The file `name` in the directory.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// Replaces `name` whole, as a Secret's update does (a new file renamed over the old).
    pub fn put(&self, name: &str, body: &str) {
        let staged = self.path(&format!(".{name}.new"));
        std::fs::write(&staged, body).expect("a certificate file written");
        std::fs::rename(staged, self.path(name)).expect("a certificate file renamed");
    }

    /// Replaces the key and the certificate with `cert`'s (the key first).
    pub fn put_cert(&self, cert: &TestCert) {
        self.put("tls.key", &cert.key);
        self.put("tls.crt", &cert.cert);
    }

    /// The cluster's TLS settings read from these files ([`ClusterTls::from_files`]).
    pub fn cluster(&self) -> ClusterTls {
        let p = |n: &str| self.path(n);
        ClusterTls::from_files(&p("tls.crt"), &p("tls.key"), &p("ca.crt"))
            .expect("test certificate files are usable")
    }

    /// A public endpoint's settings read from these files, the CA file as its client CA
    /// ([`ServerTls::from_files`]).
    pub fn public(&self) -> ServerTls {
        let p = |n: &str| self.path(n);
        ServerTls::from_files(&p("tls.crt"), &p("tls.key"), Some(&p("ca.crt")))
            .expect("test certificate files are usable")
    }
}

impl Drop for CertFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Default for TestCa {
    fn default() -> Self {
        Self::new()
    }
}
