use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::CertificateDer;

use super::*;
use crate::tls::test_certs::TestCa;

fn leaf(pem: &str) -> CertificateDer<'static> {
    crate::tls::chain_of(pem.as_bytes()).unwrap().remove(0)
}

fn at(secs: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(secs)
}

#[test]
fn the_end_of_validity_is_read_in_both_time_formats() {
    let ca = TestCa::new();
    // UTCTime up to 2049, GeneralizedTime from 2050 (RFC 5280); a leap day; a time of day.
    for (day, after, want) in [
        ((2001, 1, 1), 0, 978_307_200),
        ((2024, 2, 29), 12 * 3600 + 34 * 60 + 56, 1_709_210_096),
        ((2049, 12, 31), 86_399, 2_524_607_999),
        ((2060, 6, 1), 0, 2_853_273_600),
        ((4096, 1, 1), 0, 67_090_118_400),
    ] {
        let cert = ca.issue_until(day, Duration::from_secs(after));
        assert_eq!(not_after(&leaf(&cert.cert)), Some(at(want)), "{day:?} + {after} s");
    }
}

#[test]
fn bytes_that_are_not_a_certificate_have_no_end() {
    let cert = leaf(&TestCa::new().issue().cert);
    let der = cert.as_ref();
    for cut in [0, 1, 2, 10, der.len() / 3, der.len() - 1] {
        // A cut certificate's outer length runs past its bytes.
        assert_eq!(not_after(&CertificateDer::from(&der[..cut])), None, "cut at {cut}");
    }
    for junk in [&[0x30, 0x85, 1, 2, 3, 4, 5][..], &[0x30, 0x80], &[0x02, 0x01, 0x00]] {
        assert_eq!(not_after(&CertificateDer::from(junk)), None, "{junk:?}");
    }
}

#[test]
fn a_certificate_is_warned_of_from_two_weeks_before_its_end() {
    let end = at(2_000_000_000);
    assert_eq!(warning(end, end - WARN_BEFORE - Duration::from_secs(1)), None);
    let w = warning(end, end - WARN_BEFORE).unwrap();
    assert!(w.contains("expires in 14 days"), "{w}");
    let w = warning(end, end - Duration::from_secs(3 * 3600)).unwrap();
    assert!(w.contains("expires in 3 h"), "{w}");
    let w = warning(end, end + Duration::from_secs(5 * 86_400)).unwrap();
    assert!(w.contains("expired 5 days ago"), "{w}");
}

#[test]
fn a_noted_certificate_is_on_the_metrics() {
    let cert = TestCa::new().issue_until((2060, 6, 1), Duration::ZERO);
    // The etcd client's (the reload tests show the cluster's and the public one).
    note(Shown::EtcdClient, &leaf(&cert.cert), at(1_800_000_000));
    let text = expiry_registry().render();
    let line =
        "handoff_tls_certificate_expiry_timestamp_seconds{certificate=\"etcd_client\"} 2853273600";
    assert!(text.contains(line), "{text}");
}

#[test]
fn a_date_that_does_not_exist_is_not_read() {
    assert_eq!(generalized_time(b"20240229000000Z"), Some(1_709_164_800));
    for bad in [&b"20230229000000Z"[..], b"20240230000000Z", b"20240431000000Z", b"20241301000000Z"]
    {
        assert_eq!(generalized_time(bad), None, "{}", String::from_utf8_lossy(bad));
    }
    assert_eq!(utc_time(b"240229000000Z"), Some(1_709_164_800));
    assert_eq!(utc_time(b"2402290000Z"), None, "too short");
}
