use std::time::SystemTime;

use super::*;
use crate::tls::expiry::expiry_registry;

use crate::tls::test_certs::{CertFiles, TestCa, TestCert};

// The metrics are the process's: the tests here show their certificates under a label no
// other test in this crate uses (`nats_client`), and look for values only they could show.

fn handed(pems: &CertFiles) -> HandedTls {
    let (cert, key, ca) = (pems.path("tls.crt"), pems.path("tls.key"), pems.path("ca.crt"));
    HandedTls::from_files(Shown::NatsClient, Some((&cert, &key)), Some(&ca)).unwrap().unwrap()
}

/// The end shown for `label`, as the metrics' line.
fn shown_end(label: &str) -> String {
    let shown = expiry_registry().render();
    let line = shown.lines().find(|l| l.contains(&format!("certificate=\"{label}\"")));
    line.unwrap_or_default().to_owned()
}

fn identity(c: &TestCert) -> Option<(Vec<u8>, Vec<u8>)> {
    Some((c.cert.clone().into(), c.key.clone().into()))
}

#[test]
fn a_renewed_set_moves_the_generation_and_an_unusable_one_does_not() {
    let ca = TestCa::new();
    let first = ca.issue_valid_until((3001, 1, 1));
    let renewed = ca.issue_valid_until((3002, 1, 1));
    let pems = CertFiles::empty();
    pems.put("ca.crt", ca.pem());
    pems.put_cert(&first);
    let tls = handed(&pems);
    let now = SystemTime::now();
    let read = HandedPem { generation: 0, identity: identity(&first), ca: Some(ca.pem().into()) };
    assert_eq!(tls.current(), read);
    assert!(shown_end("nats_client").ends_with(" 32535216000"), "{}", shown_end("nats_client"));
    assert_eq!(tls.reload(now).unwrap(), Reloaded::Unchanged);

    // A certificate without its key yet: refused, the set in use kept.
    pems.put("tls.crt", &renewed.cert);
    assert!(matches!(tls.reload(now), Err(TlsError::Invalid { .. })));
    assert_eq!(tls.current().generation, 0);
    // With its key: taken, and its end shown.
    pems.put("tls.key", &renewed.key);
    assert_eq!(tls.reload(now).unwrap(), Reloaded::Taken);
    let current = tls.current();
    assert_eq!((current.generation, &current.identity), (1, &identity(&renewed)));
    // Shown once its owner has a client made with it in use, not before.
    assert!(shown_end("nats_client").ends_with(" 32535216000"), "{}", shown_end("nats_client"));
    tls.shown_in_use(&current, now);
    assert!(shown_end("nats_client").ends_with(" 32566752000"), "{}", shown_end("nats_client"));
    assert!(!format!("{current:?}").contains(&renewed.key), "a key is not shown");
    assert_eq!(tls.reload(now).unwrap(), Reloaded::Unchanged, "taken once");

    // An expired certificate, and a CA that does not parse: refused.
    pems.put_cert(&ca.issue_expired());
    assert!(matches!(tls.reload(now), Err(TlsError::Expired)));
    pems.put_cert(&renewed);
    pems.put("ca.crt", "not a certificate");
    assert!(matches!(tls.reload(now), Err(TlsError::Invalid { what: "CA", .. })));
    assert_eq!(tls.current().generation, 1, "nothing refused was taken");
}

#[test]
fn a_ca_alone_is_handed_and_shows_no_certificate() {
    let (old, new) = (TestCa::new(), TestCa::new());
    let pems = CertFiles::empty();
    pems.put("ca.crt", old.pem());
    let ca = pems.path("ca.crt");
    let tls = HandedTls::from_files(Shown::NatsClient, None, Some(&ca)).unwrap().unwrap();
    let read = HandedPem { generation: 0, identity: None, ca: Some(old.pem().into()) };
    assert_eq!(tls.current(), read);
    pems.put("ca.crt", &format!("{}{}", old.pem(), new.pem()));
    assert_eq!(tls.reload(SystemTime::now()).unwrap(), Reloaded::Taken);
    assert_eq!(tls.current().generation, 1);
    // The CA's own end (rcgen's default, 4096-01-01) is not shown as the client's (the other
    // test here shows ends in 3001 and 3002 under this label).
    tls.shown_in_use(&tls.current(), SystemTime::now());
    let end = shown_end("nats_client");
    assert!(!end.ends_with(" 67090118400"), "a CA is no certificate: {end}");
    assert!(HandedTls::from_files(Shown::EtcdClient, None, None).unwrap().is_none());
}
