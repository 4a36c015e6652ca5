//! The files a process's TLS settings were read from, and what was last read from them: a
//! reload takes them again only when their bytes changed since they were last taken or
//! refused (a refused set, or files that cannot be read for the same reason, is reported
//! once, not at every look).

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use super::expiry::{self, Shown};
use super::{Reloaded, TlsError, read};

/// Files read together (certificate, key, CA), in a fixed order.
#[derive(Debug)]
pub(crate) struct Files {
    paths: Vec<PathBuf>,
    seen: Mutex<Seen>,
}

#[derive(Debug)]
struct Seen {
    taken: Vec<Vec<u8>>,
    refused: Option<Vec<Vec<u8>>>,
    /// Why the files could not be read at the last look, if they could not.
    unread: Option<String>,
}

impl Files {
    /// Reads `paths`, in order.
    pub(crate) fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, TlsError> {
        paths.iter().map(|p| read(p)).collect()
    }

    /// `paths`, whose bytes `taken` are in use.
    pub(crate) fn new(paths: Vec<PathBuf>, taken: Vec<Vec<u8>>) -> Self {
        Files { paths, seen: Mutex::new(Seen { taken, refused: None, unread: None }) }
    }

    /// The files' bytes when they differ from those in use and from those last refused; why
    /// they cannot be read, when that differs from the last look's reason.
    fn changed(&self) -> Result<Option<Vec<Vec<u8>>>, TlsError> {
        let read = Self::read_all(&self.paths);
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let now = match read {
            Ok(now) => now,
            Err(e) => {
                let why = e.to_string();
                return match seen.unread.replace(why.clone()) {
                    Some(last) if last == why => Ok(None),
                    _ => Err(e),
                };
            }
        };
        seen.unread = None;
        let known = now == seen.taken || seen.refused.as_ref() == Some(&now);
        Ok((!known).then_some(now))
    }

    /// Reads the files again; when they changed, builds settings from them (in the order of
    /// the paths) and hands those to `take`, noting the new certificate (the first file) as
    /// `shown` at `now`; when they do not build, keeps them out until they change again.
    pub(crate) fn reload<T>(
        &self,
        shown: Shown,
        now: SystemTime,
        build: impl FnOnce(&[Vec<u8>]) -> Result<T, TlsError>,
        take: impl FnOnce(T),
    ) -> Result<Reloaded, TlsError> {
        let Some(bytes) = self.changed()? else { return Ok(Reloaded::Unchanged) };
        match build(&bytes) {
            Err(e) => {
                self.refused(bytes);
                Err(e)
            }
            Ok(settings) => {
                take(settings);
                expiry::note_pem(shown, &bytes[0], now);
                self.taken(bytes);
                Ok(Reloaded::Taken)
            }
        }
    }

    /// `bytes` are in use now.
    fn taken(&self, bytes: Vec<Vec<u8>>) {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        *seen = Seen { taken: bytes, refused: None, unread: None };
    }

    /// `bytes` were refused: not tried again until they change.
    fn refused(&self, bytes: Vec<Vec<u8>>) {
        self.seen.lock().unwrap_or_else(PoisonError::into_inner).refused = Some(bytes);
    }
}
