//! [`Link`]: the etcd client in use. etcd's client library builds its TLS once, from PEM, so
//! a renewed client certificate (or a changed CA) is taken by making the client again. The
//! files are read again every `--tls-reload-secs` ([`HandedTls`]); after a look that took a
//! set, a new client is made at once ([`Link::renew`]) and used only once etcd has answered
//! it (a set that passes our checks can still be refused by etcd: another issuer, a CA
//! replaced rather than bundled). A client etcd does not answer is not used: the one in use is
//! kept, the set counted as refused and warned of, and tried again at the next look or call
//! [`RETRY_AFTER`] or more later. Only the caller making a client waits for it; the others
//! get the one in use at once. The expiry gauge shows the certificate of the client in use.
//! The lease keeper and the watches ask for the client each time they start over after an
//! error. Calls and streams already running go on with the client they began with: etcd does
//! not check a certificate again on a connection that is up.

use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, SystemTime};

use etcd_client::{Certificate, Client, ConnectOptions, GetOptions, Identity, TlsOptions};
use handoff_core::tls::reload::refused_later;
use handoff_core::tls::{HandedPem, HandedTls};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{KEY_PREFIX, patience};

/// How long a new client has to be made and answered.
const TRY_WITHIN: Duration = Duration::from_secs(5);

/// How long after a new client failed a caller tries again.
const RETRY_AFTER: Duration = Duration::from_secs(2);

/// The etcd client in use, and how to make it again (see the module docs).
pub(crate) struct Link {
    endpoints: Vec<String>,
    /// Everything but TLS.
    options: ConnectOptions,
    tls: Option<HandedTls>,
    made: Mutex<Made>,
}

struct Made {
    client: Client,
    renewal: Renewal,
}

/// Where making the client again stands.
#[derive(Debug, Default)]
struct Renewal {
    /// The generation of the TLS files the client in use was made with.
    generation: u64,
    /// The last generation a new client could not be made with (said once), and when a
    /// caller may try again.
    failed: Option<(u64, Instant)>,
    /// A caller is making a new client.
    trying: bool,
}

impl Renewal {
    /// Whether a caller at `now` makes a new client with files of `generation`: not when
    /// the client in use has them, nor while another caller makes one (it gets the client in
    /// use at once), nor within [`RETRY_AFTER`] of a failure with the same files.
    fn due(&self, generation: u64, now: Instant) -> bool {
        generation != self.generation
            && !self.trying
            && self.failed.is_none_or(|(g, at)| g != generation || now >= at)
    }

    /// Notes a failure with files of `generation` at `now`; whether it is the first with
    /// them (to be said).
    fn note_failure(&mut self, generation: u64, now: Instant) -> bool {
        let said = self.failed.is_some_and(|(g, _)| g == generation);
        self.failed = Some((generation, now + RETRY_AFTER));
        !said
    }
}

/// Why a client made with new files was not used.
#[derive(Debug)]
enum NotAnswered {
    /// etcd refused it, or could not be reached.
    Etcd(etcd_client::Error),
    /// No answer within [`TRY_WITHIN`].
    Late,
}

impl std::fmt::Display for NotAnswered {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NotAnswered::Etcd(e) => f.write_str(&patience::causes(e)),
            NotAnswered::Late => write!(f, "no answer in {TRY_WITHIN:?}"),
        }
    }
}

/// Marks a try at a new client in progress; unmarks it when dropped (also when the caller
/// is cancelled mid-way).
struct Trying<'a>(&'a Link);

impl Drop for Trying<'_> {
    fn drop(&mut self) {
        self.0.made().renewal.trying = false;
    }
}

/// `options` with `pem`'s TLS, if any.
fn with_tls(options: &ConnectOptions, pem: Option<&HandedPem>) -> ConnectOptions {
    let Some(pem) = pem else { return options.clone() };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &pem.ca {
        tls = tls.ca_certificate(Certificate::from_pem(ca));
    }
    if let Some((cert, key)) = &pem.identity {
        tls = tls.identity(Identity::from_pem(cert, key));
    }
    options.clone().with_tls(tls)
}

impl Link {
    /// A client of `endpoints` with `options` and `tls`'s files (as they are at each try),
    /// waited for while etcd is not reached, until `stop`. `look` runs before each try (so
    /// that a process waiting for etcd takes files renewed meanwhile).
    pub(crate) async fn connect(
        endpoints: Vec<String>,
        options: ConnectOptions,
        tls: Option<HandedTls>,
        look: impl Fn(),
        stop: &CancellationToken,
    ) -> Result<Self, etcd_client::Error> {
        let (client, generation) = patience::until_reached("connected", stop, || {
            look();
            let pem = tls.as_ref().map(HandedTls::current);
            let opts = with_tls(&options, pem.as_ref());
            let generation = pem.map_or(0, |p| p.generation);
            let endpoints = &endpoints;
            async move { Client::connect(endpoints, Some(opts)).await.map(|c| (c, generation)) }
        })
        .await?;
        if let (Some(tls), true) = (&tls, generation > 0) {
            tls.shown_in_use(&tls.current(), SystemTime::now());
        }
        let renewal = Renewal { generation, ..Renewal::default() };
        let made = Mutex::new(Made { client, renewal });
        Ok(Link { endpoints, options, tls, made })
    }

    fn made(&self) -> MutexGuard<'_, Made> {
        self.made.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The client in use, without trying a new one (for calls at shutdown).
    pub(crate) fn current(&self) -> Client {
        self.made().client.clone()
    }

    /// Makes a new client now if the files changed since the one in use was made (after a
    /// look that took a set, or one that etcd refused before).
    pub(crate) async fn renew(&self) {
        let _ = self.client().await;
    }

    /// The client in use, made again first when the TLS files changed since it was made
    /// (see the module docs).
    pub(crate) async fn client(&self) -> Client {
        let due = {
            let mut made = self.made();
            let now = Instant::now();
            let current = self.tls.as_ref().map(HandedTls::current);
            let due = current.filter(|pem| made.renewal.due(pem.generation, now));
            match due {
                None => return made.client.clone(),
                Some(pem) => {
                    made.renewal.trying = true;
                    pem
                }
            }
        };
        let _trying = Trying(self);
        let outcome = self.answered(&due).await;
        let mut made = self.made();
        match outcome {
            Ok(client) => {
                info!("etcd client made again with its renewed TLS files");
                made.client = client;
                (made.renewal.generation, made.renewal.failed) = (due.generation, None);
                if let Some(tls) = &self.tls {
                    tls.shown_in_use(&due, SystemTime::now());
                }
            }
            Err(error) => {
                if made.renewal.note_failure(due.generation, Instant::now()) {
                    if let Some(tls) = &self.tls {
                        refused_later(tls.shown());
                    }
                    warn!(%error, "etcd client not made again with its renewed TLS files: the one in use kept, tried again at a later look or call");
                }
            }
        }
        made.client.clone()
    }

    /// A client made with `pem`, once etcd has answered it (refusing it permission to read
    /// the key prefix is an answer: its certificate was taken).
    async fn answered(&self, pem: &HandedPem) -> Result<Client, NotAnswered> {
        let opts = with_tls(&self.options, Some(pem));
        let made = async {
            let mut client = Client::connect(&self.endpoints, Some(opts)).await?;
            let count = GetOptions::new().with_prefix().with_count_only();
            match client.get(KEY_PREFIX, Some(count)).await {
                Err(etcd_client::Error::GRpcStatus(s))
                    if s.code() == tonic::Code::PermissionDenied => {}
                answer => drop(answer?),
            }
            Ok::<_, etcd_client::Error>(client)
        };
        match tokio::time::timeout(TRY_WITHIN, made).await {
            Ok(made) => made.map_err(NotAnswered::Etcd),
            Err(_) => Err(NotAnswered::Late),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A client is made again only with files it was not made with; while one caller makes
    /// it, no other does (they get the client in use); after a failure, not with the same
    /// files for [`RETRY_AFTER`], but at once with newer ones; a failure is said once a set.
    #[test]
    fn a_renewal_is_tried_once_at_a_time_and_held_off_after_a_failure() {
        let t0 = Instant::now();
        let mut r = Renewal { generation: 1, ..Renewal::default() };
        assert!(!r.due(1, t0), "the files in use");
        assert!(r.due(2, t0), "renewed files");
        r.trying = true;
        assert!(!r.due(2, t0), "another caller is making it");
        r.trying = false;
        assert!(r.note_failure(2, t0), "the first failure with these files is said");
        assert!(!r.note_failure(2, t0), "and only the first");
        assert!(!r.due(2, t0 + RETRY_AFTER / 2), "held off");
        assert!(r.due(2, t0 + RETRY_AFTER), "tried again after the hold-off");
        assert!(r.due(3, t0), "newer files at once");
        assert!(r.note_failure(3, t0), "a failure with newer files is said");
    }
}
