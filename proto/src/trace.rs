//! W3C trace context (`traceparent: 00-<trace id>-<span id>-<flags>`) carried in gRPC
//! metadata and HTTP headers, so one request's spans and log lines share a trace id across
//! the frontend, the scheduler replica and the prefill instance that served it.

use std::fmt;

/// The metadata key and HTTP header.
pub const TRACEPARENT: &str = "traceparent";

/// A trace id and the id of the span that sent it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct TraceContext {
    trace_id: u128,
    span_id: u64,
    sampled: bool,
    /// A caller's (parsed), not one begun here.
    remote: bool,
}

impl fmt::Debug for TraceContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.header())
    }
}

impl TraceContext {
    /// A new trace (random ids, sampled).
    pub fn new() -> Self {
        TraceContext {
            trace_id: rand::random::<u128>().max(1),
            span_id: rand::random::<u64>().max(1),
            sampled: true,
            remote: false,
        }
    }

    /// Parses a `traceparent` value; `None` if it is not a valid version-00 header (all-zero
    /// ids are invalid).
    pub fn parse(v: &str) -> Option<Self> {
        let mut parts = v.trim().split('-');
        let (version, trace, span, flags) =
            (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let hex = |s: &str, n: usize| s.len() == n && s.bytes().all(|b| b.is_ascii_hexdigit());
        if parts.next().is_some()
            || version != "00"
            || !hex(trace, 32)
            || !hex(span, 16)
            || !hex(flags, 2)
        {
            return None;
        }
        let trace_id = u128::from_str_radix(trace, 16).ok().filter(|&t| t != 0)?;
        let span_id = u64::from_str_radix(span, 16).ok().filter(|&s| s != 0)?;
        let sampled = u8::from_str_radix(flags, 16).ok()? & 1 == 1;
        Some(TraceContext { trace_id, span_id, sampled, remote: true })
    }

    /// The same trace, from a new span of ours.
    pub fn child(&self) -> Self {
        TraceContext { span_id: rand::random::<u64>().max(1), ..*self }
    }

    /// The trace id, as 32 hex digits (what log lines carry).
    pub fn trace_id(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The `traceparent` value.
    pub fn header(&self) -> String {
        format!("00-{:032x}-{:016x}-{:02x}", self.trace_id, self.span_id, u8::from(self.sampled))
    }

    /// From gRPC metadata: the caller's context, or a new trace.
    pub fn from_metadata(m: &tonic::metadata::MetadataMap) -> Self {
        m.get(TRACEPARENT)
            .and_then(|v| v.to_str().ok())
            .and_then(TraceContext::parse)
            .unwrap_or_default()
    }

    /// Binds this trace to `span` and records it as the span's `trace_id` field (declare it
    /// `Empty`): a caller's context becomes the span's remote parent; a trace begun here takes
    /// the span's own OpenTelemetry ids when spans are exported, so logs and export agree.
    /// Returns the trace as bound.
    pub fn bind(&self, span: &tracing::Span) -> TraceContext {
        let bound = if self.remote {
            handoff_core::otel::adopt(span, self.trace_id, self.span_id, self.sampled);
            *self
        } else {
            match handoff_core::otel::ids(span) {
                Some((trace_id, span_id)) => TraceContext { trace_id, span_id, ..*self },
                None => *self,
            }
        };
        span.record("trace_id", bound.trace_id());
        bound
    }

    /// Puts this trace into outgoing gRPC metadata, from the current span when OpenTelemetry
    /// records it (so the callee's span is its child), else from a new span id.
    pub fn inject(&self, m: &mut tonic::metadata::MetadataMap) {
        let from = match handoff_core::otel::current() {
            Some((trace_id, span_id)) => TraceContext { trace_id, span_id, ..*self },
            None => self.child(),
        };
        if let Ok(v) = from.header().parse() {
            m.insert(TRACEPARENT, v);
        }
    }
}

/// `req` carrying a child of `trace`.
pub fn traced<T>(mut req: tonic::Request<T>, trace: &TraceContext) -> tonic::Request<T> {
    trace.inject(req.metadata_mut());
    req
}

impl Default for TraceContext {
    fn default() -> Self {
        TraceContext::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_it_prints_and_refuses_the_rest() {
        let t = TraceContext::parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
            .expect("the W3C example");
        assert_eq!(t.trace_id(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(t.header(), "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
        let c = t.child();
        assert_eq!(c.trace_id(), t.trace_id());
        assert_ne!(c.header(), t.header());
        assert_eq!(TraceContext::parse(&c.header()), Some(c));
        for bad in [
            "",
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x",
            "00-+bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        ] {
            assert_eq!(TraceContext::parse(bad), None, "{bad:?}");
        }
        let mut m = tonic::metadata::MetadataMap::new();
        t.inject(&mut m);
        assert_eq!(TraceContext::from_metadata(&m).trace_id(), t.trace_id());
    }
}
