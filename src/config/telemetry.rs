//! The `telemetry` section, validated ([`TelemetryConfig`]): where spans go and how
//! ([`OtlpProtocol`]). Its defaults are with the others (`model.rs`, `defaults`); the
//! `OTEL_*` variables are applied over it by `telemetry::Settings::resolve`.

use std::time::Duration;

use serde::Deserialize;

/// How spans travel to the collector (`telemetry.otlp.protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
pub enum OtlpProtocol {
    /// OTLP over HTTP, protobuf bodies (`http/protobuf`).
    #[default]
    #[serde(rename = "http/protobuf")]
    HttpProtobuf,
    /// OTLP over gRPC, plaintext (`grpc`).
    #[serde(rename = "grpc")]
    Grpc,
}

impl OtlpProtocol {
    /// The name the config (and `OTEL_EXPORTER_OTLP_PROTOCOL`) uses.
    pub fn as_str(self) -> &'static str {
        match self {
            OtlpProtocol::HttpProtobuf => "http/protobuf",
            OtlpProtocol::Grpc => "grpc",
        }
    }

    /// A collector's URL for this protocol, checked: `http://` or `https://` and a host;
    /// `https` only over HTTP (the gRPC exporter has no TLS stack: see docs/configuration.md).
    pub fn endpoint(self, url: &str) -> Result<http::Uri, String> {
        let uri: http::Uri = url
            .parse()
            .map_err(|_| format!("'{url}' is not a URL: write e.g. http://collector:4318"))?;
        let scheme = uri.scheme_str().unwrap_or("");
        if uri.authority().is_none() || !(scheme == "http" || scheme == "https") {
            return Err(format!(
                "'{url}' is not an http:// or https:// URL with a host"
            ));
        }
        if self == OtlpProtocol::Grpc && scheme == "https" {
            return Err(format!(
                "'{url}': https is not supported with protocol grpc (the gRPC exporter is \
                 plaintext); use http/protobuf for TLS, or an http:// collector"
            ));
        }
        Ok(uri)
    }
}

/// `telemetry`, validated: what the file says, before the `OTEL_*` variables are applied.
#[derive(Debug, Clone, PartialEq)]
pub struct TelemetryConfig {
    /// `telemetry.otlp.endpoint` as written (checked: `http` or `https` with a host).
    pub endpoint: Option<http::Uri>,
    pub protocol: OtlpProtocol,
    /// Sent with every export; the values may be secrets and are never printed.
    pub headers: ExportHeaders,
    pub service_name: String,
    /// `0.0..=1.0`: the share of new traces (no sampled parent) recorded.
    pub sampling_ratio: f64,
    /// The bound on one export, retries included.
    pub timeout: Duration,
    /// Spans waiting for export at most; more are dropped and counted.
    pub max_queue_spans: usize,
}

/// The headers sent with every export, in order. `Debug` prints their names only: the values
/// are often credentials.
#[derive(Clone, Default, PartialEq)]
pub struct ExportHeaders(pub Vec<(http::HeaderName, http::HeaderValue)>);

impl std::ops::Deref for ExportHeaders {
    type Target = Vec<(http::HeaderName, http::HeaderValue)>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for ExportHeaders {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl std::fmt::Debug for ExportHeaders {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list()
            .entries(self.0.iter().map(|(n, _)| n.as_str()))
            .finish()
    }
}
