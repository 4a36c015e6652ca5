//! Linking handoff's spans into OpenTelemetry traces across processes: a span adopts the
//! caller's (trace id, span id) as its remote parent, and outgoing calls carry the current
//! span's ids. Both are no-ops unless the process installed an OpenTelemetry layer
//! (`handoff --otlp-endpoint`).

use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Makes the remote span `(trace_id, span_id)` the parent of `span`.
pub fn adopt(span: &tracing::Span, trace_id: u128, span_id: u64, sampled: bool) {
    let flags = if sampled { TraceFlags::SAMPLED } else { TraceFlags::default() };
    let remote = SpanContext::new(
        TraceId::from_bytes(trace_id.to_be_bytes()),
        SpanId::from_bytes(span_id.to_be_bytes()),
        flags,
        true,
        TraceState::default(),
    );
    let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(remote));
}

/// The current span's (trace id, span id), when an OpenTelemetry layer records it.
pub fn current() -> Option<(u128, u64)> {
    ids(&tracing::Span::current())
}

/// `span`'s (trace id, span id), when an OpenTelemetry layer records it.
pub fn ids(span: &tracing::Span) -> Option<(u128, u64)> {
    let cx = span.context();
    let span = cx.span();
    let sc = span.span_context();
    sc.is_valid().then(|| {
        (u128::from_be_bytes(sc.trace_id().to_bytes()), u64::from_be_bytes(sc.span_id().to_bytes()))
    })
}
