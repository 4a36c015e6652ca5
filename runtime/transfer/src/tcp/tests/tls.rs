//! Mutual TLS between tcp agents: transfers carried, strangers refused, and whose side a
//! refused certificate is.

use super::*;

fn tls_config(ca: &TestCa) -> TcpConfig {
    TcpConfig { tls: Some(ca.issue().cluster()), ..Default::default() }
}

#[tokio::test]
async fn mutual_tls_carries_transfers_and_refuses_strangers() {
    let cluster = TestCa::new();
    let p = pair(tls_config(&cluster)).await;
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    let w = WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0);
    p.tx.post_write(&p.rx.addr(), w).await.unwrap();
    assert_eq!(p.rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");

    // A plain peer, and one with a certificate from another CA: refused, region untouched.
    let plain = pair(TcpConfig::default()).await;
    let other = pair(tls_config(&TestCa::new())).await;
    for (label, stranger) in [("plain", &plain), ("another CA", &other)] {
        let id = p.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
        let w = WriteRequest::new(id, vec![(Bytes::from_static(b"nope"), 0)], r, s, 1, 1, 0);
        assert!(stranger.tx.post_write(&p.rx.addr(), w).await.is_err(), "{label} refused");
        assert_eq!(p.rx.inbox().poll(id), KvPoll::Bootstrapping, "{label}: untouched");
    }
    for t in [p.tasks, plain.tasks, other.tasks] {
        t.shutdown().await;
    }
}

/// A receiver whose certificate does not name the address it is dialled at is unreachable
/// (its side: a prefill sending to it is not at fault); a sender whose own certificate the
/// receiver refuses is not: its own side when the fault is its certificate's alone.
#[tokio::test]
async fn a_refused_receiver_certificate_is_the_receiver_side() {
    let cluster = TestCa::new();
    let elsewhere = cluster.issue_for(&["elsewhere.example"]).cluster();
    let named_elsewhere = pair(TcpConfig { tls: Some(elsewhere), ..Default::default() }).await;
    let good = pair(tls_config(&cluster)).await;
    let write = |to: &Pair| {
        let (r, s) = (room(), SenderId::new(0, 0));
        let id = to.rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
        WriteRequest::new(id, vec![(Bytes::from_static(b"okok"), 0)], r, s, 1, 1, 0)
    };
    let w = write(&named_elsewhere);
    let e = good.tx.post_write(&named_elsewhere.rx.addr(), w).await.unwrap_err();
    assert!(matches!(e, TransferError::Unreachable { .. }), "{e}");

    // A sender that trusts the cluster's CA but shows another's certificate: the receiver
    // refuses it, and the fault is not the receiver's (nor surely the sender's alone: the
    // receiver's bundle may be the stale one).
    let foreign = TestCa::new().issue();
    let refused =
        pair(TcpConfig { tls: Some(foreign.trusting(cluster.pem())), ..Default::default() }).await;
    let w = write(&good);
    let e = refused.tx.post_write(&good.rx.addr(), w).await.unwrap_err();
    assert!(matches!(e, TransferError::Io { .. }), "{e}");
    // A sender showing the cluster's certificate, expired: its own fault alone, told apart
    // (the alert arrives at the first read after the handshake), so it counts against
    // neither side's peer.
    let expired = pair(TcpConfig {
        tls: Some(cluster.issue_expired().trusting(cluster.pem())),
        ..Default::default()
    })
    .await;
    let w = write(&good);
    let e = expired.tx.post_write(&good.rx.addr(), w).await.unwrap_err();
    assert!(matches!(e, TransferError::CertificateRefused { .. }), "{e}");
    for t in [named_elsewhere.tasks, good.tasks, refused.tasks, expired.tasks] {
        t.shutdown().await;
    }
}

#[tokio::test]
async fn mutual_tls_carries_concurrent_transfers() {
    let cluster = TestCa::new();
    let cfg = TcpConfig {
        io_timeout: Duration::from_secs(5),
        token: Some("t".into()),
        ..tls_config(&cluster)
    };
    let p = pair(cfg).await;
    let s = SenderId::new(0, 0);
    // As KV: 64 runs of 192 KiB, 12 MB.
    let run = 192 << 10;
    let len = 64 * run;
    let data = Bytes::from(vec![5u8; run]);
    let one = |r: Room| {
        let (p, data) = (&p, data.clone());
        async move {
            let id =
                p.rx.inbox().register_region(r, len as u64, [(s, span(0..len as u64))]).unwrap();
            let pairs = (0..64).map(|i| (data.clone(), (i * run) as u64)).collect();
            let w = WriteRequest::new(id, pairs, r, s, 1, 1, 0);
            p.tx.post_write(&p.rx.addr(), w).await.unwrap();
            p.rx.inbox().wait(id, deadline()).await.unwrap().buf.len()
        }
    };
    for _ in 0..3 {
        let got = futures::future::join_all((0..4).map(|_| one(room()))).await;
        assert!(got.iter().all(|&n| n == len));
    }
    p.tasks.shutdown().await;
}
