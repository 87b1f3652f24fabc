//! Validation: the raw configuration (`raw.rs`) turned into the typed [`Config`], with the
//! defaults applied and every error naming its YAML path.
//!
//! `validate` calls one function per top-level section, in this order: `listen`, `admin`,
//! `server`, `store` (with `store.gc`), `upstreams`, `routes` (each route's `idempotency` in
//! `validate_idempotency`), `replay_cache`, `log` and `telemetry`. The first problem found is the one
//! reported, so the order is part of the behaviour. Sections validated later may depend on
//! earlier ones: a route needs its upstream, the store's record bound and
//! `server.max_buffered_bytes`.

use std::collections::BTreeMap;
use std::net::SocketAddr;

use super::fields::*;
use super::model::{
    AdminConfig, Config, ConfigError, GcConfig, LogFormat, PgTlsMode, Pooler, PostgresConfig,
    ServerConfig, SqliteConfig, StoreConfig, TelemetryConfig, TlsFiles, UpstreamConfig, defaults,
    invalid,
};
use super::raw::{
    RawAdmin, RawConfig, RawLog, RawPostgres, RawReplayCache, RawServer, RawSqlite, RawStore,
    RawTelemetry, RawUpstream,
};
use super::routes::{validate_extra_methods, validate_routes};
use super::units::fmt_duration;

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
    let telemetry = validate_telemetry(raw.telemetry)?;
    Ok(Config {
        listen,
        admin,
        server,
        store,
        gc,
        replay_cache_bytes,
        log_format,
        telemetry,
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
    let block = ("store.postgres.tls.mode", "store.postgres.tls.ca");
    let (tls_mode, ca) = super::pg_url::resolve(configured.clone(), block, &url)
        .map_err(|m| invalid("store.postgres.url", m))?;
    pg.url = url.rest;
    if let Some(listen) = &pg.listen_url {
        let split =
            super::pg_url::split(listen).map_err(|m| invalid("store.postgres.listen_url", m))?;
        // The listener's connection is protected as the pool's: its URL may repeat what
        // `url` (and the `tls` block) resolved to, never say something else, and names no CA
        // of its own (the connector is the pool's).
        let from = if configured.is_some() {
            block
        } else {
            (
                "store.postgres.url's sslmode",
                "store.postgres.url's sslrootcert",
            )
        };
        super::pg_url::resolve(Some((tls_mode, ca.clone())), from, &split)
            .map_err(|m| invalid("store.postgres.listen_url", m))?;
        if split.root_cert.is_some() && ca.is_none() {
            return Err(invalid(
                "store.postgres.listen_url",
                "sslrootcert here alone is not used: the listener connects with the pool's TLS; \
                 give the CA in store.postgres.url or store.postgres.tls.ca",
            ));
        }
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

/// `telemetry`: the collector's URL and protocol, the export's headers and bounds, the
/// sampling ratio. Nothing here turns tracing on by itself but an endpoint.
fn validate_telemetry(raw: Option<RawTelemetry>) -> Result<TelemetryConfig, ConfigError> {
    let mut out = TelemetryConfig::default();
    let Some(raw) = raw else {
        return Ok(out);
    };
    if let Some(name) = raw.service_name {
        if name.trim().is_empty() {
            return Err(invalid("telemetry.service_name", "must not be empty"));
        }
        out.service_name = name;
    }
    if let Some(ratio) = raw.sampling_ratio {
        if !(0.0..=1.0).contains(&ratio) {
            return Err(invalid(
                "telemetry.sampling_ratio",
                format!("must be between 0.0 and 1.0, got {ratio}"),
            ));
        }
        out.sampling_ratio = ratio;
    }
    let Some(otlp) = raw.otlp else {
        return Ok(out);
    };
    out.protocol = otlp.protocol.unwrap_or_default();
    if let Some(endpoint) = otlp.endpoint {
        let uri = out
            .protocol
            .endpoint(&endpoint)
            .map_err(|m| invalid("telemetry.otlp.endpoint", m))?;
        out.endpoint = Some(uri);
    }
    for (name, value) in otlp.headers.unwrap_or_default() {
        let path = format!("telemetry.otlp.headers.{name}");
        let header = http::HeaderName::from_bytes(name.as_bytes())
            .map_err(|_| invalid(&path, "not a valid header name"))?;
        // The value is never echoed: it is often a credential.
        let value = http::HeaderValue::from_str(&value)
            .map_err(|_| invalid(&path, "the value is not a valid header value"))?;
        out.headers.push((header, value));
    }
    out.timeout = duration_or(
        "telemetry.otlp.timeout",
        otlp.timeout.as_ref(),
        defaults::OTLP_TIMEOUT,
    )?;
    if let Some(n) = otlp.max_queue_spans {
        if !(1..=1_000_000).contains(&n) {
            return Err(invalid(
                "telemetry.otlp.max_queue_spans",
                format!("must be between 1 and 1000000, got {n}"),
            ));
        }
        out.max_queue_spans = n;
    }
    Ok(out)
}
