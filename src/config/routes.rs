//! Validation of `routes` (called by `validate.rs`): each route's path, methods, upstream and
//! shadowing (`shadow.rs`), and its `idempotency` section, every error naming its YAML path.

use std::collections::BTreeMap;
use std::time::Duration;

use http::{HeaderName, Method};

use super::fields::*;
use super::model::{
    ConfigError, FingerprintConfig, Idempotency, InFlight, KeySource, OnStoreError,
    OnUnknownOutcome, PathMatch, Route, ScopeSource, SerializeConfig, ServerConfig, StatusSet,
    StoreConfig, UpstreamConfig, defaults, invalid,
};
use super::raw::{RawIdempotency, RawKeySource, RawRoute, RawScope, RawStatus};
use super::units::fmt_duration;

/// `routes`, in file order: at least one, names unique.
pub(super) fn validate_routes(
    raw: Vec<RawRoute>,
    upstreams: &BTreeMap<String, UpstreamConfig>,
    store: &StoreConfig,
    server: &ServerConfig,
    extra: &[Method],
) -> Result<Vec<Route>, ConfigError> {
    if raw.is_empty() {
        return Err(invalid("routes", "must list at least one route"));
    }
    let mut routes: Vec<Route> = Vec::with_capacity(raw.len());
    for (i, r) in raw.into_iter().enumerate() {
        let base = format!("routes[{i}]");
        if r.name.is_empty() {
            return Err(invalid(format!("{base}.name"), "must not be empty"));
        }
        if routes.iter().any(|other| other.name == r.name) {
            return Err(invalid(
                format!("{base}.name"),
                format!("route name '{}' is used twice", r.name),
            ));
        }
        routes.push(validate_route(&base, r, upstreams, store, server, extra)?);
        let j = routes.len() - 1;
        if let Some(by) = super::shadow::shadowed_by(&routes, j) {
            return Err(invalid(
                format!("{base}.match"),
                super::shadow::shadowed_error(&routes, j, &by),
            ));
        }
    }
    Ok(routes)
}

/// `extra_methods`: each an HTTP method token outside the standard set.
pub(super) fn validate_extra_methods(list: Vec<String>) -> Result<Vec<Method>, ConfigError> {
    list.iter()
        .enumerate()
        .map(|(i, m)| {
            let path = format!("extra_methods[{i}]");
            let method = Method::from_bytes(m.as_bytes())
                .map_err(|_| invalid(&path, format!("'{m}' is not a method token")))?;
            if STANDARD_METHODS.contains(&method.as_str()) || method == Method::CONNECT {
                return Err(invalid(&path, format!("'{m}' is a standard method")));
            }
            Ok(method)
        })
        .collect()
}

/// `routes[i]`: its match, its upstream, and its `idempotency`.
fn validate_route(
    base: &str,
    r: RawRoute,
    upstreams: &BTreeMap<String, UpstreamConfig>,
    store: &StoreConfig,
    server: &ServerConfig,
    extra: &[Method],
) -> Result<Route, ConfigError> {
    let upstream = upstreams.get(&r.upstream).ok_or_else(|| {
        let known: Vec<&str> = upstreams.keys().map(String::as_str).collect();
        invalid(
            format!("{base}.upstream"),
            format!(
                "no upstream named '{}' (known: {})",
                r.upstream,
                known.join(", ")
            ),
        )
    })?;
    let path = match (r.matcher.path, r.matcher.path_prefix) {
        (Some(p), None) => PathMatch::Exact(p),
        (None, Some(p)) => PathMatch::Prefix(p),
        _ => {
            return Err(invalid(
                format!("{base}.match"),
                "give exactly one of 'path' or 'path_prefix'",
            ));
        }
    };
    let path = {
        let (PathMatch::Exact(p) | PathMatch::Prefix(p)) = &path;
        if !p.starts_with('/') {
            return Err(invalid(
                format!("{base}.match"),
                "paths must start with '/'",
            ));
        }
        // Requests are matched in normal form (docs/contract.md §8.1), so the configured path
        // is too.
        let normal = crate::path::normalize(p)
            .map_err(|e| invalid(format!("{base}.match"), e.to_string()))?
            .into_owned();
        match path {
            PathMatch::Exact(_) => PathMatch::Exact(normal),
            PathMatch::Prefix(_) => {
                let trimmed = normal.strip_suffix('/').filter(|s| !s.is_empty());
                PathMatch::Prefix(trimmed.map(str::to_string).unwrap_or(normal))
            }
        }
    };
    let route_methods = match &r.matcher.methods {
        None => None,
        Some(list) => Some(methods(&format!("{base}.match.methods"), list, extra)?),
    };
    let idempotency = match r.idempotency {
        None => None,
        Some(idem) => Some(validate_idempotency(
            &format!("{base}.idempotency"),
            idem,
            upstream,
            store,
            extra,
        )?),
    };
    if let (Some(idem), Some(matched)) = (&idempotency, &route_methods)
        && !idem.methods.iter().any(|m| matched.contains(m))
    {
        let names = |list: &[Method]| {
            list.iter()
                .map(Method::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        return Err(invalid(
            format!("{base}.idempotency.methods"),
            format!(
                "[{}] shares no method with {base}.match.methods [{}]: the route could never \
                 key a request",
                names(&idem.methods),
                names(matched)
            ),
        ));
    }
    if let Some(idem) = &idempotency
        && idem.max_request_body > server.max_buffered_bytes
    {
        return Err(invalid(
            format!("{base}.idempotency.max_request_body"),
            format!(
                "must not be larger than server.max_buffered_bytes ({} bytes): such a \
                 body could never be admitted",
                server.max_buffered_bytes
            ),
        ));
    }
    Ok(Route {
        name: r.name,
        path,
        methods: route_methods,
        upstream: r.upstream,
        idempotency,
    })
}

/// `routes[i].idempotency`: key, scope, fingerprint, timing (the lease against its
/// upstream's timeout and the store's record bound), statuses, sizes and headers.
fn validate_idempotency(
    base: &str,
    raw: RawIdempotency,
    upstream: &UpstreamConfig,
    store: &StoreConfig,
    extra: &[Method],
) -> Result<Idempotency, ConfigError> {
    let record_bound = store.record_bound();
    let serialize = match &raw.serialize {
        None => None,
        Some(ser) => {
            let max_in_flight = ser.max_in_flight.unwrap_or(1);
            if max_in_flight == 0 {
                return Err(invalid(
                    format!("{base}.serialize.max_in_flight"),
                    "must be at least 1",
                ));
            }
            Some(SerializeConfig {
                max_in_flight,
                wait_timeout: duration_or(
                    &format!("{base}.serialize.wait_timeout"),
                    ser.wait_timeout.as_ref(),
                    defaults::WAIT_TIMEOUT,
                )?,
            })
        }
    };
    let key = match raw.key {
        None => vec![KeySource::Header(HeaderName::from_static(
            defaults::KEY_HEADER,
        ))],
        Some(list) if list.is_empty() => {
            return Err(invalid(
                format!("{base}.key"),
                "must list at least one source",
            ));
        }
        Some(list) => list
            .into_iter()
            .enumerate()
            .map(|(i, k)| {
                let p = format!("{base}.key[{i}]");
                Ok(match k {
                    RawKeySource::Header(h) => KeySource::Header(header_name(&p, &h)?),
                    RawKeySource::Json(ptr) => KeySource::Json(json_pointer(&p, &ptr)?),
                })
            })
            .collect::<Result<_, ConfigError>>()?,
    };
    let scope_path = format!("{base}.scope");
    let scope = match raw.scope {
        None => ScopeSource::Fixed("default".into()),
        Some(RawScope::Header(h)) => ScopeSource::Header(header_name(&scope_path, &h)?),
        Some(RawScope::Json(p)) => ScopeSource::Json(json_pointer(&scope_path, &p)?),
        Some(RawScope::Authorization(true)) => ScopeSource::Authorization,
        Some(RawScope::Authorization(false)) => {
            return Err(invalid(
                scope_path,
                "'authorization: false' means nothing: choose header, json, authorization: true or fixed",
            ));
        }
        Some(RawScope::Fixed(name)) => {
            if name.is_empty() || name.len() > 255 {
                return Err(invalid(scope_path, "a fixed scope must be 1-255 bytes"));
            }
            ScopeSource::Fixed(name)
        }
    };
    let idem_methods = match &raw.methods {
        None => defaults::METHODS
            .iter()
            .map(|m| Method::from_bytes(m.as_bytes()).expect("static method"))
            .collect(),
        Some(list) => methods(&format!("{base}.methods"), list, extra)?,
    };
    let fp = raw.fingerprint.unwrap_or_default();
    let fingerprint = FingerprintConfig {
        headers: fp
            .headers
            .iter()
            .enumerate()
            .map(|(i, h)| header_name(&format!("{base}.fingerprint.headers[{i}]"), h))
            .collect::<Result<_, _>>()?,
        json_canonical: fp.json_canonical,
        json_ignore: fp
            .json_ignore
            .iter()
            .enumerate()
            .map(|(i, p)| json_pointer(&format!("{base}.fingerprint.json_ignore[{i}]"), p))
            .collect::<Result<_, _>>()?,
    };
    if !fingerprint.json_ignore.is_empty() && !fingerprint.json_canonical {
        return Err(invalid(
            format!("{base}.fingerprint.json_ignore"),
            "needs 'json_canonical: true' (fields can only be ignored in a parsed body)",
        ));
    }
    let ttl = duration_or(&format!("{base}.ttl"), raw.ttl.as_ref(), defaults::TTL)?;
    // The default leaves room for the store calls the checks below count, however long the
    // store's timeouts: a default the checks refuse would blame a field nobody set.
    let store_calls = if serialize.is_some() { 2 } else { 1 };
    let lease = duration_or(
        &format!("{base}.lease"),
        raw.lease.as_ref(),
        upstream.timeout
            + defaults::LEASE_MARGIN.max(record_bound * store_calls + defaults::LEASE_SLACK)
            + serialize.map_or(Duration::ZERO, |s| s.wait_timeout),
    )?;
    if lease <= upstream.timeout {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({})",
                upstream.name,
                fmt_duration(upstream.timeout)
            ),
        ));
    }
    if lease <= upstream.timeout + record_bound {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({}) plus the time to record the answer \
                 ({} = {})",
                upstream.name,
                fmt_duration(upstream.timeout),
                record_bound_terms(store),
                fmt_duration(record_bound)
            ),
        ));
    }
    // With `serialize`, the claim is held while a slot is awaited, and the slot's own store
    // call comes before the forward: a slot is asked for only while the lease still has room
    // for that call, the forward and the recording (`gateway/record.rs`). A shorter lease
    // would cut the wait short, or leave none, every request then 409 `in-flight`.
    if let Some(ser) = &serialize
        && lease <= upstream.timeout + record_bound * 2 + ser.wait_timeout
    {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({}) plus serialize.wait_timeout ({}) \
                 plus twice the time of one store call ({} = {}: the slot's, then the \
                 recording's): the claim is held while a slot is awaited",
                upstream.name,
                fmt_duration(upstream.timeout),
                fmt_duration(ser.wait_timeout),
                record_bound_terms(store),
                fmt_duration(record_bound)
            ),
        ));
    }
    // A row lives `ttl` from its claim: equal to the lease, a crashed attempt's row would
    // expire as its lease does, and the retry that follows would run as a new key, its
    // takeover (a possible double) uncounted.
    if ttl <= lease {
        return Err(invalid(
            format!("{base}.ttl"),
            format!(
                "must be longer than the lease ({}), so that a crashed attempt's row outlives \
                 its lease and a retry after it is counted as a takeover",
                fmt_duration(lease)
            ),
        ));
    }
    let retry_statuses = match raw.retry_statuses {
        None => StatusSet(defaults::RETRY_STATUSES.to_vec()),
        Some(list) => StatusSet(
            list.into_iter()
                .enumerate()
                .map(|(i, s)| status_range(&format!("{base}.retry_statuses[{i}]"), s))
                .collect::<Result<_, _>>()?,
        ),
    };
    let replay_headers = match raw.replay_headers {
        None => defaults::REPLAY_HEADERS
            .iter()
            .map(|h| HeaderName::from_static(h))
            .collect(),
        Some(list) => list
            .iter()
            .enumerate()
            .map(|(i, h)| {
                let p = format!("{base}.replay_headers[{i}]");
                let name = header_name(&p, h)?;
                if crate::headers::is_hop_by_hop(&name) {
                    return Err(invalid(
                        p,
                        format!("'{h}' is a hop-by-hop header and is never stored"),
                    ));
                }
                if name == http::header::TRAILER {
                    return Err(invalid(
                        p,
                        format!("'{h}' announces trailers, and trailers are never stored"),
                    ));
                }
                Ok(name)
            })
            .collect::<Result<_, _>>()?,
    };
    let forward_key_header = header_name(
        &format!("{base}.forward_key_header"),
        raw.forward_key_header
            .as_deref()
            .unwrap_or(defaults::KEY_HEADER),
    )?;
    let max_stored_response = size_or(
        &format!("{base}.max_stored_response"),
        raw.max_stored_response.as_ref(),
        defaults::MAX_STORED_RESPONSE,
    )?;
    Ok(Idempotency {
        mode: raw.mode.unwrap_or_default(),
        key,
        scope,
        required: raw.required.unwrap_or(false),
        methods: idem_methods,
        fingerprint,
        ttl,
        lease,
        in_flight: raw.in_flight.unwrap_or(InFlight::Wait),
        wait_timeout: duration_or(
            &format!("{base}.wait_timeout"),
            raw.wait_timeout.as_ref(),
            defaults::WAIT_TIMEOUT,
        )?,
        retry_statuses,
        on_unknown_outcome: raw
            .on_unknown_outcome
            .unwrap_or(OnUnknownOutcome::Reforward),
        on_store_error: raw.on_store_error.unwrap_or(OnStoreError::Reject),
        max_request_body: size_or(
            &format!("{base}.max_request_body"),
            raw.max_request_body.as_ref(),
            defaults::MAX_REQUEST_BODY,
        )?,
        max_stored_response,
        replay_headers,
        forward_key_header,
        serialize,
    })
}

fn status_range(path: &str, s: RawStatus) -> Result<(u16, u16), ConfigError> {
    let check = |n: u16| {
        if (100..=599).contains(&n) {
            Ok(n)
        } else {
            Err(invalid(
                path,
                format!("{n} is not an HTTP status (100-599)"),
            ))
        }
    };
    match s {
        RawStatus::Code(n) => Ok((check(n)?, n)),
        RawStatus::Range(text) => {
            let bad = || {
                invalid(
                    path,
                    format!("'{text}' is not a status or a range like 500-599"),
                )
            };
            let (lo, hi) = match text.split_once('-') {
                Some((a, b)) => (a.trim(), b.trim()),
                None => (text.trim(), text.trim()),
            };
            let lo = check(lo.parse().map_err(|_| bad())?)?;
            let hi = check(hi.parse().map_err(|_| bad())?)?;
            if lo > hi {
                return Err(bad());
            }
            Ok((lo, hi))
        }
    }
}

/// What [`StoreConfig::record_bound`] adds up, in the config's own terms (for errors).
fn record_bound_terms(store: &StoreConfig) -> &'static str {
    match store {
        StoreConfig::Postgres(_) => "the store's acquire_timeout + statement_timeout",
        StoreConfig::Sqlite(_) => "the store's busy_timeout + 500ms",
    }
}
