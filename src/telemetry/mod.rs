//! Traces: one server span per request, child spans for its stages, exported over OTLP.
//!
//! - `mod.rs` (here): the tracer ([`Telemetry`]) and a request's trace ([`RequestTrace`]):
//!   the server span, its children, the `traceparent` sent upstream.
//! - `settings.rs`: the settings ([`Settings::resolve`]: the file's `telemetry` section with
//!   the standard `OTEL_*` variables over it).
//! - `export.rs`: the way out: a bounded queue and one exporter thread; what it drops is
//!   counted.
//!
//! Spans are made with the OpenTelemetry API directly, not through `tracing`: the log
//! events stay log events (the access line bypasses `tracing` altogether), and nothing of
//! this module runs unless tracing is on.
//!
//! Invariants:
//! - Off (no endpoint, or `OTEL_SDK_DISABLED=true`): the gateway holds no [`Telemetry`], a
//!   request makes no span, and a client's `traceparent` and `tracestate` reach the upstream
//!   untouched. Each request pays one branch on an `Option`.
//! - On: the client's `traceparent` (W3C Trace Context) is the server span's parent, and the
//!   upstream gets a `traceparent` whose parent is the gateway's `forward` span (sampled or
//!   not: the flag says which), with the client's `tracestate`.
//! - A span carries the key's id (`KeyId`, a hash), never the key, its scope, a body or a
//!   credential.
//! - Export never runs on a request's path and never waits: a full queue drops the span
//!   (`idemgate_trace_spans_dropped_total`), and a collector that is slow or down only costs
//!   the exporter thread (`export.rs`).

mod export;
mod settings;

pub use export::Counters;
pub use settings::Settings;

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, Method};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

/// Attribute names of the server span (the child spans have only their names).
pub mod attribute {
    /// The route's name (`routes[i].name`); empty when no route matched.
    pub const ROUTE: &str = "idemgate.route";
    /// What happened to the request: the outcome names of the access log and metrics.
    pub const OUTCOME: &str = "idemgate.outcome";
    /// The key's id (a hash of scope and key, as in the access log), on keyed requests.
    pub const KEY_ID: &str = "idemgate.key_id";
    /// The status sent to the client.
    pub const STATUS: &str = "http.response.status_code";
    /// The request's method.
    pub const METHOD: &str = "http.request.method";
}

/// The tracer of a process whose tracing is on; a request reaches it through its
/// [`RequestTrace`].
pub struct Telemetry {
    tracer: SdkTracer,
    provider: SdkTracerProvider,
    propagator: TraceContextPropagator,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry").finish_non_exhaustive()
    }
}

impl Telemetry {
    /// Starts the exporter thread and the tracer. Fails only when the exporter cannot be
    /// built (a thread or runtime that cannot start); a collector that does not answer is
    /// no error here.
    pub fn start(settings: &Settings, counters: Counters) -> Result<Arc<Telemetry>, String> {
        let resource = opentelemetry_sdk::Resource::builder()
            .with_service_name(settings.service_name.clone())
            .build();
        let queue = export::Queue::start(settings, resource.clone(), counters)?;
        let ratio = Sampler::TraceIdRatioBased(settings.sampling_ratio);
        let sampler = if settings.parent_based {
            Sampler::ParentBased(Box::new(ratio))
        } else {
            ratio
        };
        let provider = SdkTracerProvider::builder()
            .with_span_processor(queue)
            .with_sampler(sampler)
            .with_resource(resource)
            .build();
        let tracer = provider.tracer("idemgate");
        tracing::info!(
            endpoint = %settings.endpoint,
            protocol = settings.protocol.as_str(),
            sampling_ratio = settings.sampling_ratio,
            parent_based = settings.parent_based,
            "traces exported over OTLP"
        );
        Ok(Arc::new(Telemetry {
            tracer,
            provider,
            propagator: TraceContextPropagator::new(),
        }))
    }

    /// The server span of a request that just arrived, its parent the client's
    /// `traceparent` when it sent a valid one.
    pub fn server_span(self: &Arc<Self>, method: &Method, headers: &HeaderMap) -> RequestTrace {
        let parent = self.propagator.extract_with_context(
            &Context::new(),
            &opentelemetry_http::HeaderExtractor(headers),
        );
        let builder = self
            .tracer
            .span_builder(method.as_str().to_owned())
            .with_kind(SpanKind::Server)
            .with_attributes([KeyValue::new(attribute::METHOD, method.as_str().to_owned())]);
        let span = self.tracer.build_with_context(builder, &parent);
        RequestTrace(Arc::new(TraceInner {
            cx: parent.with_span(span),
            telemetry: Arc::clone(self),
            method: method.clone(),
        }))
    }

    /// Exports what is queued, waiting at most `bound` (graceful shutdown); spans that end
    /// later are not exported.
    pub fn shutdown(&self, bound: Duration) {
        if let Err(e) = self.provider.shutdown_with_timeout(bound) {
            tracing::warn!(error = %e, "traces: not every span was exported at shutdown");
        }
    }
}

/// A request's trace: its server span (ended by [`RequestTrace::end`], or when the last
/// clone is dropped) and the way to its children. Cloned into the keyed request's task; one
/// pointer wide, so the request's state grows by a word when traces are off.
#[derive(Clone)]
pub struct RequestTrace(Arc<TraceInner>);

struct TraceInner {
    /// Holds the server span.
    cx: Context,
    telemetry: Arc<Telemetry>,
    /// The request's method: the span is named `METHOD route` once the route is known.
    method: Method,
}

/// A child span of a request's server span; it ends when dropped.
pub struct ChildSpan(#[allow(dead_code)] opentelemetry_sdk::trace::Span);

impl RequestTrace {
    /// A child span named `name` (`claim`, `wait`, `record`), ended when dropped.
    pub fn child(&self, name: &'static str) -> ChildSpan {
        ChildSpan(self.0.telemetry.tracer.start_with_context(name, &self.0.cx))
    }

    /// The `forward` child span of an upstream call, its `traceparent` (and the client's
    /// `tracestate`) set in `headers`, replacing what the client sent.
    pub fn forward(&self, headers: &mut HeaderMap) -> ChildSpan {
        let span = self.0.telemetry.tracer.build_with_context(
            self.0
                .telemetry
                .tracer
                .span_builder("forward")
                .with_kind(SpanKind::Client),
            &self.0.cx,
        );
        let cx = Context::new()
            .with_remote_span_context(opentelemetry::trace::Span::span_context(&span).clone());
        headers.remove(TRACESTATE);
        self.0
            .telemetry
            .propagator
            .inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers));
        ChildSpan(span)
    }

    /// Ends the server span with what the access line says of the request.
    pub fn end(&self, route: &str, outcome: &'static str, status: u16, key_id: Option<&str>) {
        let span = self.0.cx.span();
        if !route.is_empty() {
            span.update_name(format!("{} {route}", self.0.method));
        }
        span.set_attribute(KeyValue::new(attribute::ROUTE, route.to_owned()));
        span.set_attribute(KeyValue::new(attribute::OUTCOME, outcome));
        span.set_attribute(KeyValue::new(attribute::STATUS, i64::from(status)));
        if let Some(id) = key_id {
            span.set_attribute(KeyValue::new(attribute::KEY_ID, id.to_owned()));
        }
        if status >= 500 {
            span.set_status(opentelemetry::trace::Status::error(outcome));
        }
        span.end();
    }
}

const TRACESTATE: HeaderName = HeaderName::from_static("tracestate");
