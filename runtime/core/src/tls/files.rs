//! The files a process's TLS settings were read from, and what was last read from them: a
//! reload takes them again only when their bytes changed since they were last taken or
//! refused (a refused set, or files that cannot be read for the same reason, is reported
//! once, not at every look).

use std::path::PathBuf;
use std::sync::{Mutex, PoisonError};
use std::time::SystemTime;

use super::expiry::{self, Shown};
use super::{Reloaded, TlsError, read};

/// Files read together (certificate, key, CA), in a fixed order. A reload holds them for its
/// whole length, so two at once take turns.
#[derive(Debug)]
pub(crate) struct Files {
    paths: Vec<PathBuf>,
    /// What the first file's certificate is shown as, when the first file is a certificate.
    shows: Option<Shown>,
    seen: Mutex<Seen>,
}

#[derive(Debug)]
struct Seen {
    taken: Vec<Vec<u8>>,
    refused: Option<Vec<Vec<u8>>>,
    /// Why the files could not be read at the last look, if they could not.
    unread: Option<String>,
}

impl Seen {
    /// Whether `bytes` are those in use or those last refused.
    fn knows(&self, bytes: &[Vec<u8>]) -> bool {
        *bytes == self.taken[..] || self.refused.as_deref() == Some(bytes)
    }
}

impl Files {
    /// Reads `paths`, in order.
    pub(crate) fn read_all(paths: &[PathBuf]) -> Result<Vec<Vec<u8>>, TlsError> {
        paths.iter().map(|p| read(p)).collect()
    }

    /// `paths`, whose bytes `taken` are in use; the first is a certificate shown as `shows`,
    /// when given.
    pub(crate) fn new(paths: Vec<PathBuf>, shows: Option<Shown>, taken: Vec<Vec<u8>>) -> Self {
        Files { paths, shows, seen: Mutex::new(Seen { taken, refused: None, unread: None }) }
    }

    /// Reads the files again; when they changed, builds settings from them (in the order of
    /// the paths) and hands those to `take`, noting the new certificate (the first file, when
    /// it is one) at `now`. Files that do not build are read once more before they are refused
    /// (a read may have straddled a rewrite, as when kubelet swaps a Secret's files), and a
    /// refused set is kept out until the files change again. Unreadable files are an error
    /// once per reason.
    pub(crate) fn reload<T>(
        &self,
        now: SystemTime,
        build: impl Fn(&[Vec<u8>]) -> Result<T, TlsError>,
        take: impl FnOnce(T),
    ) -> Result<Reloaded, TlsError> {
        let mut seen = self.seen.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(mut bytes) = self.changed(&mut seen)? else { return Ok(Reloaded::Unchanged) };
        let mut built = build(&bytes);
        if built.is_err()
            && let Ok(again) = Self::read_all(&self.paths)
            && again != bytes
        {
            // Back to the set in use, or to the one refused: the torn read was all there was.
            if seen.knows(&again) {
                return Ok(Reloaded::Unchanged);
            }
            built = build(&again);
            bytes = again;
        }
        match built {
            Err(e) => {
                seen.refused = Some(bytes);
                Err(e)
            }
            Ok(settings) => {
                take(settings);
                if let Some(shown) = self.shows {
                    expiry::note_pem(shown, &bytes[0], now);
                }
                *seen = Seen { taken: bytes, refused: None, unread: None };
                Ok(Reloaded::Taken)
            }
        }
    }

    /// The files' bytes when they differ from those in use and from those last refused; why
    /// they cannot be read, when that differs from the last look's reason.
    fn changed(&self, seen: &mut Seen) -> Result<Option<Vec<Vec<u8>>>, TlsError> {
        let now = match Self::read_all(&self.paths) {
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
        Ok((!seen.knows(&now)).then_some(now))
    }
}
