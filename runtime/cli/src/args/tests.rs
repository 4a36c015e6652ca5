use clap::Parser;

use super::*;

fn scheduler(args: &[&str]) -> Result<SchedulerArgs, clap::Error> {
    let argv = ["handoff", "scheduler"].iter().chain(args).copied();
    match Cli::try_parse_from(argv)?.command {
        Command::Scheduler(a) => Ok(a),
        other => panic!("parsed as {other:?}"),
    }
}

#[test]
fn policy_flags_set_the_scheduler_config() {
    let cfg = scheduler(&[]).unwrap().policy.config();
    assert_eq!(cfg.default_policy, PolicyKind::KvAware);
    assert_eq!(cfg.params, PolicyParams::default(), "flag defaults are the code's defaults");
    let a = scheduler(&["--policy", "prefix-hash", "--kv-load-weight", "0.5"]).unwrap();
    let cfg = a.policy.config();
    assert_eq!(cfg.default_policy, PolicyKind::PrefixHash);
    assert_eq!(cfg.params.kv_aware.load, 0.5);
}

#[test]
fn bad_policy_flags_are_clear_errors() {
    for bad in [
        &["--policy", "fastest"][..],
        &["--kv-load-weight", "-1"],
        &["--kv-load-weight", "NaN"],
        &["--kv-temperature", "inf"],
        &["--prefix-load-factor", "x"],
    ] {
        let e = scheduler(bad).unwrap_err().to_string();
        assert!(e.contains(bad[0]) || e.contains(bad[1]), "{bad:?}: {e}");
    }
}

fn frontend(args: &[&str]) -> Result<FrontendArgs, clap::Error> {
    let argv = ["handoff", "frontend"].iter().chain(args).copied();
    match Cli::try_parse_from(argv)?.command {
        Command::Frontend(a) => Ok(a),
        other => panic!("parsed as {other:?}"),
    }
}

/// A renamed flag keeps its old name (an old unit file must not crash-loop on it).
#[test]
fn renamed_flags_keep_their_old_names() {
    let a = frontend(&["--scheduler", "127.0.0.1:1", "--http-max-connections", "77"]).unwrap();
    assert_eq!(a.requests.max_connections, 77);
}

#[test]
fn a_frontend_runs_its_own_scheduler_only_when_asked_and_then_takes_the_selection_flags() {
    use clap::error::ErrorKind;
    let a = frontend(&["--scheduler", "127.0.0.1:1"]).unwrap();
    assert!(!a.scheduler_in_frontend);
    a.check_own_scheduler().unwrap();
    // Nowhere to find a scheduler: refused, not waited for for ever.
    let mut lost = frontend(&[]).unwrap();
    (lost.discovery.etcd, lost.discovery.nats) = (None, None);
    let refused = lost.check_own_scheduler().unwrap_err().to_string();
    assert!(refused.contains("no scheduler to ask"), "{refused}");
    let discovery = ["--etcd", "http://127.0.0.1:1", "--nats", "nats://127.0.0.1:1"];
    let own = ["--scheduler-in-frontend", "--policy", "round-robin"];
    let a = frontend(&[&discovery[..], &own].concat()).unwrap();
    assert!(a.scheduler_in_frontend);
    a.check_own_scheduler().unwrap();
    assert_eq!(a.policy.config().default_policy, PolicyKind::RoundRobin);

    let conflict = frontend(&["--scheduler-in-frontend", "--scheduler", "127.0.0.1:1"]);
    assert_eq!(conflict.unwrap_err().kind(), ErrorKind::ArgumentConflict);
    let lone_ops = frontend(&["--scheduler-ops-listen", "127.0.0.1:0"]);
    assert_eq!(lone_ops.unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
    let lone_grpc = frontend(&["--scheduler-listen", "127.0.0.1:0"]);
    assert_eq!(lone_grpc.unwrap_err().kind(), ErrorKind::MissingRequiredArgument);
    let mut no_bus = frontend(&["--scheduler-in-frontend"]).unwrap();
    // As without HANDOFF_ETCD and HANDOFF_NATS (clap reads them too).
    (no_bus.discovery.etcd, no_bus.discovery.nats) = (None, None);
    let refused = no_bus.check_own_scheduler().unwrap_err().to_string();
    assert!(refused.contains("needs --etcd and --nats"), "{refused}");
    for flags in [&["--policy", "random"], &["--kv-load-weight", "0.25"]] {
        let unread = frontend(&[&flags[..], &["--scheduler", "127.0.0.1:1"]].concat())
            .unwrap()
            .check_own_scheduler();
        assert!(unread.unwrap_err().to_string().contains("selection flags"), "{flags:?}");
    }
}

#[test]
fn up_runs_one_scheduler_in_its_frontend_not_several() {
    let argv = ["handoff", "up", "--scheduler-in-frontend", "--schedulers", "2"];
    let e = Cli::try_parse_from(argv).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);
    let argv = ["handoff", "up", "--scheduler-in-frontend"];
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Up(a) => assert!(a.scheduler_in_frontend),
        other => panic!("parsed as {other:?}"),
    }
}

/// The arguments the Helm chart gives a frontend with `scheduler.inFrontend` (and etcd and
/// NATS from its environment) parse, and its scheduler's operations listener on every
/// interface is refused without the cluster token, as the frontend's own are.
#[test]
fn the_charts_in_frontend_arguments_parse_and_their_ops_listener_needs_the_token() {
    let chart = [
        "--listen=0.0.0.0:50051",
        "--http-listen=0.0.0.0:8080",
        "--ops-listen=0.0.0.0:9090",
        "--max-kv-mib=2048",
        "--advertise-host=10.0.0.7",
        "--transfer-bind=10.0.0.7",
        "--drain-secs=30",
        "--transfer=tcp",
        "--engine=mock",
        "--decode-tp=1",
        "--scheduler-in-frontend",
        "--policy=prefix-hash",
        "--scheduler-ops-listen=0.0.0.0:9091",
        "--scheduler-listen=127.0.0.1:50052",
        "--etcd=http://etcd:2379",
        "--nats=nats://nats:4222",
    ];
    let mut a = frontend(&chart).unwrap();
    a.check_own_scheduler().unwrap();
    assert_eq!(a.policy.config().default_policy, PolicyKind::PrefixHash);
    // Whatever the environment says: no token, no TLS, not --insecure.
    (a.discovery.token, a.discovery.tls_cert, a.discovery.insecure) = (None, None, false);
    let e = crate::cmd::check_exposure(&a.discovery, &a.listeners()).unwrap_err().to_string();
    assert!(e.contains("its scheduler's metrics on 0.0.0.0:9091"), "{e}");
    assert!(e.contains("the frontend's metrics on 0.0.0.0:9090"), "{e}");
    // The chart's ctl listener is on the pod's loopback: not exposed.
    assert_eq!(a.scheduler_listen, Some("127.0.0.1:50052".parse().unwrap()));
    assert!(!e.contains("its scheduler's gRPC API"), "{e}");
    a.scheduler_ops_listen = Some("127.0.0.1:9091".parse().unwrap());
    let e = crate::cmd::check_exposure(&a.discovery, &a.listeners()).unwrap_err().to_string();
    assert!(!e.contains("its scheduler's metrics"), "{e}");
    a.scheduler_listen = Some("0.0.0.0:50052".parse().unwrap());
    let e = crate::cmd::check_exposure(&a.discovery, &a.listeners()).unwrap_err().to_string();
    assert!(e.contains("its scheduler's gRPC API on 0.0.0.0:50052"), "{e}");
    a.discovery.token = Some("the cluster's".into());
    crate::cmd::check_exposure(&a.discovery, &a.listeners()).unwrap();
}

/// An empty token (`HANDOFF_TOKEN=` left blank, or `--token=`) is refused, not taken as a
/// secret anyone can send (which would also pass the check that refuses open listeners).
#[test]
fn an_empty_token_is_refused() {
    let e = scheduler(&["--token="]).unwrap_err().to_string();
    assert!(e.contains("--token"), "{e}");
    assert_eq!(scheduler(&["--token=s3cret"]).unwrap().discovery.token.as_deref(), Some("s3cret"));
}

/// `--request-timeout-secs` sets the deadline of requests naming none, on the frontend and
/// on `up`; 0 (every request failing at once) and past a day are refused. The HTTP API's
/// connections are bounded by `--max-connections`, sequences decoded at once by
/// `--max-decoding` (at least 1).
#[test]
fn the_request_timeout_and_http_connections_are_flags_within_bounds() {
    assert_eq!(frontend(&[]).unwrap().requests.request_timeout().as_secs(), 60);
    let a = frontend(&["--request-timeout-secs=600"]).unwrap();
    assert_eq!(a.requests.request_timeout().as_secs(), 600);
    assert_eq!(frontend(&[]).unwrap().requests.http().max_connections, 16_384);
    assert_eq!(frontend(&[]).unwrap().requests.http().head_timeout.as_secs(), 90);
    let a = frontend(&["--http-idle-secs=700"]).unwrap();
    assert_eq!(a.requests.http().head_timeout.as_secs(), 700);
    assert_eq!(a.requests.http().grpc_quiet.as_secs(), 700);
    let a = frontend(&["--http-idle-secs=5"]).unwrap();
    assert_eq!(a.requests.http().grpc_quiet.as_secs(), 45, "never below a ping's round");
    let a = frontend(&["--max-connections=20000"]).unwrap();
    assert_eq!(a.requests.http().max_connections, 20_000);
    assert!(frontend(&["--max-connections=0"]).is_err());
    assert_eq!(frontend(&[]).unwrap().requests.http().receiving_bytes, 256 << 20);
    let a = frontend(&["--max-receiving-mib=1024"]).unwrap();
    assert_eq!(a.requests.http().receiving_bytes, 1 << 30);
    // The KV held at once: 8 GiB by default, one request at most 4 GiB of it, never more
    // than the whole.
    let inbox = frontend(&[]).unwrap().requests.inbox();
    assert_eq!((inbox.max_total_bytes, inbox.max_region_bytes), (8 << 30, 4 << 30));
    let inbox = frontend(&["--max-kv-mib", "2048"]).unwrap().requests.inbox();
    assert_eq!((inbox.max_total_bytes, inbox.max_region_bytes), (2 << 30, 2 << 30));
    assert!(frontend(&["--max-kv-mib", "0"]).is_err());
    assert!(frontend(&["--max-receiving-mib=31"]).is_err(), "room for a 16 MiB gRPC message");
    for bad in ["0", "86401"] {
        let e = frontend(&[&format!("--request-timeout-secs={bad}")]).unwrap_err();
        assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation, "{bad}");
    }
    assert_eq!(frontend(&[]).unwrap().requests.max_decoding(), None);
    assert_eq!(frontend(&["--max-decoding=8"]).unwrap().requests.max_decoding(), Some(8));
    assert!(frontend(&["--max-decoding=0"]).is_err());
    let argv = ["handoff", "up", "--request-timeout-secs", "5", "--max-decoding", "3"];
    match Cli::try_parse_from(argv).unwrap().command {
        Command::Up(a) => {
            assert_eq!(a.requests.request_timeout().as_secs(), 5);
            assert_eq!(a.requests.max_decoding(), Some(3));
        }
        other => panic!("parsed as {other:?}"),
    }
}

/// `handoff up` starts at least one prefill: zero would never be ready.
#[test]
fn up_refuses_zero_prefills() {
    let e = Cli::try_parse_from(["handoff", "up", "--prefills", "0"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ValueValidation);
    assert!(Cli::try_parse_from(["handoff", "up", "--prefills", "1"]).is_ok());
}

/// A lease shorter than etcd grants, or so long a dead instance stays listed for hours (or
/// whose seconds overflow etcd's signed TTL), is refused at the flag.
#[test]
fn lease_ttls_are_bounded() {
    for (ttl, ok) in [("1", false), ("2", true), ("300", true), ("301", false)] {
        let got = scheduler(&["--lease-ttl-secs", ttl]);
        assert_eq!(got.is_ok(), ok, "{ttl}: {got:?}");
    }
    let e = scheduler(&["--lease-ttl-secs", "18446744073709551615"]).unwrap_err().to_string();
    assert!(e.contains("--lease-ttl-secs"), "{e}");
}

/// How often certificate files are read again: 0 (never) to a day; a value whose interval
/// would overflow the clock is refused at the command line, not panicked on later.
#[test]
fn tls_reloads_are_bounded() {
    for (secs, ok) in [("0", true), ("1", true), ("86400", true), ("86401", false)] {
        let got = scheduler(&["--tls-reload-secs", secs]);
        assert_eq!(got.is_ok(), ok, "{secs}: {got:?}");
    }
}

/// The arguments the Helm chart gives a prefill with `tls.existingSecret` (deploy/helm,
/// `ci/tls-values.yaml`; the kubelet puts the pod's name for `$(POD_NAME)`) parse into the
/// cluster's TLS, advertised and dialed for transfers by the pod's DNS name.
#[test]
fn the_charts_tls_arguments_parse() {
    let pod = "ci-handoff-prefill-7d9f8c6b5-x2x9k.ci-handoff-prefill.default.svc.cluster.local";
    let advertise = format!("--advertise-host={pod}");
    let transfer = format!("--transfer-advertise={pod}");
    let chart = [
        "--id=ci-handoff-prefill-7d9f8c6b5-x2x9k",
        "--bootstrap-listen=0.0.0.0:8998",
        "--grpc-listen=0.0.0.0:50060",
        "--ops-listen=0.0.0.0:9090",
        &advertise,
        "--transfer-bind=10.0.0.7",
        &transfer,
        "--tls-cert=/etc/handoff/tls/tls.crt",
        "--tls-key=/etc/handoff/tls/tls.key",
        "--tls-ca=/etc/handoff/tls/ca.crt",
        "--transfer=tcp",
        "--engine=mock",
        "--drain-secs=30",
        "--etcd-ca=/etc/etcd-client/ca.crt",
    ];
    let argv = ["handoff", "prefill"].iter().chain(&chart).copied();
    let Command::Prefill(a) = Cli::try_parse_from(argv).unwrap().command else {
        panic!("not a prefill")
    };
    assert_eq!(a.advertise_host, pod);
    assert_eq!(a.discovery.transfer_advertise.as_deref(), Some(pod));
    assert_eq!(a.discovery.tls_ca, Some("/etc/handoff/tls/ca.crt".into()));
    assert_eq!(a.discovery.access.etcd_ca, Some("/etc/etcd-client/ca.crt".into()));
}
