//! What an operator sees: `/metrics`, `/livez` and `/readyz` on every role of a cluster of
//! separate processes, readiness that follows what a role can do, `handoff ctl` against it,
//! and every metric the shipped Grafana dashboard queries present in a live scrape.

use std::time::{Duration, Instant};

use handoff_proto::v1::generate_client::GenerateClient;

use super::processes::{addr_after, one};
use super::servers::{Handoff, Server};

/// `GET path` at `addr`: the status code and body.
pub(crate) async fn http_get(addr: &str, path: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    let ask = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    s.write_all(ask.as_bytes()).await.unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).await.unwrap();
    let code = out.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = out.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    (code, body.to_owned())
}

/// The value of the sample `series` (name with labels, as printed) in a scrape.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
}

/// Waits until the scheduler whose ops listener is `ops` routes to `n` instances.
pub(crate) async fn wait_routable(ops: &str, n: usize) {
    let series = "handoff_scheduler_instances{routable=\"true\"}";
    let start = Instant::now();
    loop {
        let scrape = http_get(ops, "/metrics").await.1;
        if sample(&scrape, series).unwrap_or(0.0) as usize == n {
            return;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{n} routable: {scrape}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A `handoff frontend` (mock engine, ephemeral ports) with `d`'s flags, and its ready line.
pub(crate) fn spawn_frontend(d: &[&str]) -> (Handoff, String) {
    Handoff::spawn(
        &[
            &["frontend", "--engine", "mock", "--listen", "127.0.0.1:0"][..],
            &["--http-listen", "127.0.0.1:0"],
            d,
        ]
        .concat(),
    )
}

pub(crate) async fn wait_ready(addr: &str, within: Duration) {
    let start = Instant::now();
    loop {
        let (code, body) = http_get(addr, "/readyz").await;
        if code == 200 {
            return;
        }
        assert!(start.elapsed() < within, "{addr} not ready within {within:?}: {body}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `handoff ctl` through `etcd` and `nats` with `args`: whether it succeeded, its stdout and
/// its stderr.
pub(crate) fn run_ctl(etcd: &Server, nats: &Server, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_handoff"))
        .args(["ctl", "--etcd", &etcd.url, "--nats", &nats.url])
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    let text = |b: Vec<u8>| String::from_utf8(b).unwrap();
    (out.status.success(), text(out.stdout), text(out.stderr))
}

/// [`run_ctl`]'s stdout; it must succeed.
fn ctl(etcd: &Server, nats: &Server, args: &[&str]) -> String {
    let (ok, out, err) = run_ctl(etcd, nats, args);
    assert!(ok, "ctl {args:?}: {err}");
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_role_serves_metrics_and_readiness_and_ctl_sees_the_cluster() {
    let etcd = Server::etcd();
    let nats = Server::nats();
    let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let (_sched, line) = Handoff::spawn(
        &[&["scheduler", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0"][..], &d]
            .concat(),
    );
    let sched_ops = addr_after(&line, "ops http://");
    wait_ready(&sched_ops, Duration::from_secs(5)).await;
    let (_fe, line) = spawn_frontend(&d);
    let (fe_grpc, fe_http) = (addr_after(&line, "grpc://"), addr_after(&line, "http://"));
    assert_eq!(http_get(&fe_http, "/livez").await, (200, "ok".to_owned()));
    let (code, why) = http_get(&fe_http, "/readyz").await;
    assert_eq!((code, why.as_str()), (503, "not ready: no prefill instance registered"));

    let (_prefill, line) = Handoff::spawn(
        &[
            &["prefill", "--engine", "mock", "--id", "p1", "--tp", "2"][..],
            &["--bootstrap-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
            &["--ops-listen", "127.0.0.1:0"],
            &d,
        ]
        .concat(),
    );
    let prefill_ops = addr_after(&line, "ops http://");
    assert_eq!(http_get(&prefill_ops, "/readyz").await.0, 200, "ready once registered");
    wait_ready(&fe_http, Duration::from_secs(10)).await;

    let mut client = GenerateClient::connect(format!("http://{fe_grpc}")).await.unwrap();
    let start = Instant::now();
    let mut served = 0;
    while served < 5 {
        match one(&mut client, served).await {
            Ok(_) => served += 1,
            // The scheduler hears of the prefill a moment after the frontend does.
            Err(e) => assert!(start.elapsed() < Duration::from_secs(10), "{e}"),
        }
    }

    let fe = http_get(&fe_http, "/metrics").await.1;
    assert_eq!(sample(&fe, "handoff_frontend_requests_total{outcome=\"ok\"}"), Some(5.0), "{fe}");
    assert_eq!(sample(&fe, "handoff_frontend_ttft_seconds_count"), Some(5.0));
    assert_eq!(sample(&fe, "handoff_frontend_inter_token_seconds_count"), Some(15.0), "4 tokens");
    assert_eq!(sample(&fe, "handoff_frontend_stage_seconds_count{stage=\"transfer\"}"), Some(5.0));
    assert!(sample(&fe, "handoff_frontend_kv_received_bytes_total").unwrap() > 0.0);
    assert_eq!(sample(&fe, "handoff_frontend_prefills"), Some(1.0));
    assert_eq!(sample(&fe, "handoff_frontend_requests_in_flight"), Some(0.0));

    // The frontend reports each outcome once its stream is done, in a task of its own: the
    // scheduler may hear the last one a moment after the client has its answer.
    let reported = "handoff_scheduler_reports_total{outcome=\"success\"}";
    let mut sched = http_get(&sched_ops, "/metrics").await.1;
    while sample(&sched, reported).unwrap_or(0.0) < 5.0 {
        assert!(start.elapsed() < Duration::from_secs(20), "{sched}");
        tokio::time::sleep(Duration::from_millis(20)).await;
        sched = http_get(&sched_ops, "/metrics").await.1;
    }
    let ok = "handoff_scheduler_selections_total{policy=\"kv_aware\",result=\"ok\"}";
    assert!(sample(&sched, ok).unwrap() >= 5.0, "{sched}");
    assert_eq!(sample(&sched, "handoff_scheduler_instances{routable=\"true\"}"), Some(1.0));
    assert_eq!(
        sample(&sched, "handoff_scheduler_instance_breaker_open{prefill=\"p1\"}"),
        Some(0.0)
    );
    assert!(
        sample(&sched, "handoff_scheduler_instance_cached_blocks{prefill=\"p1\"}").unwrap() > 0.0
    );

    let pre = http_get(&prefill_ops, "/metrics").await.1;
    assert!(sample(&pre, "handoff_prefill_requests_total{result=\"ok\"}").unwrap() >= 5.0, "{pre}");
    assert!(sample(&pre, "handoff_prefill_kv_sent_bytes_total").unwrap() > 0.0);
    assert_eq!(sample(&pre, "handoff_prefill_queued{dp_rank=\"0\"}"), Some(0.0));

    // Served traffic, per process, by route and status.
    let served = |scrape: &str, route: &str, status: &str| {
        let series = format!(
            "handoff_served_requests_total{{protocol=\"{}\",route=\"{route}\",status=\"{status}\"}}",
            if route.starts_with("/handoff") { "grpc" } else { "http" }
        );
        sample(scrape, &series).unwrap_or(0.0)
    };
    assert!(served(&fe, "/handoff.v1.Generate/Generate", "0") >= 5.0, "{fe}");
    assert!(served(&fe, "/readyz", "503") >= 1.0, "{fe}");
    assert!(served(&sched, "/handoff.v1.Scheduler/SelectPrefill", "0") >= 5.0, "{sched}");
    assert!(served(&pre, "/handoff.v1.Prefill/Prefill", "0") >= 5.0, "{pre}");
    assert!(sched.contains("handoff_served_request_seconds_count{protocol=\"grpc\""));

    // Every metric the shipped dashboard queries exists in these live scrapes.
    let dashboard = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../deploy/grafana/handoff.json"
    ))
    .unwrap();
    let live = format!("{fe}{sched}{pre}");
    let queried = dashboard_metrics(&dashboard);
    assert!(queried.len() >= 10, "the dashboard queries {queried:?}");
    for name in queried {
        // Declared (a family with no series yet) or sampled.
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(&name);
        let exposed = live.lines().any(|l| {
            l.starts_with(&format!("# TYPE {base} "))
                || l.split(['{', ' ']).next().is_some_and(|n| n == name)
        });
        assert!(exposed, "the dashboard queries {name}, which no role exposes");
    }

    // handoff ctl, through etcd.
    let table = ctl(&etcd, &nats, &["instances"]);
    eprintln!("{table}");
    let p1 = table.lines().find(|l| l.starts_with("prefill")).unwrap();
    let cols: Vec<&str> = p1.split_whitespace().collect();
    assert_eq!(&cols[..7], ["prefill", "p1", "1", "2", "0", "closed", "yes"], "{table}");
    assert!(table.lines().any(|l| l.starts_with("scheduler")), "{table}");
    assert!(table.lines().any(|l| l.starts_with("frontend")), "{table}");

    // A request's evidence, by its room, from whichever frontend served it.
    let room = room_of(&mut client).await;
    let trace = ctl(&etcd, &nats, &["trace", &room.to_string()]);
    eprintln!("{trace}");
    assert!(trace.starts_with(&format!("room {room} (frontend ")), "{trace}");
    assert!(trace.contains(": OK after") && trace.contains("verify"), "{trace}");
    let json: serde_json::Value =
        serde_json::from_str(&ctl(&etcd, &nats, &["--json", "trace", &room.to_string()])).unwrap();
    assert_eq!(json["attempts"][0]["instance"], "p1", "{json}");
    assert!(json["attempts"][0]["stages_us"]["verify"].as_u64().unwrap() > 0, "{json}");
    let (code, body) = http_get(&fe_http, "/v1/debug/requests/12345").await;
    assert_eq!(code, 404, "{body}");
    assert_eq!(http_get(&fe_http, "/v1/debug/requests/x").await.0, 400);
    let json: serde_json::Value =
        serde_json::from_str(&ctl(&etcd, &nats, &["--json", "instances"])).unwrap();
    let first = &json["instances"][0];
    assert_eq!((first["id"].as_str(), first["breaker"].as_str()), (Some("p1"), Some("closed")));
    assert!(first["cached_blocks"].as_u64().unwrap() > 0, "{json}");
    let dir = ctl(&etcd, &nats, &["directory", "p1"]);
    eprintln!("{dir}");
    assert!(dir.contains("tp 2") && dir.contains(", complete"), "{dir}");
    assert_eq!(dir.lines().filter(|l| l.starts_with('0')).count(), 2, "two tp ranks: {dir}");

    // A drain takes the prefill out of routing: it is no longer ready, the frontend has no
    // prefill left and says so.
    let drained = ctl(&etcd, &nats, &["drain", "p1", "--grace-secs", "5"]);
    assert!(drained.starts_with("p1: out of routing, nothing in flight"), "{drained}");
    let (code, why) = http_get(&prefill_ops, "/readyz").await;
    assert_eq!(code, 503, "{why}");
    wait_routable(&sched_ops, 0).await;
    let start = Instant::now();
    while http_get(&fe_http, "/readyz").await.0 == 200 {
        assert!(start.elapsed() < Duration::from_secs(5), "the frontend sees the prefill go");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let err = one(&mut client, 99).await.expect_err("nothing to route to");
    assert_eq!(err.code(), tonic::Code::Unavailable, "{err}");
}

/// etcd, NATS, a scheduler, a slow prefill (20 ms per prompt token: a 40-token prompt
/// computes for 800 ms) and a frontend, as processes.
struct SlowFleet {
    etcd: Server,
    nats: Server,
    frontend: Handoff,
    _others: Vec<Handoff>,
    prefill_ops: String,
    client: GenerateClient<tonic::transport::Channel>,
}

impl SlowFleet {
    async fn start() -> SlowFleet {
        let etcd = Server::etcd();
        let nats = Server::nats();
        let d = ["--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
        let (sched, line) = Handoff::spawn(
            &[&["scheduler", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0"][..], &d]
                .concat(),
        );
        let sched_ops = addr_after(&line, "ops http://");
        let (prefill, line) = Handoff::spawn(
            &[
                &["prefill", "--engine", "mock", "--mock-prefill-us", "20000", "--id", "slow"][..],
                &["--bootstrap-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
                &["--ops-listen", "127.0.0.1:0"],
                &d,
            ]
            .concat(),
        );
        let prefill_ops = addr_after(&line, "ops http://");
        let (frontend, line) = spawn_frontend(&d);
        let client = GenerateClient::connect(format!("http://{}", addr_after(&line, "grpc://")))
            .await
            .unwrap();
        wait_routable(&sched_ops, 1).await;
        SlowFleet { etcd, nats, frontend, _others: vec![sched, prefill], prefill_ops, client }
    }

    /// Starts a request and waits until the prefill is computing it.
    async fn one_in_flight(&self) -> tokio::task::JoinHandle<Result<String, tonic::Status>> {
        let mut client = self.client.clone();
        let request = tokio::spawn(async move { one(&mut client, 7).await });
        let start = Instant::now();
        let running = "handoff_prefill_running";
        while sample(&http_get(&self.prefill_ops, "/metrics").await.1, running) != Some(1.0) {
            assert!(start.elapsed() < Duration::from_secs(5), "the request reaches the prefill");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        request
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_waits_for_the_requests_in_flight() {
    let f = SlowFleet::start().await;
    let request = f.one_in_flight().await;
    let drained = ctl(&f.etcd, &f.nats, &["drain", "slow", "--grace-secs", "10"]);
    assert!(drained.starts_with("slow: out of routing, nothing in flight"), "{drained}");
    assert_eq!(request.await.unwrap().unwrap(), "slow", "the request in flight was served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_lets_a_frontends_streams_finish() {
    let mut f = SlowFleet::start().await;
    let request = f.one_in_flight().await;
    let pid = f.frontend.child.id().to_string();
    assert!(std::process::Command::new("kill").args(["-TERM", &pid]).status().unwrap().success());
    assert_eq!(request.await.unwrap().unwrap(), "slow", "the stream in flight finished");
    let exited =
        tokio::task::spawn_blocking(move || f.frontend.child.wait()).await.unwrap().unwrap();
    assert!(exited.success(), "drained and exited cleanly: {exited:?}");
}

/// Posts a small completion with `traceparent` to the frontend's HTTP API until it is served
/// (the scheduler hears of the prefill a moment after the frontend does): the answer.
pub(crate) async fn post_completion(addr: &str, traceparent: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = r#"{"model": "", "prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], "max_tokens": 2}"#;
    let start = Instant::now();
    loop {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let ask = format!(
            "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
             traceparent: {traceparent}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(ask.as_bytes()).await.unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        if out.starts_with("HTTP/1.1 200") {
            return out;
        }
        assert!(start.elapsed() < Duration::from_secs(10), "{out}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A JSON log file in the temporary directory, removed when dropped.
struct LogFile(std::path::PathBuf);

impl LogFile {
    fn new(name: &str) -> Self {
        let p = std::env::temp_dir().join(format!("handoff-{}-{name}.log", std::process::id()));
        LogFile(p)
    }

    fn stdio(&self) -> std::process::Stdio {
        std::fs::File::create(&self.0).unwrap().into()
    }

    fn lines_with(&self, needle: &str) -> Vec<serde_json::Value> {
        let text = std::fs::read_to_string(&self.0).unwrap_or_default();
        text.lines()
            .filter(|l| l.contains(needle))
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }
}

impl Drop for LogFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_traceparent_reaches_the_scheduler_and_the_prefill_logs() {
    let etcd = Server::etcd();
    let nats = Server::nats();
    let d = ["--log-format", "json", "--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let (sched_log, prefill_log) = (LogFile::new("scheduler"), LogFile::new("prefill"));
    let (_sched, line) = Handoff::spawn_logging(
        &[&["scheduler", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0"][..], &d]
            .concat(),
        "handoff_scheduler=debug",
        sched_log.stdio(),
    );
    let sched_ops = addr_after(&line, "ops http://");
    let _prefill = Handoff::spawn_logging(
        &[
            &["prefill", "--engine", "mock", "--id", "p1"][..],
            &["--bootstrap-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
            &d,
        ]
        .concat(),
        "handoff_prefill=debug",
        prefill_log.stdio(),
    );
    let (_fe, line) = spawn_frontend(&d);
    let fe_http = addr_after(&line, "http://");
    wait_ready(&fe_http, Duration::from_secs(10)).await;
    wait_routable(&sched_ops, 1).await;

    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let answer = post_completion(&fe_http, &format!("00-{trace_id}-00f067aa0ba902b7-01")).await;
    // The client is told the trace id every log line of its request carries.
    assert!(answer.contains(&format!("x-trace-id: {trace_id}\r\n")), "{answer}");
    let seen = |log: &LogFile, message: &str| {
        let start = Instant::now();
        loop {
            let lines = log.lines_with(trace_id);
            if let Some(l) = lines.iter().find(|l| l["fields"]["message"] == message) {
                return l.clone();
            }
            assert!(start.elapsed() < Duration::from_secs(5), "{message:?} with the trace id");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let selected = seen(&sched_log, "prefill selected");
    assert_eq!(selected["span"]["trace_id"], trace_id, "{selected}");
    assert_eq!(selected["fields"]["instance"], "p1", "{selected}");
    let sent = seen(&prefill_log, "prefill sent");
    assert_eq!(sent["span"]["name"], "prefill", "{sent}");
    assert!(
        sent["span"]["room"].as_u64().unwrap() > 0,
        "the prefill's span names the room: {sent}"
    );
}

/// Sends one request and returns its room.
pub(crate) async fn room_of(client: &mut GenerateClient<tonic::transport::Channel>) -> u64 {
    use handoff_proto::v1::generate_response::Event;
    let req = handoff_proto::v1::GenerateRequest {
        input: Some(handoff_proto::v1::generate_request::Input::TokenIds(
            handoff_proto::v1::TokenIds { ids: vec![5; 40] },
        )),
        sampling: Some(handoff_proto::v1::SamplingParams { max_tokens: 2, ..Default::default() }),
        ..Default::default()
    };
    let mut s = client.generate(req).await.unwrap().into_inner();
    let mut room = 0;
    while let Some(m) = s.message().await.unwrap() {
        if let Some(Event::Complete(c)) = m.event {
            room = c.evidence.unwrap().bootstrap_room;
        }
    }
    assert_ne!(room, 0);
    room
}

/// Metric names in a Grafana dashboard's PromQL expressions (histogram series mapped to the
/// names a scrape prints: `_bucket`, `_sum` and `_count` kept as they are).
fn dashboard_metrics(dashboard: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(dashboard).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&v, &mut exprs);
    let mut names: Vec<String> = exprs
        .iter()
        .flat_map(|e| {
            e.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|w| w.starts_with("handoff_"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

fn collect_exprs(v: &serde_json::Value, out: &mut Vec<String>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, x) in m {
                match (k.as_str(), x) {
                    ("expr", serde_json::Value::String(s)) => out.push(s.clone()),
                    _ => collect_exprs(x, out),
                }
            }
        }
        serde_json::Value::Array(a) => a.iter().for_each(|x| collect_exprs(x, out)),
        _ => {}
    }
}
