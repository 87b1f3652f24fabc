//! Traces: one server span per request, child spans for its stages, exported over OTLP.
//!
//! - `mod.rs` (here): the settings ([`Settings::resolve`]: the file's `telemetry` section
//!   with the standard `OTEL_*` variables over it), the tracer ([`Telemetry`]) and a
//!   request's trace ([`RequestTrace`]): the server span, its children, the `traceparent`
//!   sent upstream.
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

use std::sync::Arc;
use std::time::Duration;

use http::{HeaderMap, HeaderName, HeaderValue, Method, Uri};
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};
use prometheus_client::metrics::counter::Counter;

use crate::config::{OtlpProtocol, TelemetryConfig};

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

/// Where and how spans go: the file's `telemetry` section with the environment applied.
#[derive(Clone, PartialEq)]
pub struct Settings {
    /// The URL spans are sent to: over HTTP the full path (`/v1/traces`), over gRPC the
    /// collector's origin.
    pub endpoint: Uri,
    pub protocol: OtlpProtocol,
    /// Sent with every export; never printed (see the `Debug` impl).
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub service_name: String,
    pub sampling_ratio: f64,
    pub timeout: Duration,
    pub max_queue_spans: usize,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let headers: Vec<_> = self.headers.iter().map(|(n, _)| n.as_str()).collect();
        f.debug_struct("Settings")
            .field("endpoint", &self.endpoint)
            .field("protocol", &self.protocol)
            .field("headers", &headers)
            .field("service_name", &self.service_name)
            .field("sampling_ratio", &self.sampling_ratio)
            .field("timeout", &self.timeout)
            .field("max_queue_spans", &self.max_queue_spans)
            .finish()
    }
}

/// The OTLP path of traces over HTTP.
const TRACES_PATH: &str = "/v1/traces";

impl Settings {
    /// The settings in force: the file's, each overridden by its standard variable when
    /// that is set (the OpenTelemetry convention, so that a platform that injects
    /// `OTEL_EXPORTER_OTLP_ENDPOINT` points every service at its collector):
    ///
    /// - `OTEL_SDK_DISABLED=true`: off, whatever else is set.
    /// - `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (used as it is), else
    ///   `OTEL_EXPORTER_OTLP_ENDPOINT` (over HTTP, `/v1/traces` appended to its path), else
    ///   `telemetry.otlp.endpoint` (over HTTP, `/v1/traces` when it has no path); none: off.
    /// - `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`, else `OTEL_EXPORTER_OTLP_PROTOCOL`, else
    ///   `telemetry.otlp.protocol`: `http/protobuf` or `grpc`.
    /// - `OTEL_EXPORTER_OTLP_HEADERS` then `OTEL_EXPORTER_OTLP_TRACES_HEADERS`
    ///   (`name=value,...`, values percent-decoded), each name replacing the file's.
    /// - `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT`, else `OTEL_EXPORTER_OTLP_TIMEOUT`
    ///   (milliseconds), else `telemetry.otlp.timeout`.
    /// - `OTEL_SERVICE_NAME`, else `telemetry.service_name`.
    /// - `OTEL_TRACES_SAMPLER_ARG`, else `telemetry.sampling_ratio` (the sampler is always
    ///   parent-based over a trace-id ratio).
    ///
    /// `None`: tracing is off. An error names the variable (or the YAML path) at fault.
    pub fn resolve(
        file: &TelemetryConfig,
        env: &dyn Fn(&str) -> Option<String>,
    ) -> Result<Option<Settings>, String> {
        let var = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        if var("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let protocol = match var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            .map(|v| ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", v))
            .or_else(|| {
                var("OTEL_EXPORTER_OTLP_PROTOCOL").map(|v| ("OTEL_EXPORTER_OTLP_PROTOCOL", v))
            }) {
            None => file.protocol,
            Some((name, v)) => match v.trim() {
                "http/protobuf" => OtlpProtocol::HttpProtobuf,
                "grpc" => OtlpProtocol::Grpc,
                other => {
                    return Err(format!(
                        "{name}: '{other}' is not supported: write http/protobuf or grpc"
                    ));
                }
            },
        };
        let endpoint = if let Some(v) = var("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            protocol
                .endpoint(v.trim())
                .map_err(|m| format!("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: {m}"))?
        } else if let Some(v) = var("OTEL_EXPORTER_OTLP_ENDPOINT") {
            let base = protocol
                .endpoint(v.trim())
                .map_err(|m| format!("OTEL_EXPORTER_OTLP_ENDPOINT: {m}"))?;
            match protocol {
                OtlpProtocol::HttpProtobuf => with_path(&base, true)
                    .map_err(|m| format!("OTEL_EXPORTER_OTLP_ENDPOINT: {m}"))?,
                OtlpProtocol::Grpc => base,
            }
        } else if let Some(uri) = &file.endpoint {
            // Checked for the file's protocol; the environment may have changed it.
            let uri = protocol
                .endpoint(&uri.to_string())
                .map_err(|m| format!("telemetry.otlp.endpoint: {m}"))?;
            match protocol {
                OtlpProtocol::HttpProtobuf if matches!(uri.path(), "" | "/") => {
                    with_path(&uri, false).map_err(|m| format!("telemetry.otlp.endpoint: {m}"))?
                }
                _ => uri,
            }
        } else {
            return Ok(None);
        };
        let mut headers = file.headers.clone();
        for name in [
            "OTEL_EXPORTER_OTLP_HEADERS",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        ] {
            if let Some(list) = var(name) {
                for (k, v) in parse_headers(&list).map_err(|m| format!("{name}: {m}"))? {
                    headers.retain(|(n, _)| *n != k);
                    headers.push((k, v));
                }
            }
        }
        let timeout = match var("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT")
            .map(|v| ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", v))
            .or_else(|| {
                var("OTEL_EXPORTER_OTLP_TIMEOUT").map(|v| ("OTEL_EXPORTER_OTLP_TIMEOUT", v))
            }) {
            None => file.timeout,
            Some((name, v)) => match v.trim().parse::<u64>() {
                Ok(ms) if ms > 0 => Duration::from_millis(ms),
                _ => {
                    return Err(format!(
                        "{name}: '{v}' is not a number of milliseconds above 0"
                    ));
                }
            },
        };
        let service_name = var("OTEL_SERVICE_NAME")
            .map(|v| v.trim().to_string())
            .unwrap_or_else(|| file.service_name.clone());
        let sampling_ratio = match var("OTEL_TRACES_SAMPLER_ARG") {
            None => file.sampling_ratio,
            Some(v) => match v.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => r,
                _ => {
                    return Err(format!(
                        "OTEL_TRACES_SAMPLER_ARG: must be a number between 0.0 and 1.0, got '{v}'"
                    ));
                }
            },
        };
        Ok(Some(Settings {
            endpoint,
            protocol,
            headers,
            service_name,
            sampling_ratio,
            timeout,
            max_queue_spans: file.max_queue_spans,
        }))
    }
}

/// `base` with `/v1/traces` as its path (`append`: after its own path); its query dropped.
fn with_path(base: &Uri, append: bool) -> Result<Uri, String> {
    let prefix = if append {
        base.path().trim_end_matches('/')
    } else {
        ""
    };
    let mut parts = base.clone().into_parts();
    parts.path_and_query = Some(
        format!("{prefix}{TRACES_PATH}")
            .parse()
            .map_err(|_| "the URL's path cannot take /v1/traces".to_string())?,
    );
    Uri::from_parts(parts).map_err(|e| e.to_string())
}

/// `name=value,name=value`, the values percent-decoded (the OTLP exporter spec's format).
fn parse_headers(list: &str) -> Result<Vec<(HeaderName, HeaderValue)>, String> {
    let mut out = Vec::new();
    for item in list.split(',').map(str::trim).filter(|i| !i.is_empty()) {
        let Some((name, value)) = item.split_once('=') else {
            return Err(format!(
                "'{}' is not name=value",
                item.split('=').next().unwrap_or("")
            ));
        };
        let name = name.trim();
        let header = HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| format!("'{name}' is not a valid header name"))?;
        let decoded = percent_encoding::percent_decode_str(value.trim())
            .decode_utf8()
            .map_err(|_| format!("the value of '{name}' is not UTF-8 once decoded"))?;
        // The value is never echoed: it is often a credential.
        let value = HeaderValue::from_str(&decoded)
            .map_err(|_| format!("the value of '{name}' is not a valid header value"))?;
        out.push((header, value));
    }
    Ok(out)
}

/// What the exporter counts into `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Spans dropped: the queue was full, or their export failed.
    pub dropped: Counter,
    /// Spans the collector accepted.
    pub exported: Counter,
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
        let sampler = Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
            settings.sampling_ratio,
        )));
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
        RequestTrace {
            cx: parent.with_span(span),
            telemetry: Arc::clone(self),
            method: method.clone(),
        }
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
/// clone is dropped) and the way to its children. Cloned into the keyed request's task.
#[derive(Clone)]
pub struct RequestTrace {
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
        ChildSpan(self.telemetry.tracer.start_with_context(name, &self.cx))
    }

    /// The `forward` child span of an upstream call, its `traceparent` (and the client's
    /// `tracestate`) set in `headers`, replacing what the client sent.
    pub fn forward(&self, headers: &mut HeaderMap) -> ChildSpan {
        let span = self.telemetry.tracer.build_with_context(
            self.telemetry
                .tracer
                .span_builder("forward")
                .with_kind(SpanKind::Client),
            &self.cx,
        );
        let cx = Context::new()
            .with_remote_span_context(opentelemetry::trace::Span::span_context(&span).clone());
        headers.remove(TRACESTATE);
        self.telemetry
            .propagator
            .inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers));
        ChildSpan(span)
    }

    /// Ends the server span with what the access line says of the request.
    pub fn end(&self, route: &str, outcome: &'static str, status: u16, key_id: Option<&str>) {
        let span = self.cx.span();
        if !route.is_empty() {
            span.update_name(format!("{} {route}", self.method));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(endpoint: Option<&str>) -> TelemetryConfig {
        TelemetryConfig {
            endpoint: endpoint.map(|e| e.parse().unwrap()),
            headers: vec![(
                HeaderName::from_static("x-api-key"),
                HeaderValue::from_static("from-file"),
            )],
            ..TelemetryConfig::default()
        }
    }

    fn resolve(file: &TelemetryConfig, vars: &[(&str, &str)]) -> Result<Option<Settings>, String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Settings::resolve(file, &move |name| {
            vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
        })
    }

    #[test]
    fn off_without_an_endpoint_anywhere_or_when_the_sdk_is_disabled() {
        assert_eq!(resolve(&file(None), &[]).unwrap(), None);
        let on = file(Some("http://c:4318"));
        assert_eq!(
            resolve(&on, &[("OTEL_SDK_DISABLED", "TRUE")]).unwrap(),
            None
        );
        assert!(
            resolve(&on, &[("OTEL_SDK_DISABLED", "false")])
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn the_files_endpoint_gets_the_traces_path_only_when_it_has_none() {
        let s = resolve(&file(Some("http://c:4318")), &[]).unwrap().unwrap();
        assert_eq!(s.endpoint.to_string(), "http://c:4318/v1/traces");
        let s = resolve(&file(Some("http://c:4318/custom/traces")), &[])
            .unwrap()
            .unwrap();
        assert_eq!(s.endpoint.to_string(), "http://c:4318/custom/traces");
        assert_eq!(s.service_name, "idemgate");
        assert_eq!(s.sampling_ratio, 1.0);
    }

    #[test]
    fn the_standard_variables_override_the_file() {
        let f = file(Some("http://file:4318"));
        let s = resolve(
            &f,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318/base/"),
                ("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=from%20env,other=1"),
                ("OTEL_SERVICE_NAME", "edge"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "1500"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint.to_string(), "http://env:4318/base/v1/traces");
        assert_eq!(s.service_name, "edge");
        assert_eq!(s.sampling_ratio, 0.5);
        assert_eq!(s.timeout, Duration::from_millis(1500));
        let headers: Vec<_> = s
            .headers
            .iter()
            .map(|(n, v)| (n.as_str(), v.to_str().unwrap()))
            .collect();
        assert_eq!(headers, [("x-api-key", "from env"), ("other", "1")]);
        // The traces' own endpoint wins, taken as it is; gRPC takes the origin.
        let s = resolve(
            &f,
            &[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318"),
                ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4318/t"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(s.endpoint.to_string(), "http://traces:4318/t");
        let s = resolve(
            &f,
            &[
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4317"),
            ],
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            (s.protocol, s.endpoint.to_string().as_str()),
            (OtlpProtocol::Grpc, "http://env:4317/")
        );
    }

    #[test]
    fn a_bad_variable_is_an_error_that_names_it() {
        let f = file(Some("http://file:4318"));
        assert_eq!(
            resolve(&f, &[("OTEL_TRACES_SAMPLER_ARG", "2")]).unwrap_err(),
            "OTEL_TRACES_SAMPLER_ARG: must be a number between 0.0 and 1.0, got '2'"
        );
        assert_eq!(
            resolve(&f, &[("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")]).unwrap_err(),
            "OTEL_EXPORTER_OTLP_PROTOCOL: 'http/json' is not supported: write http/protobuf or grpc"
        );
        assert!(
            resolve(
                &f,
                &[
                    ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
                    ("OTEL_EXPORTER_OTLP_ENDPOINT", "https://c:4317")
                ]
            )
            .unwrap_err()
            .starts_with("OTEL_EXPORTER_OTLP_ENDPOINT: 'https://c:4317': https is not supported")
        );
        let e = resolve(&f, &[("OTEL_EXPORTER_OTLP_HEADERS", "authorization")]).unwrap_err();
        assert_eq!(
            e,
            "OTEL_EXPORTER_OTLP_HEADERS: 'authorization' is not name=value"
        );
    }
}
