//! [`ServerAccess`]: how a process reaches an etcd or NATS server that wants TLS or
//! credentials. Everything is passed to the server's own client library.

use std::path::PathBuf;
use std::time::Duration;

/// TLS and credentials for one discovery server (all optional; none means plain and
/// anonymous).
#[derive(Debug, Clone, Default)]
pub struct ServerAccess {
    /// The CA that signed the server's certificate (PEM file); implies TLS.
    pub ca: Option<PathBuf>,
    /// A client certificate and its key (PEM files), for servers that verify clients.
    pub identity: Option<(PathBuf, PathBuf)>,
    /// A user name and password.
    pub user: Option<(String, String)>,
    /// A NATS credentials file (JWT and NKey seed); NATS only.
    pub credentials: Option<PathBuf>,
    /// How often the TLS files are read again (`None`: once): etcd's client is made again
    /// when they changed. NATS's library reads them again itself, at each reconnect.
    pub tls_reload: Option<Duration>,
}

impl ServerAccess {
    /// Whether connections use TLS.
    pub fn tls(&self) -> bool {
        self.ca.is_some() || self.identity.is_some()
    }
}
