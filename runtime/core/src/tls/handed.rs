//! [`HandedTls`]: TLS files a process hands, as PEM, to a client library that builds its TLS
//! from them once (etcd's client). They are checked as ours are (the key must be the
//! certificate's, the CA must parse) and read again at each reload ([`super::reload`]): a
//! changed, usable set moves the generation of [`HandedTls::current`], and the library's
//! owner makes its client again from it. The certificate's end is shown when it is read at
//! startup; after that by the owner, once a client made with a new set is in use
//! ([`HandedTls::shown_in_use`]), so that the gauge never shows a set the server refused.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use super::expiry::{self, Shown};
use super::files::Files;
use super::{Reloaded, TlsError, certified, roots_of, unexpired};

/// A client certificate and its key, and a CA, as handed to a library (see the module docs).
/// Clones share the set: a reload reaches every one.
#[derive(Clone)]
pub struct HandedTls {
    inner: Arc<Handed>,
}

struct Handed {
    shown: Shown,
    /// The files: the certificate and key first when there are, then the CA when there is.
    files: Files,
    layout: Layout,
    current: Mutex<HandedPem>,
}

/// Which files there are.
#[derive(Clone, Copy)]
struct Layout {
    identity: bool,
    ca: bool,
}

/// The set in use.
#[derive(Clone, PartialEq, Eq)]
pub struct HandedPem {
    /// Counts the sets taken: 0 for the one read at startup, then one more at each reload
    /// that took a set.
    pub generation: u64,
    /// The client certificate chain and its key (PEM).
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
    /// The CA to trust servers by (PEM).
    pub ca: Option<Vec<u8>>,
}

impl std::fmt::Debug for HandedPem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let chain = self.identity.as_ref().map(|(c, _)| String::from_utf8_lossy(c));
        f.debug_struct("HandedPem")
            .field("generation", &self.generation)
            .field("chain", &chain)
            .field("key", &self.identity.as_ref().map(|_| "(not shown)"))
            .field("ca", &self.ca.as_ref().map(|c| String::from_utf8_lossy(c)))
            .finish()
    }
}

impl std::fmt::Debug for HandedTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HandedTls").field("certificate", &self.inner.shown).finish_non_exhaustive()
    }
}

impl Layout {
    /// The set in `bytes` (in the files' order), checked; a certificate ended by `now`, when
    /// given, is refused.
    fn check(self, bytes: &[Vec<u8>], now: Option<SystemTime>) -> Result<HandedPem, TlsError> {
        let mut next = bytes.iter().cloned();
        let mut take = || next.next().ok_or_else(|| super::invalid("files", "fewer than named"));
        let mut identity = None;
        if self.identity {
            let (chain, key) = (take()?, take()?);
            let certified = certified(&chain, &key)?;
            if let Some(now) = now {
                unexpired(&certified, now)?;
            }
            identity = Some((chain, key));
        }
        let mut ca = None;
        if self.ca {
            let pem = take()?;
            roots_of(&pem)?;
            ca = Some(pem);
        }
        Ok(HandedPem { generation: 0, identity, ca })
    }
}

impl HandedTls {
    /// Reads a client certificate and its key, a CA, or both (`None` when neither is
    /// named), checked; the certificate's end is shown as `shown` ([`expiry`]).
    pub fn from_files(
        shown: Shown,
        identity: Option<(&Path, &Path)>,
        ca: Option<&Path>,
    ) -> Result<Option<Self>, TlsError> {
        let mut paths: Vec<PathBuf> = Vec::new();
        if let Some((cert, key)) = identity {
            paths.extend([cert.to_owned(), key.to_owned()]);
        }
        paths.extend(ca.map(Path::to_owned));
        if paths.is_empty() {
            return Ok(None);
        }
        let bytes = Files::read_all(&paths)?;
        let layout = Layout { identity: identity.is_some(), ca: ca.is_some() };
        let pem = layout.check(&bytes, None)?;
        if let Some((chain, _)) = &pem.identity {
            expiry::note_pem(shown, chain, SystemTime::now());
        }
        let files = Files::new(paths, None, bytes);
        let handed = Handed { shown, files, layout, current: Mutex::new(pem) };
        Ok(Some(HandedTls { inner: Arc::new(handed) }))
    }

    /// Which certificate this is, for logs and counters.
    pub fn shown(&self) -> Shown {
        self.inner.shown
    }

    /// Shows the end of `pem`'s certificate (if it has one), now that a client made with it
    /// is in use.
    pub fn shown_in_use(&self, pem: &HandedPem, now: SystemTime) {
        if let Some((chain, _)) = &pem.identity {
            expiry::note_pem(self.inner.shown, chain, now);
        }
    }

    /// The set in use.
    pub fn current(&self) -> HandedPem {
        self.inner.current.lock().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// Reads the files again and takes them when they changed and are usable (a certificate
    /// that has ended by `now` is not); unusable ones are refused, once, and the set in use
    /// kept ([`super::ClusterTls::reload`] likewise).
    pub fn reload(&self, now: SystemTime) -> Result<Reloaded, TlsError> {
        let held = &self.inner;
        held.files.reload(
            now,
            |b| held.layout.check(b, Some(now)),
            |pem| {
                let mut current = held.current.lock().unwrap_or_else(PoisonError::into_inner);
                *current = HandedPem { generation: current.generation + 1, ..pem };
            },
        )
    }
}

#[cfg(test)]
mod tests;
