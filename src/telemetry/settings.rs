//! The settings of traces: the file's `telemetry` section with the standard `OTEL_*`
//! variables over it ([`Settings::resolve`]).
//!
//! Invariants: every error names the variable (or the YAML path) at fault; header values
//! (often credentials) are never printed, neither in an error nor by `Debug`.

use std::time::Duration;

use http::{HeaderName, HeaderValue, Uri};

use crate::config::{ExportHeaders, OtlpProtocol, TelemetryConfig};

/// Where and how spans go: the file's `telemetry` section with the environment applied.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// The URL spans are sent to: over HTTP the full path (`/v1/traces`), over gRPC the
    /// collector's origin.
    pub endpoint: Uri,
    pub protocol: OtlpProtocol,
    /// Sent with every export; their values are never printed.
    pub headers: ExportHeaders,
    pub service_name: String,
    /// The share of new traces sampled (by trace id).
    pub sampling_ratio: f64,
    /// Whether a client's `traceparent` decides for its trace (its sampled flag), the ratio
    /// deciding only for a trace the gateway starts (the default); otherwise the ratio
    /// decides for every trace.
    pub parent_based: bool,
    pub timeout: Duration,
    pub max_queue_spans: usize,
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
    /// - `OTEL_TRACES_SAMPLER`: `parentbased_traceidratio` (what the file gives),
    ///   `parentbased_always_on`, `parentbased_always_off`, `traceidratio`, `always_on`,
    ///   `always_off`; any other is an error. For the two ratio samplers,
    ///   `OTEL_TRACES_SAMPLER_ARG`, else `telemetry.sampling_ratio`, is the ratio.
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
        let ratio = match var("OTEL_TRACES_SAMPLER_ARG") {
            None => Ok(file.sampling_ratio),
            Some(v) => match v.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
                _ => Err(format!(
                    "OTEL_TRACES_SAMPLER_ARG: must be a number between 0.0 and 1.0, got '{v}'"
                )),
            },
        };
        let sampler = var("OTEL_TRACES_SAMPLER").map(|v| v.trim().to_ascii_lowercase());
        let (parent_based, sampling_ratio) = match sampler.as_deref() {
            None | Some("parentbased_traceidratio") => (true, ratio?),
            Some("parentbased_always_on") => (true, 1.0),
            Some("parentbased_always_off") => (true, 0.0),
            Some("traceidratio") => (false, ratio?),
            Some("always_on") => (false, 1.0),
            Some("always_off") => (false, 0.0),
            Some(other) => {
                return Err(format!(
                    "OTEL_TRACES_SAMPLER: '{other}' is not supported: write \
                     parentbased_traceidratio, parentbased_always_on, parentbased_always_off, \
                     traceidratio, always_on or always_off"
                ));
            }
        };
        Ok(Some(Settings {
            endpoint,
            protocol,
            headers,
            service_name,
            sampling_ratio,
            parent_based,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn file(endpoint: Option<&str>) -> TelemetryConfig {
        TelemetryConfig {
            endpoint: endpoint.map(|e| e.parse().unwrap()),
            headers: ExportHeaders(vec![(
                HeaderName::from_static("x-api-key"),
                HeaderValue::from_static("from-file"),
            )]),
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
    fn the_sampler_variable_chooses_the_sampler_and_its_argument_the_ratio() {
        let mut f = file(Some("http://file:4318"));
        f.sampling_ratio = 0.25;
        let sampler = |env: &[(&str, &str)]| {
            let s = resolve(&f, env).unwrap().unwrap();
            (s.parent_based, s.sampling_ratio)
        };
        assert_eq!(sampler(&[]), (true, 0.25));
        assert_eq!(sampler(&[("OTEL_TRACES_SAMPLER_ARG", "0.5")]), (true, 0.5));
        let arg = ("OTEL_TRACES_SAMPLER_ARG", "0.5");
        for (name, want) in [
            ("parentbased_traceidratio", (true, 0.5)),
            ("ParentBased_Always_On", (true, 1.0)),
            ("parentbased_always_off", (true, 0.0)),
            ("traceidratio", (false, 0.5)),
            ("always_on", (false, 1.0)),
            ("always_off", (false, 0.0)),
        ] {
            assert_eq!(
                sampler(&[("OTEL_TRACES_SAMPLER", name), arg]),
                want,
                "{name}"
            );
        }
        assert_eq!(
            sampler(&[("OTEL_TRACES_SAMPLER", "traceidratio")]),
            (false, 0.25),
            "without an argument, the file's ratio"
        );
        // The argument of a sampler that takes none is not read.
        assert_eq!(
            sampler(&[
                ("OTEL_TRACES_SAMPLER", "always_on"),
                ("OTEL_TRACES_SAMPLER_ARG", "x")
            ]),
            (false, 1.0)
        );
        assert_eq!(
            resolve(&f, &[("OTEL_TRACES_SAMPLER", "jaeger_remote")]).unwrap_err(),
            "OTEL_TRACES_SAMPLER: 'jaeger_remote' is not supported: write \
             parentbased_traceidratio, parentbased_always_on, parentbased_always_off, \
             traceidratio, always_on or always_off"
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
