//! Spans exported over OTLP from three processes land in one trace, linked parent to child:
//! the caller's span, the frontend's request and attempt, the scheduler's selection and the
//! prefill. The collector is a small OTLP/gRPC receiver on OpenTelemetry's own proto
//! definitions.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;

use super::operations::{post_completion, spawn_frontend, wait_ready, wait_routable};
use super::processes::addr_after;
use super::servers::{Handoff, Server};

/// A received span: its service, name, ids and parent.
#[derive(Debug, Clone)]
struct Got {
    service: String,
    name: String,
    trace_id: String,
    span_id: String,
    parent: String,
}

#[derive(Debug, Clone, Default)]
struct Collector(Arc<Mutex<Vec<Got>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        let mut got = self.0.lock().unwrap();
        for rs in req.into_inner().resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|a| a.key == "service.name")
                .and_then(|a| match a.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for span in rs.scope_spans.into_iter().flat_map(|s| s.spans) {
                got.push(Got {
                    service: service.clone(),
                    name: span.name,
                    trace_id: hex(&span.trace_id),
                    span_id: hex(&span.span_id),
                    parent: hex(&span.parent_span_id),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_from_three_processes_form_one_linked_trace() {
    let collector = Collector::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", l.local_addr().unwrap());
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(handoff_proto::grpc::cluster_incoming(l)),
    );
    let etcd = Server::etcd();
    let nats = Server::nats();
    let d =
        ["--otlp-endpoint", &endpoint, "--etcd", etcd.url.as_str(), "--nats", nats.url.as_str()];
    let (_sched, line) = Handoff::spawn(
        &[&["scheduler", "--listen", "127.0.0.1:0", "--ops-listen", "127.0.0.1:0"][..], &d]
            .concat(),
    );
    let sched_ops = addr_after(&line, "ops http://");
    let _prefill = Handoff::spawn(
        &[
            &["prefill", "--engine", "mock", "--id", "p1"][..],
            &["--bootstrap-listen", "127.0.0.1:0", "--grpc-listen", "127.0.0.1:0"],
            &d,
        ]
        .concat(),
    );
    let (_fe, line) = spawn_frontend(&d);
    let fe_http = addr_after(&line, "http://");
    wait_ready(&fe_http, Duration::from_secs(10)).await;
    // Routable at the scheduler too, so the one request is served at its first try.
    wait_routable(&sched_ops, 1).await;
    let (trace_id, caller) = ("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7");
    post_completion(&fe_http, &format!("00-{trace_id}-{caller}-01")).await;

    let want = [
        ("handoff-frontend", "request"),
        ("handoff-frontend", "attempt"),
        ("handoff-scheduler", "select"),
        ("handoff-prefill", "prefill"),
    ];
    let start = Instant::now();
    let spans = loop {
        let got: Vec<Got> = collector
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|g| g.trace_id == trace_id)
            .cloned()
            .collect();
        if want.iter().all(|(s, n)| got.iter().any(|g| &g.service == s && &g.name == n)) {
            break got;
        }
        assert!(start.elapsed() < Duration::from_secs(15), "spans of the trace: {got:#?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let one = |name: &str| {
        let all: Vec<&Got> = spans.iter().filter(|g| g.name == name).collect();
        // Retried attempts would make more; this request has one of each.
        assert_eq!(all.len(), 1, "{name}: {spans:#?}");
        all[0].clone()
    };
    let (request, attempt, select, prefill) =
        (one("request"), one("attempt"), one("select"), one("prefill"));
    assert_eq!(request.parent, caller, "the caller's span is the request's parent");
    assert_eq!(select.parent, request.span_id, "the scheduler's selection is the request's child");
    assert_eq!(attempt.parent, request.span_id);
    assert_eq!(prefill.parent, attempt.span_id, "the prefill is the attempt's child");
    server.abort();
}
