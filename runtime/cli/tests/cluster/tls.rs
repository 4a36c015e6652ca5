//! etcd and NATS that want TLS, client certificates and passwords: handoff passes them
//! through, and without them it is refused.

use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;
use handoff_core::Tasks;
use handoff_core::tls::test_certs::TestCa;
use handoff_discovery::{EtcdRegistry, EventBus, NatsBus, Registry, Role, ServerAccess, Update};

use super::discovery::inst;
use super::servers::{Handoff, PemFiles, Server};

async fn next(w: &mut futures::stream::BoxStream<'static, Update>) -> Update {
    let got = tokio::time::timeout(Duration::from_secs(10), w.next()).await;
    got.expect("an update in time").expect("watch open")
}

/// Whether a message published on `from` reaches a subscriber on `to` within `within`.
async fn carries(from: &NatsBus, to: &NatsBus, within: Duration) -> bool {
    let Ok(mut sub) = to.subscribe("handoff.v1.kv.").await else { return false };
    let hop = async {
        for _ in 0..20 {
            let _ = from.publish("handoff.v1.kv.p".into(), Bytes::from_static(b"x")).await;
            if let Ok(Some(_)) = tokio::time::timeout(Duration::from_millis(100), sub.next()).await
            {
                return true;
            }
        }
        false
    };
    tokio::time::timeout(within, hop).await.unwrap_or(false)
}

#[tokio::test]
async fn etcd_and_nats_over_tls_with_credentials() {
    let ca = TestCa::new();
    let server = PemFiles::write(&ca.issue());
    let client = PemFiles::write(&ca.issue());
    let stranger = PemFiles::write(&TestCa::new().issue());
    let etcd = Server::etcd_tls(&server);
    let nats = Server::nats_tls(&server, "handoff", "s3cret");
    let tasks = Tasks::new();
    let ttl = Duration::from_secs(2);

    // etcd: the CA and a client certificate it signed.
    let reg = EtcdRegistry::connect_with(&etcd.url, &client.access(), ttl, &tasks).await.unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    assert_eq!(next(&mut w).await, Update::Reset(vec![]));
    reg.register(inst("p1")).await.unwrap();
    assert_eq!(next(&mut w).await, Update::Add(inst("p1")));
    // Refused: plain, no client certificate, another CA's.
    let plain = etcd.url.replace("https://", "http://");
    let no_cert = ServerAccess { ca: Some(client.ca.clone()), ..Default::default() };
    let other = ServerAccess { ca: Some(client.ca.clone()), ..stranger.access() };
    for (label, url, access) in [
        ("plain", plain.as_str(), ServerAccess::default()),
        ("no certificate", etcd.url.as_str(), no_cert),
        ("another CA", etcd.url.as_str(), other),
    ] {
        let attempt = async {
            let r = EtcdRegistry::connect_with(url, &access, ttl, &tasks).await?;
            r.register(inst("intruder")).await
        };
        let got = tokio::time::timeout(Duration::from_secs(15), attempt).await;
        assert!(!matches!(got, Ok(Ok(()))), "etcd, {label}: refused");
    }

    // NATS: TLS with a client certificate, and a user and password.
    let user = Some(("handoff".to_owned(), "s3cret".to_owned()));
    let member = ServerAccess { user: user.clone(), ..client.access() };
    let a = NatsBus::connect_with(&nats.url, &member).await.unwrap();
    let b = NatsBus::connect_with(&nats.url, &member).await.unwrap();
    assert!(carries(&a, &b, Duration::from_secs(5)).await, "members talk");
    let wrong = ServerAccess { user: Some(("handoff".into(), "guess".into())), ..client.access() };
    let bare = ServerAccess { user: user.clone(), ..Default::default() };
    let foreign = ServerAccess { user, ca: Some(client.ca.clone()), ..stranger.access() };
    for (label, access) in [("wrong password", wrong), ("no TLS", bare), ("another CA", foreign)] {
        let Ok(x) = NatsBus::connect_with(&nats.url, &access).await else { continue };
        assert!(!carries(&x, &b, Duration::from_secs(2)).await, "NATS, {label}: refused");
    }

    // Both client certificates' ends are shown (rcgen's default: 4096-01-01).
    let shown = handoff_core::tls::expiry::expiry_registry().render();
    for client in ["etcd_client", "nats_client"] {
        let line = format!(
            "handoff_tls_certificate_expiry_timestamp_seconds{{certificate=\"{client}\"}} 67090118400"
        );
        assert!(shown.contains(&line), "{line} in\n{shown}");
    }

    // The command line passes the same settings through.
    let flags = |pem: &PemFiles, tool: &str| {
        [("ca", &pem.ca), ("cert", &pem.cert), ("key", &pem.key)]
            .map(|(k, p)| [format!("--{tool}-{k}"), p.display().to_string()])
            .concat()
    };
    let mut args: Vec<String> =
        ["--nats-user", "handoff", "--nats-password", "s3cret"].map(String::from).to_vec();
    args.extend(flags(&client, "etcd"));
    args.extend(flags(&client, "nats"));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let _p = super::servers::prefill(&etcd, &nats, "tls-prefill", &args);
    assert!(matches!(next(&mut w).await, Update::Add(i) if i.id.as_str() == "tls-prefill"));
    tasks.shutdown().await;
}

/// Whether the instances `w` says are registered come to satisfy `done` within 20 s, `held`
/// following its updates.
async fn comes_to(
    w: &mut futures::stream::BoxStream<'static, Update>,
    held: &mut std::collections::HashSet<String>,
    done: impl Fn(&std::collections::HashSet<String>) -> bool,
) -> bool {
    let follow = async {
        while !done(held) {
            match w.next().await {
                Some(Update::Reset(all)) => *held = all.iter().map(|i| i.id.to_string()).collect(),
                Some(Update::Add(i)) => drop(held.insert(i.id.to_string())),
                Some(Update::Remove(i)) => drop(held.remove(i.as_str())),
                None => return false,
            }
        }
        true
    };
    tokio::time::timeout(Duration::from_secs(20), follow).await.unwrap_or(false)
}

/// The etcd client's reloads with `outcome`, as `metrics` count them.
fn reloads(metrics: &str, outcome: &str) -> u64 {
    let line =
        format!("handoff_tls_reloads_total{{certificate=\"etcd_client\",outcome=\"{outcome}\"}} ");
    let count = metrics.lines().find_map(|l| l.strip_prefix(&line)?.parse().ok());
    count.unwrap_or(0)
}

/// The etcd client certificate's end that `metrics` show, in Unix seconds.
fn etcd_client_end(metrics: &str) -> u64 {
    let line = "handoff_tls_certificate_expiry_timestamp_seconds{certificate=\"etcd_client\"} ";
    let end = metrics.lines().find_map(|l| l.strip_prefix(line)?.parse::<f64>().ok());
    end.unwrap_or(0.0) as u64
}

/// Whether `done` holds of what `metrics` gives within 10 s (asked every 50 ms).
async fn metrics_come_to<F: std::future::Future<Output = String>>(
    metrics: impl Fn() -> F,
    done: impl Fn(&str) -> bool,
) -> bool {
    for _ in 0..200 {
        if done(&metrics().await) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// etcd's client files renewed while processes run are taken by a new etcd client, with no
/// restart. A CA change: etcd trusts both CAs, each client's certificate is reissued by the
/// next one (with a bundle of both as the CA file) and its new client made at once (its end
/// shown), then etcd restarts trusting the next CA alone. A prefill process keeps its
/// registration (put back when deleted), and a registry in this process keeps its watch and
/// registers through its new client. A set etcd refuses is counted so and not used.
#[tokio::test]
async fn etcd_client_files_renewed_while_running_are_taken_by_a_new_client() {
    const END_3003: u64 = 32_598_288_000;
    let (ca, next_ca) = (TestCa::new(), TestCa::new());
    let both = format!("{}{}", ca.pem(), next_ca.pem());
    let server = PemFiles::write(&ca.issue());
    std::fs::write(&server.ca, &both).unwrap();
    let (client, member) = (PemFiles::write(&ca.issue()), PemFiles::write(&ca.issue()));
    let (mut etcd, nats) = (Server::etcd_tls(&server), Server::nats());
    let tasks = Tasks::new();
    let access = ServerAccess { tls_reload: Some(Duration::from_millis(100)), ..client.access() };
    let reg = EtcdRegistry::connect_with(&etcd.url, &access, Duration::from_secs(2), &tasks)
        .await
        .unwrap();
    let mut w = reg.watch(Role::Prefill).await.unwrap();
    let mut args: Vec<String> = [("--etcd-ca", &member.ca), ("--etcd-cert", &member.cert)]
        .into_iter()
        .chain([("--etcd-key", &member.key)])
        .flat_map(|(f, p)| [f.to_owned(), p.display().to_string()])
        .collect();
    args.extend(["--tls-reload-secs", "1", "--lease-ttl-secs", "2"].map(String::from));
    args.extend(["--ops-listen", "127.0.0.1:0"].map(String::from));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let (_p, line) = super::servers::prefill_ready(&etcd, &nats, "renewing", &args);
    let ops = super::processes::addr_after(&line, "ops http://");
    let mut held = std::collections::HashSet::new();
    assert!(comes_to(&mut w, &mut held, |h| h.contains("renewing")).await);

    // Reissued, valid until 3003: each process makes its new client at once, and shows its end.
    client.reissue(&next_ca.issue_valid_until((3003, 1, 1)), &both);
    member.reissue(&next_ca.issue_valid_until((3003, 1, 1)), &both);
    let here = || async { handoff_core::tls::expiry::expiry_registry().render() };
    let there = || async { super::operations::http_get(&ops, "/metrics").await.1 };
    let in_use = |m: &str| etcd_client_end(m) == END_3003;
    assert!(metrics_come_to(here, in_use).await, "here:\n{}", here().await);
    assert!(metrics_come_to(there, in_use).await, "in the prefill:\n{}", there().await);
    assert!(reloads(&here().await, "taken") >= 1 && reloads(&there().await, "taken") >= 1);

    // etcd restarted trusting the next CA alone: clients of the first are refused now.
    etcd.stop();
    std::fs::write(&server.ca, next_ca.pem()).unwrap();
    etcd.start();
    held.clear();
    assert!(comes_to(&mut w, &mut held, |h| h.contains("renewing")).await, "the watch is back");
    // The prefill's keeper puts its registration back through its new client.
    reg.deregister(&"renewing".parse().unwrap()).await.unwrap();
    assert!(comes_to(&mut w, &mut held, |h| !h.contains("renewing")).await);
    assert!(comes_to(&mut w, &mut held, |h| h.contains("renewing")).await, "put back");
    reg.register(inst("p2")).await.unwrap();
    assert!(comes_to(&mut w, &mut held, |h| h.contains("p2")).await, "registered anew");

    // Files that pass every check of ours but that etcd refuses (a stranger CA's certificate,
    // valid until 3004): counted as refused, not shown, not used.
    let refused = reloads(&here().await, "refused");
    client.reissue(&TestCa::new().issue_valid_until((3004, 1, 1)), &both);
    let said = |m: &str| reloads(m, "refused") > refused;
    assert!(metrics_come_to(here, said).await, "refused:\n{}", here().await);
    assert_eq!(etcd_client_end(&here().await), END_3003, "the end of the client in use");
    let p3 = tokio::time::timeout(Duration::from_secs(20), reg.register(inst("p3"))).await;
    assert!(matches!(p3, Ok(Ok(()))), "registered through the client in use: {p3:?}");
    assert!(comes_to(&mut w, &mut held, |h| h.contains("p3")).await);
    tasks.shutdown().await;
}

/// Separate processes with the cluster's mutual TLS and token, found through etcd and NATS,
/// and a public certificate on the frontend: a request over `grpcs://` is served through a
/// prefill (gRPC, directory and KV transfer all over mutual TLS), and the frontend's metrics
/// say when both its certificates expire.
#[tokio::test]
async fn processes_with_mutual_tls_serve_over_a_public_certificate() {
    use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

    let (ca, public_ca) = (TestCa::new(), TestCa::new());
    let member = PemFiles::write(&ca.issue());
    let public = PemFiles::write(&public_ca.issue());
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let cluster: Vec<String> =
        [("--tls-cert", &member.cert), ("--tls-key", &member.key), ("--tls-ca", &member.ca)]
            .map(|(f, p)| [f.to_owned(), p.display().to_string()])
            .concat()
            .into_iter()
            .chain(["--token".to_owned(), "cluster-secret".to_owned()])
            .collect();
    let with = |head: &[&str]| -> Vec<String> {
        let tail = ["--etcd", &etcd.url, "--nats", &nats.url].map(String::from);
        head.iter().map(|s| s.to_string()).chain(tail).chain(cluster.iter().cloned()).collect()
    };
    let spawn = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        Handoff::spawn(&args)
    };
    let (_s, line) = spawn(with(&["scheduler", "--listen", "127.0.0.1:0"]));
    assert!(line.contains("grpcs://"), "{line}");
    let prefill = ["prefill", "--engine", "mock", "--id", "tls-p0", "--tp", "2"];
    let ports = ["--bootstrap-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"];
    let (_p, line) = spawn(with(&[&prefill[..], &ports[..]].concat()));
    assert!(line.contains("https://"), "{line}");
    let mut fe = with(&[
        "frontend",
        "--engine",
        "mock",
        "--listen",
        "127.0.0.1:0",
        "--http-listen",
        "127.0.0.1:0",
        "--ops-listen",
        "127.0.0.1:0",
    ]);
    fe.extend(
        [("--public-tls-cert", &public.cert), ("--public-tls-key", &public.key)]
            .map(|(f, p)| [f.to_owned(), p.display().to_string()])
            .concat(),
    );
    let (_f, line) = spawn(fe);
    let addr = super::processes::addr_after(&line, "grpcs://");
    let ops = super::processes::addr_after(&line, "ops http://");
    let scrape = super::operations::http_get(&ops, "/metrics").await.1;
    // Both test certificates are valid until rcgen's default end, 4096-01-01.
    for shown in ["cluster", "public"] {
        let line = format!(
            "handoff_tls_certificate_expiry_timestamp_seconds{{certificate=\"{shown}\"}} 67090118400"
        );
        assert!(scrape.contains(&line), "{line} in\n{scrape}");
    }

    let tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(public_ca.pem()));
    let ep = Endpoint::from_shared(format!("https://{addr}")).unwrap().tls_config(tls).unwrap();
    let mut client = handoff_proto::v1::generate_client::GenerateClient::new(ep.connect_lazy());
    // The frontend may not have heard of the prefill yet: a few tries.
    let mut served = None;
    for seed in 0..50 {
        match super::processes::one(&mut client, seed).await {
            Ok(instance) => {
                served = Some(instance);
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    assert_eq!(served.as_deref(), Some("tls-p0"), "served through the prefill over mutual TLS");

    // `ctl trace` asks the frontend over its public certificate, given the CA that signed it;
    // without it, it says so.
    let room = super::operations::room_of(&mut client).await;
    let trace = |head: &[String]| {
        let tail = ["trace".to_owned(), room.to_string()];
        let all: Vec<String> = cluster.iter().chain(head).chain(&tail).cloned().collect();
        super::operations::run_ctl(
            &etcd,
            &nats,
            &all.iter().map(String::as_str).collect::<Vec<_>>(),
        )
    };
    let (ok, _, err) = trace(&[]);
    assert!(!ok && err.contains("--public-ca"), "{err}");
    let with_ca = ["--public-ca".to_owned(), public.ca.display().to_string()];
    let (ok, out, err) = trace(&with_ca);
    assert!(ok, "{err}");
    assert!(out.starts_with(&format!("room {room} (frontend ")), "{out}");
    // A name to check instead of the address asked: one the certificate does not hold fails.
    let named =
        |name: &str| [&with_ca[..], &["--public-name".to_owned(), name.to_owned()]].concat();
    assert!(trace(&named("localhost")).0, "a name the certificate holds");
    let (ok, _, err) = trace(&named("elsewhere.example"));
    assert!(!ok && err.contains("elsewhere.example"), "{err}");
}

/// The certificate a TLS server on `addr` shows a new client of `ca`, if its handshake ends
/// within 5 s (within the server's own 10 s deadline).
async fn shown(addr: &str, ca: &TestCa) -> Option<Vec<u8>> {
    let client = ca.issue().cluster();
    let dial = async {
        let tcp = tokio::net::TcpStream::connect(addr).await.ok()?;
        let name = handoff_core::tls::server_name("127.0.0.1").unwrap();
        let s = client.connector().connect(name, tcp).await.ok()?;
        Some(s.get_ref().1.peer_certificates()?.first()?.to_vec())
    };
    tokio::time::timeout(Duration::from_secs(5), dial).await.ok().flatten()
}

/// A scheduler process with the cluster's TLS from `member`'s files, read again every second,
/// and the token `cluster-secret`: the process, its gRPC address and its ops address.
pub(crate) fn reloading_scheduler(
    member: &PemFiles,
    etcd: &Server,
    nats: &Server,
) -> (Handoff, String, String) {
    let files =
        [("--tls-cert", &member.cert), ("--tls-key", &member.key), ("--tls-ca", &member.ca)]
            .map(|(f, p)| [f.to_owned(), p.display().to_string()])
            .concat();
    let mut args: Vec<String> = ["scheduler", "--listen", "127.0.0.1:0", "--ops-listen"]
        .into_iter()
        .chain(["127.0.0.1:0", "--etcd", &etcd.url, "--nats", &nats.url])
        .chain(["--token", "cluster-secret", "--tls-reload-secs", "1"])
        .map(String::from)
        .collect();
    args.extend(files);
    let (s, line) = Handoff::spawn(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let addr = super::processes::addr_after(&line, "grpcs://");
    let ops = super::processes::addr_after(&line, "ops http://");
    (s, addr, ops)
}

/// A certificate renewed on disk (as cert-manager rewrites a Secret's files) is taken by a
/// running process within --tls-reload-secs: its gRPC server shows the new one to new
/// clients, calls go on being served, and its metrics show the new end and the reload.
#[tokio::test]
async fn a_renewed_certificate_is_taken_without_a_restart() {
    use handoff_proto::v1::ListInstancesRequest;
    use handoff_proto::v1::scheduler_client::SchedulerClient;
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;

    let ca = TestCa::new();
    let member = PemFiles::write(&ca.issue());
    let (etcd, nats) = (Server::etcd(), Server::nats());
    let (_s, addr, ops) = reloading_scheduler(&member, &etcd, &nats);
    let first = CertificateDer::from_pem_file(&member.cert).unwrap().to_vec();
    assert_eq!(shown(&addr, &ca).await, Some(first));

    // Clients that connect and say nothing hold no handshake of anyone else's up.
    let mut silent = Vec::new();
    for _ in 0..20 {
        silent.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    assert!(shown(&addr, &ca).await.is_some(), "a handshake behind 20 silent clients");
    // Renewed: a new key and certificate, valid until 2061-03-01, each file replaced whole.
    let renewed = ca.issue_valid_until((2061, 3, 1));
    member.reissue(&renewed, ca.pem());
    let want = CertificateDer::from_pem_slice(renewed.cert.as_bytes()).unwrap().to_vec();
    let mut now_shown = None;
    for _ in 0..100 {
        now_shown = shown(&addr, &ca).await;
        if now_shown.as_ref() == Some(&want) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(now_shown, Some(want), "the renewed certificate shown by the running process");

    let client = ca.issue().cluster();
    let channel =
        handoff_proto::grpc::cluster_channel(&addr, Some(&client), Duration::from_secs(2)).unwrap();
    let ask = handoff_proto::auth::request(ListInstancesRequest {}, Some("cluster-secret"));
    SchedulerClient::new(channel)
        .list_instances(ask)
        .await
        .expect("served over the new certificate");
    let scrape = super::operations::http_get(&ops, "/metrics").await.1;
    for line in [
        "handoff_tls_certificate_expiry_timestamp_seconds{certificate=\"cluster\"} 2876860800",
        "handoff_tls_reloads_total{certificate=\"cluster\",outcome=\"taken\"} 1",
        // Shown at 0 from the start, so a rate sees its first step.
        "handoff_tls_reloads_total{certificate=\"cluster\",outcome=\"refused\"} 0",
    ] {
        assert!(scrape.contains(line), "{line} in\n{scrape}");
    }
    drop(silent);
}
