//! When the certificates a process shows expire: read from each certificate's validity at
//! startup, warned of when near, and shown on every role's `/metrics` as
//! `handoff_tls_certificate_expiry_timestamp_seconds{certificate}` (the process's own
//! registry, like its served traffic), so an operator can alert before one runs out. The
//! cluster's and the public certificates are noted again at each reload ([`super::reload`]),
//! the etcd client's once a client made with a reloaded set is in use; the NATS client's is
//! read at startup only (its library reads the file again at each reconnect, unseen).

use std::sync::{Arc, OnceLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::CertificateDer;

use crate::metrics::{Counter, Family, Gauge, Registry};

/// Which certificate of the process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Shown {
    /// The cluster's (`--tls-cert`): transfers, internal gRPC, directories.
    Cluster,
    /// The public API's (`--public-tls-cert`).
    Public,
    /// The etcd client's (`--etcd-cert`).
    EtcdClient,
    /// The NATS client's (`--nats-cert`; its library reads the file again at each
    /// reconnect, so a renewed one is taken then).
    NatsClient,
}

impl Shown {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Shown::Cluster => "cluster",
            Shown::Public => "public",
            Shown::EtcdClient => "etcd_client",
            Shown::NatsClient => "nats_client",
        }
    }
}

/// How long before its end a certificate is warned of at startup.
pub const WARN_BEFORE: Duration = Duration::from_secs(14 * 24 * 3600);

/// The process's certificate metrics.
struct Certificates {
    registry: Arc<Registry>,
    expiry: Arc<Family<Gauge>>,
    reloads: Arc<Family<Counter>>,
    cuts: Arc<Family<Counter>>,
}

fn certificates() -> &'static Certificates {
    static CERTIFICATES: OnceLock<Certificates> = OnceLock::new();
    CERTIFICATES.get_or_init(|| {
        let registry = Registry::new();
        let expiry = registry.gauges(
            "handoff_tls_certificate_expiry_timestamp_seconds",
            "When the certificate this process shows stops being valid (Unix seconds), by \
             certificate (cluster, public, etcd_client, nats_client). Read at startup, and for \
             cluster and public at each reload of their files, for etcd_client once a client \
             made with new files is in use, for nats_client at each connect of NATS's client.",
            &["certificate"],
        );
        let reloads = registry.counters(
            "handoff_tls_reloads_total",
            "Looks at certificate files that found them changed, by certificate (cluster, \
             public) and outcome: taken, or refused (unusable or unreadable, once per set or \
             reason: the certificate in use is kept).",
            &["certificate", "outcome"],
        );
        let cuts = registry.counters(
            "handoff_tls_connections_cut_total",
            "Connections cut because a reload took a CA file that refuses their peer, by \
             certificate (cluster, public: whose CA file). Each connection's peer is checked \
             again at its next read or write after such a reload, a pooled one before reuse.",
            &["certificate"],
        );
        Certificates { registry, expiry, reloads, cuts }
    })
}

/// The registry of the process's certificate expiries and reloads (rendered with every
/// role's metrics).
pub fn expiry_registry() -> &'static Arc<Registry> {
    &certificates().registry
}

/// The reloads counted ([`super::reload`]).
pub(crate) fn reloads() -> &'static Arc<Family<Counter>> {
    &certificates().reloads
}

/// The connections cut after a reload of a CA file ([`super::Rechecked`]).
pub(crate) fn cuts() -> &'static Arc<Family<Counter>> {
    &certificates().cuts
}

/// Records when `cert` (the leaf the process shows as `shown`) expires, and warns when it
/// has or will within [`WARN_BEFORE`] of `now`. A certificate whose validity cannot be read
/// is not recorded (rustls has taken it: this is only a reading of its dates).
pub fn note(shown: Shown, cert: &CertificateDer<'_>, now: SystemTime) {
    let Some(end) = not_after(cert) else {
        tracing::warn!(certificate = shown.label(), "TLS certificate's validity not readable");
        return;
    };
    let secs = end.duration_since(UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
    certificates().expiry.with(&[shown.label()]).set(secs);
    if let Some(w) = warning(end, now) {
        tracing::warn!(certificate = shown.label(), "TLS certificate {w}");
    }
}

/// Notes the first certificate of the PEM `chain` (see [`note`]); a chain that does not parse
/// is left to whoever uses it to refuse.
pub fn note_pem(shown: Shown, chain: &[u8], now: SystemTime) {
    if let Some(leaf) = super::chain_of(chain).ok().and_then(|c| c.into_iter().next()) {
        note(shown, &leaf, now);
    }
}

/// What to warn of for a certificate valid until `end`, at `now`: nothing while more than
/// [`WARN_BEFORE`] is left.
pub fn warning(end: SystemTime, now: SystemTime) -> Option<String> {
    match end.duration_since(now) {
        Err(ago) => Some(format!("expired {} ago: peers refuse it", days(ago.duration()))),
        Ok(left) if left <= WARN_BEFORE => Some(format!("expires in {}: renew it", days(left))),
        Ok(_) => None,
    }
}

fn days(d: Duration) -> String {
    let hours = d.as_secs() / 3600;
    if hours < 48 { format!("{hours} h") } else { format!("{} days", hours / 24) }
}

/// The end of `cert`'s validity (its `notAfter`), read from its DER.
pub fn not_after(cert: &CertificateDer<'_>) -> Option<SystemTime> {
    // Certificate ::= SEQUENCE { tbsCertificate SEQUENCE { [0] version OPTIONAL,
    //   serialNumber, signature, issuer, validity SEQUENCE { notBefore, notAfter }, ... } }
    let (0x30, cert, _) = element(cert.as_ref())? else { return None };
    let (0x30, mut tbs, _) = element(cert)? else { return None };
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs)?.2;
    }
    for _ in 0..3 {
        tbs = element(tbs)?.2; // serialNumber, signature, issuer
    }
    let (0x30, validity, _) = element(tbs)? else { return None };
    let (_, _, rest) = element(validity)?;
    let (tag, time, _) = element(rest)?;
    let secs = match tag {
        0x17 => utc_time(time)?,
        0x18 => generalized_time(time)?,
        _ => return None,
    };
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

/// The first DER element of `b`: its tag, its content and what follows it.
fn element(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        usize::from(first)
    } else {
        let n = usize::from(first & 0x7f);
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |l, &d| (l << 8) | usize::from(d));
        b = &b[n..];
        len
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

/// `YYMMDDHHMMSSZ`, years 1950-2049 (RFC 5280).
fn utc_time(t: &[u8]) -> Option<u64> {
    let (&b'Z', t) = t.split_last()? else { return None };
    if t.len() != 12 {
        return None;
    }
    let yy = digits(&t[..2])?;
    let year = if yy >= 50 { 1900 + yy } else { 2000 + yy };
    seconds(year, &t[2..])
}

/// `YYYYMMDDHHMMSSZ` (RFC 5280: no fractions).
fn generalized_time(t: &[u8]) -> Option<u64> {
    let (&b'Z', t) = t.split_last()? else { return None };
    if t.len() != 14 {
        return None;
    }
    seconds(digits(&t[..4])?, &t[4..])
}

/// Seconds since 1970 of `year` and `MMDDHHMMSS`.
fn seconds(year: u64, t: &[u8]) -> Option<u64> {
    let (month, day) = (digits(&t[..2])?, digits(&t[2..4])?);
    let (h, m, s) = (digits(&t[4..6])?, digits(&t[6..8])?, digits(&t[8..10])?);
    let leap = year.is_multiple_of(4) && (!year.is_multiple_of(100) || year.is_multiple_of(400));
    let month_days = match month {
        2 if leap => 29,
        2 => 28,
        4 | 6 | 9 | 11 => 30,
        _ => 31,
    };
    let valid = (1..=12).contains(&month) && (1..=month_days).contains(&day);
    let valid = valid && h < 24 && m < 60 && s < 61;
    if !valid || year < 1970 {
        return None;
    }
    Some(days_since_1970(year, month, day) * 86_400 + h * 3600 + m * 60 + s)
}

fn digits(d: &[u8]) -> Option<u64> {
    d.iter().try_fold(0, |n, &c| c.is_ascii_digit().then(|| n * 10 + u64::from(c - b'0')))
}

/// Days from 1970-01-01 to a date of the proleptic Gregorian calendar.
fn days_since_1970(year: u64, month: u64, day: u64) -> u64 {
    // Years counted from March, so a leap day ends its year.
    let y = if month <= 2 { year - 1 } else { year };
    let era = y / 400;
    let of_era = y % 400;
    let m = (month + 9) % 12; // March 0 .. February 11
    let of_year = (153 * m + 2) / 5 + day - 1;
    let of_era_days = of_era * 365 + of_era / 4 - of_era / 100 + of_year;
    era * 146_097 + of_era_days - 719_468
}

#[cfg(test)]
mod tests;
