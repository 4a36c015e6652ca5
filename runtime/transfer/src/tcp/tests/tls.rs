//! Mutual TLS between tcp agents: transfers carried, strangers refused, and whose side a
//! refused certificate is.

use handoff_core::tls::Reloaded;
use handoff_core::tls::test_certs::CertFiles;

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

/// A 4-byte region at `rx`, and a write of `bytes` into it.
fn four_bytes(rx: &Agent, bytes: &'static [u8]) -> (crate::RegionId, WriteRequest) {
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = rx.inbox().register_region(r, 4, [(s, span(0..4))]).unwrap();
    (id, WriteRequest::new(id, vec![(Bytes::from_static(bytes), 0)], r, s, 1, 1, 0))
}

/// A CA taken out of a receiver's bundle while senders hold connections to it: a sender of
/// that CA is refused on the connection it had (its write never reaches the region), and a
/// sender of the CA kept goes on.
#[tokio::test]
async fn a_sender_of_a_ca_taken_out_is_refused_on_the_connection_it_had() {
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let files = CertFiles::new(&kept.issue(), &both);
    let receiver_tls = files.cluster();
    let receiver = pair(TcpConfig { tls: Some(receiver_tls.clone()), ..Default::default() }).await;
    let rx = &receiver.rx;
    let sender =
        |ca: &TestCa| TcpConfig { tls: Some(ca.issue().trusting(&both)), ..Default::default() };
    let (stays, goes) = (pair(sender(&kept)).await, pair(sender(&removed)).await);
    for p in [&stays, &goes] {
        let (id, w) = four_bytes(rx, b"okok");
        p.tx.post_write(&rx.addr(), w).await.unwrap();
        assert_eq!(rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    }

    files.put("ca.crt", kept.pem());
    assert_eq!(receiver_tls.reload(std::time::SystemTime::now()).unwrap(), Reloaded::Taken);
    let (id, w) = four_bytes(rx, b"nope");
    assert!(goes.tx.post_write(&rx.addr(), w).await.is_err(), "refused on its pooled connection");
    assert_eq!(rx.inbox().poll(id), KvPoll::Bootstrapping, "the region untouched");
    let (id, w) = four_bytes(rx, b"okok");
    stays.tx.post_write(&rx.addr(), w).await.expect("a sender of the CA kept goes on");
    assert_eq!(rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");
    for t in [stays.tasks, goes.tasks, receiver.tasks] {
        t.shutdown().await;
    }
}

/// A sender whose bundle lost the CA of a receiver it holds a connection to: it writes
/// nothing more to it, on that connection or a new one.
#[tokio::test]
async fn a_receiver_of_a_ca_taken_out_gets_nothing_more() {
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let files = CertFiles::new(&kept.issue(), &both);
    let sender_tls = files.cluster();
    let sender = pair(TcpConfig { tls: Some(sender_tls.clone()), ..Default::default() }).await;
    let receiver =
        pair(TcpConfig { tls: Some(removed.issue().trusting(&both)), ..Default::default() }).await;
    let rx = &receiver.rx;
    let (id, w) = four_bytes(rx, b"okok");
    sender.tx.post_write(&rx.addr(), w).await.unwrap();
    assert_eq!(rx.inbox().wait(id, deadline()).await.unwrap().buf, b"okok");

    files.put("ca.crt", kept.pem());
    assert_eq!(sender_tls.reload(std::time::SystemTime::now()).unwrap(), Reloaded::Taken);
    let (id, w) = four_bytes(rx, b"nope");
    assert!(sender.tx.post_write(&rx.addr(), w).await.is_err(), "not sent");
    assert_eq!(rx.inbox().poll(id), KvPoll::Bootstrapping, "the region untouched");
    // The pooled connection refused before reuse is counted as a cut (each test is a process
    // of its own under nextest).
    let shown = handoff_core::tls::expiry::expiry_registry().render();
    let line = "handoff_tls_connections_cut_total{certificate=\"cluster\"} 1";
    assert!(shown.lines().any(|l| l == line), "{line} in\n{shown}");
    for t in [sender.tasks, receiver.tasks] {
        t.shutdown().await;
    }
}

/// A stream to a receiver whose CA the sender's bundle loses mid-way: what is left of it is
/// not sent on the connection the stream holds, and the region is never complete.
#[tokio::test]
async fn a_stream_to_a_receiver_of_a_ca_taken_out_stops_mid_way() {
    use crate::stream::NoticeSums;
    let (kept, removed) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", kept.pem(), removed.pem());
    let files = CertFiles::new(&kept.issue(), &both);
    let sender_tls = files.cluster();
    let tasks = Tasks::new();
    let tx = TcpTransfer::bind(
        "127.0.0.1:0".parse().unwrap(),
        Arc::new(Inbox::new(InboxConfig::default())),
        TcpConfig { tls: Some(sender_tls.clone()), shared_memory: false, ..Default::default() },
        &tasks,
    )
    .await
    .unwrap();
    let receiver =
        pair(TcpConfig { tls: Some(removed.issue().trusting(&both)), ..Default::default() }).await;
    let rx = &receiver.rx;
    let (r, s) = (room(), SenderId::new(0, 0));
    let id = rx.inbox().register_region(r, 8, [(s, span(0..8))]).unwrap();
    let parts = [(Bytes::from_static(b"half"), 0), (Bytes::from_static(b"rest"), 4)];
    let mut stream = tx.open_stream(&rx.addr()).await.unwrap().expect("a stream");
    let mut sums = NoticeSums::default();
    stream.post(id, s, &parts[..1], &mut sums).await.unwrap();

    files.put("ca.crt", kept.pem());
    assert_eq!(sender_tls.reload(std::time::SystemTime::now()).unwrap(), Reloaded::Taken);
    let notice = WriteRequest::new(id, parts.to_vec(), r, s, 1, 1, 0).notice.unwrap();
    let sent = match stream.post(id, s, &parts[1..], &mut sums).await {
        Ok(()) => stream.finish(id, notice).await,
        Err(e) => Err(e),
    };
    assert!(sent.is_err(), "the rest is not sent");
    assert_ne!(rx.inbox().poll(id), KvPoll::Success, "the region is not complete");
    for t in [tasks, receiver.tasks] {
        t.shutdown().await;
    }
}
