//! Validation: the raw configuration (`raw.rs`) turned into the typed [`Config`], with the
//! defaults applied and every error naming its YAML path.
//!
//! `validate` calls one function per top-level section, in this order: `listen`, `admin`,
//! `server`, `store` (with `store.gc`), `upstreams`, `routes` (each route's `idempotency` in
//! `validate_idempotency`), `replay_cache` and `log`. The first problem found is the one
//! reported, so the order is part of the behaviour. Sections validated later may depend on
//! earlier ones: a route needs its upstream, the store's record bound and
//! `server.max_buffered_bytes`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use http::{HeaderName, Method};

use super::raw::{
    RawAdmin, RawConfig, RawIdempotency, RawKeySource, RawLog, RawPostgres, RawReplayCache,
    RawRoute, RawScope, RawServer, RawSize, RawSqlite, RawStatus, RawStore, RawUpstream,
};
use super::{
    AdminConfig, Config, ConfigError, FingerprintConfig, GcConfig, Idempotency, InFlight,
    KeySource, LogFormat, OnStoreError, OnUnknownOutcome, PathMatch, PgTlsMode, Pooler,
    PostgresConfig, Route, ScopeSource, SerializeConfig, ServerConfig, SqliteConfig, StatusSet,
    StoreConfig, TlsFiles, UpstreamConfig, defaults, fmt_duration, invalid, parse_duration,
    parse_size,
};

/// Raw to typed, section by section.
pub(super) fn validate(raw: RawConfig) -> Result<Config, ConfigError> {
    let listen = validate_listen(raw.listen.as_deref())?;
    let admin = raw.admin.map(validate_admin).transpose()?;
    let server = validate_server(raw.server)?;
    let (store, gc) = validate_store(raw.store)?;
    let upstreams = validate_upstreams(raw.upstreams)?;
    let extra = validate_extra_methods(raw.extra_methods.unwrap_or_default())?;
    let routes = validate_routes(raw.routes, &upstreams, &store, &server, &extra)?;
    let replay_cache_bytes = validate_replay_cache(raw.replay_cache.as_ref())?;
    let log_format = validate_log(raw.log);
    Ok(Config {
        listen,
        admin,
        server,
        store,
        gc,
        replay_cache_bytes,
        log_format,
        upstreams,
        routes,
    })
}

/// `listen`.
fn validate_listen(raw: Option<&str>) -> Result<SocketAddr, ConfigError> {
    socket_addr("listen", raw.unwrap_or(defaults::LISTEN))
}

/// `admin`: a token guards the key API, and is required off loopback.
fn validate_admin(raw: RawAdmin) -> Result<AdminConfig, ConfigError> {
    if raw.token.as_deref().is_some_and(|t| t.len() < 16) {
        return Err(invalid(
            "admin.token",
            "must be at least 16 characters (it guards the key API)",
        ));
    }
    let listen = socket_addr("admin.listen", &raw.listen)?;
    if !listen.ip().is_loopback() && raw.token.is_none() {
        return Err(invalid(
            "admin.token",
            format!(
                "is required when admin.listen ({listen}) is not a loopback address: \
                 the key API can release and delete keys"
            ),
        ));
    }
    Ok(AdminConfig {
        listen,
        token: raw.token,
    })
}

/// `server`: limits, timeouts, and the listener's TLS files (loaded now, so `check` and a
/// reload catch a bad file, naming it).
fn validate_server(raw: RawServer) -> Result<ServerConfig, ConfigError> {
    let tls = match raw.tls {
        None => None,
        Some(t) => {
            let files = TlsFiles {
                cert: t.cert.into(),
                key: t.key.into(),
            };
            crate::tls::server_config(&files.cert, &files.key)
                .map_err(|m| invalid("server.tls", m))?;
            Some(files)
        }
    };
    let max_connections = raw.max_connections.unwrap_or(defaults::MAX_CONNECTIONS);
    if max_connections == 0 {
        return Err(invalid("server.max_connections", "must be at least 1"));
    }
    let max_header_bytes = size_or(
        "server.max_header_bytes",
        raw.max_header_bytes.as_ref(),
        defaults::MAX_HEADER_BYTES,
    )?;
    if max_header_bytes < 8192 {
        return Err(invalid("server.max_header_bytes", "must be at least 8KiB"));
    }
    let server = ServerConfig {
        max_connections,
        max_header_bytes,
        header_read_timeout: duration_or(
            "server.header_read_timeout",
            raw.header_read_timeout.as_ref(),
            defaults::HEADER_READ_TIMEOUT,
        )?,
        body_read_timeout: duration_or(
            "server.body_read_timeout",
            raw.body_read_timeout.as_ref(),
            defaults::BODY_READ_TIMEOUT,
        )?,
        shutdown_grace: duration_or(
            "server.shutdown_grace",
            raw.shutdown_grace.as_ref(),
            defaults::SHUTDOWN_GRACE,
        )?,
        drain_delay: duration_or_zero(
            "server.drain_delay",
            raw.drain_delay.as_ref(),
            defaults::DRAIN_DELAY,
        )?,
        max_buffered_bytes: size_or(
            "server.max_buffered_bytes",
            raw.max_buffered_bytes.as_ref(),
            defaults::MAX_BUFFERED_BYTES,
        )?,
        h2_max_concurrent_streams: match raw.h2_max_concurrent_streams {
            None => 100,
            Some(0) => {
                return Err(invalid(
                    "server.h2_max_concurrent_streams",
                    "must be at least 1",
                ));
            }
            Some(n) => n,
        },
        worker_threads: match raw.worker_threads {
            None => std::thread::available_parallelism().map_or(1, |n| n.get()),
            Some(0) => return Err(invalid("server.worker_threads", "must be at least 1")),
            Some(n) => n,
        },
        runtime: raw.runtime.unwrap_or_default(),
        retired: if raw.yield_on_wake.is_some() {
            vec!["server.yield_on_wake"]
        } else {
            Vec::new()
        },
        tls,
    };
    if server.max_buffered_bytes == 0 {
        return Err(invalid("server.max_buffered_bytes", "must be at least 1"));
    }
    Ok(server)
}

/// `store`: exactly one of `postgres` and `sqlite`, then `gc`.
fn validate_store(raw: RawStore) -> Result<(StoreConfig, GcConfig), ConfigError> {
    let store = match (raw.postgres, raw.sqlite) {
        (None, None) => {
            return Err(invalid(
                "store",
                "give 'postgres: { url: ... }' or 'sqlite: { path: ... }'",
            ));
        }
        (Some(_), Some(_)) => {
            return Err(invalid(
                "store",
                "give either 'postgres' or 'sqlite', not both",
            ));
        }
        (None, Some(sq)) => StoreConfig::Sqlite(validate_sqlite(sq)?),
        (Some(pg), None) => StoreConfig::Postgres(validate_postgres(pg)?),
    };
    let gc = GcConfig {
        interval: duration_or(
            "store.gc.interval",
            raw.gc.as_ref().and_then(|g| g.interval.as_ref()),
            defaults::GC_INTERVAL,
        )?,
        batch_size: match raw.gc.as_ref().and_then(|g| g.batch_size) {
            None => defaults::GC_BATCH_SIZE,
            Some(0) => return Err(invalid("store.gc.batch_size", "must be at least 1")),
            Some(n) => n,
        },
    };
    Ok((store, gc))
}

/// `store.sqlite`.
fn validate_sqlite(sq: RawSqlite) -> Result<SqliteConfig, ConfigError> {
    if cfg!(not(feature = "sqlite")) {
        return Err(invalid(
            "store.sqlite",
            "this build has no embedded store (built without the 'sqlite' feature)",
        ));
    }
    if sq.path.is_empty() {
        return Err(invalid("store.sqlite.path", "must not be empty"));
    }
    Ok(SqliteConfig {
        path: sq.path.into(),
        busy_timeout: duration_or(
            "store.sqlite.busy_timeout",
            sq.busy_timeout.as_ref(),
            defaults::SQLITE_BUSY_TIMEOUT,
        )?,
    })
}

/// `store.postgres`. The URLs are never echoed in an error: they may hold a password.
fn validate_postgres(mut pg: RawPostgres) -> Result<PostgresConfig, ConfigError> {
    let configured = match &pg.tls {
        None => None,
        Some(tls) => {
            let mode = PgTlsMode::ALL
                .into_iter()
                .find(|m| m.as_str() == tls.mode)
                .ok_or_else(|| {
                    invalid(
                        "store.postgres.tls.mode",
                        format!(
                            "'{}' is not one of {}",
                            tls.mode,
                            PgTlsMode::ALL.map(PgTlsMode::as_str).join(", ")
                        ),
                    )
                })?;
            Some((mode, tls.ca.clone()))
        }
    };
    // `sslmode` and `sslrootcert` in the URLs mean what they say (super::pg_url).
    let url = super::pg_url::split(&pg.url).map_err(|m| invalid("store.postgres.url", m))?;
    let (tls_mode, ca) = super::pg_url::resolve(configured.clone(), &url, "store.postgres.url")
        .map_err(|m| invalid("store.postgres.url", m))?;
    pg.url = url.rest;
    if let Some(listen) = &pg.listen_url {
        let split =
            super::pg_url::split(listen).map_err(|m| invalid("store.postgres.listen_url", m))?;
        super::pg_url::resolve(
            Some((tls_mode, ca.clone())),
            &split,
            "store.postgres.listen_url",
        )
        .map_err(|m| invalid("store.postgres.listen_url", m))?;
        pg.listen_url = Some(split.rest);
    }
    let tls_ca = ca.map(std::path::PathBuf::from);
    if let Some(ca) = &tls_ca {
        if tls_mode != PgTlsMode::VerifyFull {
            return Err(invalid(
                "store.postgres.tls.ca",
                "only 'verify-full' checks certificates against a CA",
            ));
        }
        crate::tls::roots(Some(ca)).map_err(|m| invalid("store.postgres.tls.ca", m))?;
    } else if tls_mode == PgTlsMode::VerifyFull {
        crate::tls::roots(None).map_err(|m| invalid("store.postgres.tls.ca", m))?;
    }
    if pg.url.parse::<tokio_postgres::Config>().is_err() {
        return Err(invalid(
            "store.postgres.url",
            "not a valid PostgreSQL connection string (postgres://user:pass@host:port/db)",
        ));
    }
    if let Some(listen) = &pg.listen_url
        && listen.parse::<tokio_postgres::Config>().is_err()
    {
        return Err(invalid(
            "store.postgres.listen_url",
            "not a valid PostgreSQL connection string (postgres://user:pass@host:port/db)",
        ));
    }
    let pooler = match pg.pooler.as_deref() {
        None => None,
        Some(name) => Some(
            Pooler::ALL
                .into_iter()
                .find(|p| p.as_str() == name)
                .ok_or_else(|| {
                    invalid(
                        "store.postgres.pooler",
                        format!(
                            "'{name}' is not one of {}",
                            Pooler::ALL.map(Pooler::as_str).join(", ")
                        ),
                    )
                })?,
        ),
    };
    let pool_size = pg.pool_size.unwrap_or(defaults::POOL_SIZE);
    if pool_size == 0 {
        return Err(invalid("store.postgres.pool_size", "must be at least 1"));
    }
    let batch_keys = pg.batch_keys.unwrap_or(defaults::BATCH_KEYS);
    if !(1..=1000).contains(&batch_keys) {
        return Err(invalid(
            "store.postgres.batch_keys",
            "must be from 1 to 1000",
        ));
    }
    let batch_bytes = size_or(
        "store.postgres.batch_bytes",
        pg.batch_bytes.as_ref(),
        defaults::BATCH_BYTES,
    )?;
    if batch_bytes == 0 {
        return Err(invalid("store.postgres.batch_bytes", "must be at least 1"));
    }
    Ok(PostgresConfig {
        batch_keys,
        batch_bytes,
        listen_url: pg.listen_url.unwrap_or_else(|| pg.url.clone()),
        url: pg.url,
        pooler,
        pool_size,
        acquire_timeout: duration_or(
            "store.postgres.acquire_timeout",
            pg.acquire_timeout.as_ref(),
            defaults::ACQUIRE_TIMEOUT,
        )?,
        connect_timeout: duration_or(
            "store.postgres.connect_timeout",
            pg.connect_timeout.as_ref(),
            defaults::PG_CONNECT_TIMEOUT,
        )?,
        statement_timeout: duration_or(
            "store.postgres.statement_timeout",
            pg.statement_timeout.as_ref(),
            defaults::STATEMENT_TIMEOUT,
        )?,
        tls: tls_mode,
        tls_ca,
        allow_async_commit: pg.allow_async_commit.unwrap_or(false),
    })
}

/// `upstreams`, by name.
fn validate_upstreams(
    raw: BTreeMap<String, RawUpstream>,
) -> Result<BTreeMap<String, UpstreamConfig>, ConfigError> {
    raw.into_iter()
        .map(|(name, up)| {
            let upstream = validate_upstream(&name, up)?;
            Ok((name, upstream))
        })
        .collect()
}

/// `upstreams.<name>`.
fn validate_upstream(name: &str, up: RawUpstream) -> Result<UpstreamConfig, ConfigError> {
    let base = format!("upstreams.{name}");
    let url: http::Uri = up
        .url
        .parse()
        .map_err(|_| invalid(format!("{base}.url"), format!("'{}' is not a URL", up.url)))?;
    let https = match url.scheme_str() {
        Some("http") => false,
        Some("https") => true,
        _ => {
            return Err(invalid(
                format!("{base}.url"),
                "must start with http:// or https://, e.g. http://127.0.0.1:9000",
            ));
        }
    };
    let tls_ca = match up.tls.and_then(|t| t.ca) {
        None => None,
        Some(ca) => {
            if !https {
                return Err(invalid(
                    format!("{base}.tls.ca"),
                    "only an https:// upstream uses a CA",
                ));
            }
            let ca = std::path::PathBuf::from(ca);
            crate::tls::roots(Some(&ca)).map_err(|m| invalid(format!("{base}.tls.ca"), m))?;
            Some(ca)
        }
    };
    if https && tls_ca.is_none() {
        // Without a CA file the platform's roots verify it: there must be some.
        crate::tls::roots(None).map_err(|m| invalid(format!("{base}.tls.ca"), m))?;
    }
    if url.authority().is_none() {
        return Err(invalid(format!("{base}.url"), "has no host"));
    }
    if url.query().is_some() {
        return Err(invalid(format!("{base}.url"), "must not have a query"));
    }
    let timeout = duration_or(
        &format!("{base}.timeout"),
        up.timeout.as_ref(),
        defaults::UPSTREAM_TIMEOUT,
    )?;
    // Unset, it is the default or half of `timeout`, whichever is shorter.
    let connect_timeout = duration_or(
        &format!("{base}.connect_timeout"),
        up.connect_timeout.as_ref(),
        defaults::UPSTREAM_CONNECT_TIMEOUT.min(timeout / 2),
    )?;
    // A connect that runs into `timeout` would be reported as a timeout (outcome
    // unknown) although nothing was sent; so connecting must give up first.
    if connect_timeout >= timeout {
        return Err(invalid(
            format!("{base}.connect_timeout"),
            format!(
                "must be shorter than {base}.timeout ({}), so a failed connect is told \
                 apart from a request that may have been processed",
                fmt_duration(timeout)
            ),
        ));
    }
    let max_in_flight = up.max_in_flight.unwrap_or(defaults::UPSTREAM_MAX_IN_FLIGHT);
    if max_in_flight == 0 {
        return Err(invalid(
            format!("{base}.max_in_flight"),
            "must be at least 1",
        ));
    }
    let idle_timeout = duration_or(
        &format!("{base}.idle_timeout"),
        up.idle_timeout.as_ref(),
        defaults::UPSTREAM_IDLE_TIMEOUT,
    )?;
    Ok(UpstreamConfig {
        name: name.to_string(),
        url,
        connect_timeout,
        timeout,
        max_in_flight,
        idle_timeout,
        tls_ca,
        http2: up.http2.unwrap_or(false),
        preserve_host: up.preserve_host.unwrap_or(false),
    })
}

/// `routes`, in file order: at least one, names unique.
fn validate_routes(
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
fn validate_extra_methods(list: Vec<String>) -> Result<Vec<Method>, ConfigError> {
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

/// The methods a route may name without `extra_methods` (CONNECT is never routed: 405).
const STANDARD_METHODS: [&str; 8] = [
    "GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "TRACE", "PATCH",
];

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
            store.record_bound(),
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

/// `replay_cache`: bytes of completed responses kept in memory; 0 disables the cache.
fn validate_replay_cache(raw: Option<&RawReplayCache>) -> Result<usize, ConfigError> {
    size_or(
        "replay_cache.max_bytes",
        raw.and_then(|c| c.max_bytes.as_ref()),
        defaults::REPLAY_CACHE_BYTES,
    )
}

/// `log`: nothing to check beyond what serde did.
fn validate_log(raw: Option<RawLog>) -> LogFormat {
    raw.and_then(|l| l.format).unwrap_or_default()
}

/// `routes[i].idempotency`: key, scope, fingerprint, timing (the lease against its
/// upstream's timeout and the store's record bound), statuses, sizes and headers.
fn validate_idempotency(
    base: &str,
    raw: RawIdempotency,
    upstream: &UpstreamConfig,
    record_bound: Duration,
    extra: &[Method],
) -> Result<Idempotency, ConfigError> {
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
    let lease = duration_or(
        &format!("{base}.lease"),
        raw.lease.as_ref(),
        upstream.timeout
            + defaults::LEASE_MARGIN
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
                 (the store's acquire_timeout + statement_timeout = {})",
                upstream.name,
                fmt_duration(upstream.timeout),
                fmt_duration(record_bound)
            ),
        ));
    }
    if let Some(ser) = &serialize
        && lease <= upstream.timeout + record_bound + ser.wait_timeout
    {
        return Err(invalid(
            format!("{base}.lease"),
            format!(
                "must be longer than upstream '{}' timeout ({}) plus serialize.wait_timeout ({}) \
                 plus the time to record the answer ({}): the claim is held while a slot is awaited",
                upstream.name,
                fmt_duration(upstream.timeout),
                fmt_duration(ser.wait_timeout),
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

// Field helpers: one YAML value, its path named in any error.

fn duration_or(path: &str, v: Option<&String>, default: Duration) -> Result<Duration, ConfigError> {
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
fn duration_or_zero(
    path: &str,
    v: Option<&String>,
    default: Duration,
) -> Result<Duration, ConfigError> {
    match v {
        None => Ok(default),
        Some(s) => parse_duration(s).map_err(|m| invalid(path, m)),
    }
}

fn size_or(path: &str, v: Option<&RawSize>, default: usize) -> Result<usize, ConfigError> {
    match v {
        None => Ok(default),
        Some(RawSize::Bytes(n)) => usize::try_from(*n).map_err(|_| invalid(path, "too large")),
        Some(RawSize::Text(s)) => parse_size(s).map_err(|m| invalid(path, m)),
    }
}

fn socket_addr(path: &str, s: &str) -> Result<SocketAddr, ConfigError> {
    s.parse().map_err(|_| {
        invalid(
            path,
            format!("'{s}' is not an address: write IP:PORT, e.g. 0.0.0.0:8080"),
        )
    })
}

/// A list of methods: standard ones in any case, or names listed in `extra_methods`.
fn methods(path: &str, list: &[String], extra: &[Method]) -> Result<Vec<Method>, ConfigError> {
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

fn header_name(path: &str, s: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(s.as_bytes())
        .map_err(|_| invalid(path, format!("'{s}' is not a valid header name")))
}

fn json_pointer(path: &str, s: &str) -> Result<String, ConfigError> {
    if !s.starts_with('/') {
        return Err(invalid(
            path,
            format!("'{s}' is not a JSON pointer: it must start with '/', e.g. /event_id"),
        ));
    }
    Ok(s.to_string())
}
