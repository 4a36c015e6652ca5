//! Logs and traces of the `handoff` process: text (coloured only on a terminal) or JSON logs
//! on stderr, filtered by `RUST_LOG`; with an OTLP endpoint, the same spans exported to an
//! OpenTelemetry collector over gRPC.

use std::io::IsTerminal;
use std::time::Duration;

use anyhow::Context;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::{BatchConfigBuilder, BatchSpanProcessor, SdkTracerProvider};
use tracing_subscriber::filter::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer, Registry};

use crate::args::LogFormat;

/// How often finished spans are sent to the collector.
const EXPORT_EVERY: Duration = Duration::from_millis(500);

/// Flushes and stops the span exporter when dropped (at the end of `main`).
#[derive(Debug)]
pub struct Telemetry(Option<SdkTracerProvider>);

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.0.take() {
            let _ = p.shutdown();
        }
    }
}

/// Installs the process's logging, and span export to `otlp` (a collector's gRPC endpoint,
/// e.g. `http://127.0.0.1:4317`) as `service`, when given. Call within the tokio runtime.
pub fn init(format: LogFormat, otlp: Option<&str>, service: &str) -> anyhow::Result<Telemetry> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let logs: Box<dyn Layer<Registry> + Send + Sync> = match format {
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::stderr().is_terminal())
            .with_writer(std::io::stderr)
            .with_filter(filter)
            .boxed(),
    };
    let provider = otlp.map(|endpoint| exporter(endpoint, service)).transpose()?;
    // Spans are exported at INFO whatever RUST_LOG says about logs.
    let spans = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("handoff"))
            .with_filter(LevelFilter::INFO)
            .boxed()
    });
    tracing_subscriber::registry().with(logs).with(spans).init();
    Ok(Telemetry(provider))
}

fn exporter(endpoint: &str, service: &str) -> anyhow::Result<SdkTracerProvider> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(Duration::from_secs(5))
        .build()
        .with_context(|| format!("OTLP exporter for {endpoint}"))?;
    let batches = BatchSpanProcessor::builder(exporter)
        .with_batch_config(BatchConfigBuilder::default().with_scheduled_delay(EXPORT_EVERY).build())
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batches)
        .with_resource(Resource::builder().with_service_name(service.to_owned()).build())
        .build())
}
