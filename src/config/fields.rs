//! Field helpers of validation: one YAML value each (a duration, a size, an address, a list
//! of methods, a header name, a JSON pointer), its path named in any error.

use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Method};

use super::model::{ConfigError, invalid};
use super::raw::RawSize;
use super::units::{parse_duration, parse_size};

pub(super) fn duration_or(
    path: &str,
    v: Option<&String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => {
            let d = parse_duration(s).map_err(|m| invalid(path, m))?;
            if d.is_zero() {
                return Err(invalid(path, "must be greater than zero"));
            }
            Ok(d)
        }
    }
}

/// As [`duration_or`], but zero is allowed (`0s` switches the delay off).
pub(super) fn duration_or_zero(
    path: &str,
    v: Option<&String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => parse_duration(s).map_err(|m| invalid(path, m)),
    }
}

pub(super) fn size_or(
    path: &str,
    v: Option<&RawSize>,
    default: usize,
) -> Result<usize, ConfigError> {
    match v {
        None => Ok(default),
        Some(RawSize::Bytes(n)) => usize::try_from(*n).map_err(|_| invalid(path, "too large")),
        Some(RawSize::Text(s)) => parse_size(s).map_err(|m| invalid(path, m)),
    }
}

pub(super) fn socket_addr(path: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| {
        invalid(
            path,
            format!("'{s}' is not an address: write IP:PORT, e.g. 0.0.0.0:8080"),
        )
    })
}

/// A list of methods: standard ones in any case, or names listed in `extra_methods`.
pub(super) fn methods(
    path: &str,
    list: &[String],
    extra: &[Method],
) -> Result<Vec<Method>, ConfigError> {
    if list.is_empty() {
        return Err(invalid(path, "must name at least one method"));
    }
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let at = format!("{path}[{i}]");
            let upper = m.to_ascii_uppercase();
            if upper == "CONNECT" {
                return Err(invalid(
                    at,
                    "CONNECT is never routed (the gateway answers it 405)",
                ));
            }
            if STANDARD_METHODS.contains(&upper.as_str()) {
                return Ok(Method::from_bytes(upper.as_bytes()).expect("a standard method"));
            }
            extra
                .iter()
                .find(|e| e.as_str() == m)
                .cloned()
                .ok_or_else(|| {
                    invalid(
                        at,
                        format!(
                            "'{m}' is not a standard method ({}); list it in extra_methods \
                             if the upstream really takes it",
                            STANDARD_METHODS.join(", ")
                        ),
                    )
                })
        })
        .collect()
}

pub(super) fn header_name(path: &str, s: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(s.as_bytes())
        .map_err(|_| invalid(path, format!("'{s}' is not a valid header name")))
}

pub(super) fn json_pointer(path: &str, s: &str) -> Result<String, ConfigError> {
    if !s.starts_with('/') {
        return Err(invalid(
            path,
            format!("'{s}' is not a JSON pointer: it must start with '/', e.g. /event_id"),
        ));
    }
    Ok(s.to_string())
}

/// The methods a route may name without `extra_methods` (CONNECT is never routed: 405).
pub(super) const STANDARD_METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH",
];
