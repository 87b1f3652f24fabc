//! What each CLI verb does (docs/contract.md §6). `main.rs` only parses arguments and maps
//! [`CommandError`] to an exit code: 64 for a bad config (before any port is bound), 1 for
//! everything else.

use std::path::Path;
use std::sync::Arc;

use crate::app::{App, Listeners};
use crate::config::{
    Config, ConfigError, PathMatch, ScopeSource, StoreConfig, fmt_duration, fmt_size,
};
use crate::store::{Store, StoreError};

pub use crate::keys::ListArgs;

#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("{0}")]
    Config(#[from] ConfigError),
    #[error("store: {0}")]
    Store(#[from] StoreError),
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Lookup(#[from] crate::keys::LookupError),
    #[error("{0}")]
    App(#[from] crate::app::AppError),
    #[error("{0}")]
    Other(String),
}

impl CommandError {
    /// 64 (EX_USAGE) for configuration errors, 1 otherwise.
    pub fn exit_code(&self) -> u8 {
        match self {
            CommandError::Config(_) => 64,
            CommandError::Store(_)
            | CommandError::Io(_)
            | CommandError::Lookup(_)
            | CommandError::App(_)
            | CommandError::Other(_) => 1,
        }
    }
}

/// Opens the configured store. Postgres connects lazily (this succeeds with it down); the
/// embedded store opens its file and takes its one-instance lock now.
pub fn open_store(config: &Config) -> Result<Arc<dyn Store>, CommandError> {
    Ok(crate::app::open(config).map(|(store, _)| store)?)
}

/// `idemgate serve`: build the app on the configured addresses, then serve until
/// SIGTERM/SIGINT (after `server.drain_delay`); SIGHUP reloads `path`. `config` is `path`
/// already loaded (the caller set up logging from it).
pub async fn serve(path: &Path, config: Config) -> Result<(), CommandError> {
    // Before anything can take long, so a signal during start-up is not lost.
    let signals = crate::server::Signals::install();
    if let Some((from, to)) = crate::limits::raise_open_files() {
        tracing::info!(from, to, "raised the open-file limit to the hard limit");
    }
    if let Some(warning) = crate::limits::open_file_room(&config) {
        tracing::warn!("{warning}");
        eprintln!("idemgate: warning: {warning}");
    }
    let listeners = Listeners::bind(&config).await?;
    let app = App::build(config, listeners)
        .await?
        .reload_on_sighup(path.to_path_buf());
    tracing::info!(listen = %app.local_addr(), routes = app.config().routes.len(), "idemgate serving");
    // On stdout whatever the log filter, so a supervisor (or a test) that asked for port 0
    // learns the bound address.
    println!("idemgate: listening on {}", app.local_addr());
    if let Some(admin) = app.admin_addr() {
        println!("idemgate: admin on {admin}");
    }
    let gateway = Arc::clone(app.gateway());
    let drain_delay = app.config().server.drain_delay;
    Ok(app
        .run(async move { crate::server::drain_on_signal(signals, &gateway, drain_delay).await })
        .await?)
}

/// `idemgate gc`: delete expired rows once.
pub async fn gc(path: &Path) -> Result<crate::store::GcRun, CommandError> {
    let config = Config::load(path)?;
    let store = open_store(&config)?;
    Ok(store.gc(config.gc.batch_size).await?)
}

/// `idemgate check`: validate and print the resolved routes. Values are printed as the
/// config spells them (`in_flight wait`, `500ms`, `1MiB`), so a line can be compared with
/// the file, or pasted back into it.
pub fn check(path: &Path) -> Result<String, CommandError> {
    let config = Config::load(path)?;
    for warning in config.warnings() {
        eprintln!("idemgate: warning: {warning}");
    }
    let mut out = format!(
        "{}: ok\nlisten {}{}\n",
        path.display(),
        config.listen,
        if config.server.tls.is_some() {
            " (TLS)"
        } else {
            ""
        }
    );
    if let Some(a) = &config.admin {
        out.push_str(&format!(
            "admin  {}{}\n",
            a.listen,
            if a.token.is_some() {
                " (key API needs the bearer token)"
            } else {
                ""
            }
        ));
    }
    let store = match &config.store {
        StoreConfig::Postgres(pg) => format!(
            "store  postgres (pool {}, acquire {}, statement {}, tls {}{})",
            pg.pool_size,
            fmt_duration(pg.acquire_timeout),
            fmt_duration(pg.statement_timeout),
            pg.tls.as_str(),
            if pg.allow_async_commit {
                ", async commit allowed"
            } else {
                ""
            }
        ),
        StoreConfig::Sqlite(sq) => format!("store  sqlite {}", sq.path.display()),
    };
    out.push_str(&store);
    out.push('\n');
    out.push_str(&format!(
        "server shutdown: drain_delay {} then shutdown_grace {}\n",
        fmt_duration(config.server.drain_delay),
        fmt_duration(config.server.shutdown_grace)
    ));
    out.push_str(&format!(
        "server limits: max_connections {} max_header_bytes {} max_buffered_bytes {}\n",
        config.server.max_connections,
        fmt_size(config.server.max_header_bytes),
        fmt_size(config.server.max_buffered_bytes)
    ));
    if config.replay_cache_bytes == 0 {
        out.push_str("replay_cache off (max_bytes 0)\n");
    } else {
        out.push_str(&format!(
            "replay_cache max_bytes {}\n",
            fmt_size(config.replay_cache_bytes)
        ));
    }
    for (name, up) in &config.upstreams {
        let mut extra = String::new();
        if up.http2 {
            extra.push_str(", http2");
        }
        if up.preserve_host {
            extra.push_str(", preserve_host");
        }
        out.push_str(&format!(
            "upstream {name}: {} (connect {}, timeout {}{extra})\n",
            up.url,
            fmt_duration(up.connect_timeout),
            fmt_duration(up.timeout)
        ));
    }
    for (i, r) in config.routes.iter().enumerate() {
        let path = match &r.path {
            PathMatch::Exact(p) => format!("path {p}"),
            PathMatch::Prefix(p) => format!("path_prefix {p}"),
        };
        let methods = r
            .methods
            .as_ref()
            .map(|m| m.iter().map(|m| m.as_str()).collect::<Vec<_>>().join(","))
            .unwrap_or_else(|| "any".into());
        out.push_str(&format!(
            "route[{i}] {}: {path} methods {methods} -> {}\n",
            r.name, r.upstream
        ));
        match &r.idempotency {
            None => out.push_str("  idempotency: off (plain proxy)\n"),
            Some(idem) => {
                let keys: Vec<String> = idem
                    .key
                    .iter()
                    .map(|k| match k {
                        crate::config::KeySource::Header(h) => format!("header {h}"),
                        crate::config::KeySource::Json(p) => format!("json {p}"),
                    })
                    .collect();
                let scope = match &idem.scope {
                    ScopeSource::Header(h) => format!("header {h}"),
                    ScopeSource::Json(p) => format!("json {p}"),
                    ScopeSource::Authorization => "sha256(authorization)".into(),
                    ScopeSource::Fixed(f) => format!("fixed {f}"),
                };
                let methods: Vec<&str> = idem.methods.iter().map(|m| m.as_str()).collect();
                out.push_str(&format!(
                    "  idempotency: mode {} methods {} key [{}]{} scope {scope}\n  ttl {} lease {} in_flight {} wait_timeout {} on_unknown_outcome {} on_store_error {}\n  max_request_body {} max_stored_response {}\n",
                    idem.mode.as_str(),
                    methods.join(","),
                    keys.join(", "),
                    if idem.required { " required" } else { "" },
                    fmt_duration(idem.ttl),
                    fmt_duration(idem.lease),
                    idem.in_flight.as_str(),
                    fmt_duration(idem.wait_timeout),
                    idem.on_unknown_outcome.as_str(),
                    idem.on_store_error.as_str(),
                    fmt_size(idem.max_request_body),
                    fmt_size(idem.max_stored_response),
                ));
                if let Some(ser) = &idem.serialize {
                    out.push_str(&format!(
                        "  serialize: {} in flight per scope, wait {}\n",
                        ser.max_in_flight,
                        fmt_duration(ser.wait_timeout)
                    ));
                }
            }
        }
    }
    Ok(out)
}

/// `idemgate migrate`: apply pending migrations, then their online work (indexes, backfills),
/// and exit. Returns how many were applied and what the online work did.
pub async fn migrate(path: &Path) -> Result<(usize, crate::store::OnlineRun), CommandError> {
    let config = Config::load(path)?;
    let store = open_store(&config)?;
    let applied = store.migrate().await?;
    Ok((applied, store.migrate_online().await?))
}

/// `idemgate keys show`: the row as JSON, or an error when absent or ambiguous.
pub async fn keys_show(
    path: &Path,
    scope: &str,
    key: &str,
    route: Option<&str>,
) -> Result<String, CommandError> {
    let config = Config::load(path)?;
    let store = open_store(&config)?;
    let info = crate::keys::find(store.as_ref(), &config, scope, key, route).await?;
    Ok(serde_json::to_string_pretty(&crate::admin::key_json(&info)).expect("JSON serializes"))
}

/// `idemgate keys list`: one page of the keys `args` asks for, as a table (key id, scope,
/// key, route, state, age, lease left, then the cursor of the next page) or, with `json`, as
/// `{"keys": [...], "next_cursor": ...}` with each key as `keys show` prints it.
pub async fn keys_list(
    path: &Path,
    args: crate::keys::ListArgs,
    json: bool,
) -> Result<String, CommandError> {
    // A parameter is named as its flag (`--older-than`), not as the API's `older_than`.
    let flag = |e: crate::keys::LookupError| match e {
        crate::keys::LookupError::Invalid { param, why } => {
            CommandError::Other(format!("invalid --{}: {why}", param.replace('_', "-")))
        }
        e => CommandError::Lookup(e),
    };
    let config = Config::load(path)?;
    let req = crate::keys::ListRequest::parse(&config, args).map_err(flag)?;
    let store = open_store(&config)?;
    let page = crate::keys::list(store.as_ref(), &config, &req)
        .await
        .map_err(flag)?;
    if json {
        return Ok(
            serde_json::to_string_pretty(&crate::admin::list_json(&page)).expect("JSON serializes"),
        );
    }
    Ok(keys_table(&page))
}

/// The terminal's view of a page: one aligned line per key, then where the next page starts.
fn keys_table(page: &crate::keys::Listed) -> String {
    let head = [
        "KEY ID",
        "SCOPE",
        "KEY",
        "ROUTE",
        "STATE",
        "AGE",
        "LEASE LEFT",
    ];
    let rows: Vec<[String; 7]> = page
        .keys
        .iter()
        .map(|k| {
            [
                crate::key::KeyId::of(&k.scope, &k.key).as_str().to_string(),
                printable(&k.scope),
                printable(&k.key),
                k.route.clone(),
                k.state.clone(),
                fmt_age(k.age_ms),
                match k.lease_left_ms {
                    None => "-".to_string(),
                    Some(ms) if ms <= 0 => "ended".to_string(),
                    Some(ms) => fmt_age(ms),
                },
            ]
        })
        .collect();
    let mut widths = head.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<w$}  "));
            }
        }
        out.push('\n');
        out
    };
    let mut out = line(head.to_vec());
    for row in &rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out.push_str(&match &page.next_cursor {
        Some(c) => format!(
            "{} key(s); more may follow: --cursor {c}\n",
            page.keys.len()
        ),
        None => format!("{} key(s); end of the listing\n", page.keys.len()),
    });
    out
}

/// A scope or key for one table cell: control characters shown as `?`.
fn printable(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// A duration for a person: its two largest units (`3d4h`, `2h5m`, `5m3s`, `12s`, `450ms`).
fn fmt_age(ms: i64) -> String {
    let ms = ms.max(0);
    let s = ms / 1000;
    let (d, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d{h}h")
    } else if h > 0 {
        format!("{h}h{m}m")
    } else if m > 0 {
        format!("{m}m{sec}s")
    } else if s > 0 {
        format!("{s}s")
    } else {
        format!("{ms}ms")
    }
}

/// `idemgate keys delete`: deletes the row; one in flight under a live lease only with
/// `force` (exit 1 otherwise).
pub async fn keys_delete(
    path: &Path,
    scope: &str,
    key: &str,
    route: Option<&str>,
    force: bool,
) -> Result<(), CommandError> {
    let config = Config::load(path)?;
    let store = open_store(&config)?;
    crate::keys::delete(store.as_ref(), &config, scope, key, route, force).await?;
    Ok(())
}

/// What `idemgate health` asks: `/readyz` on a config's `admin.listen`, or a URL given.
#[derive(Debug, Clone)]
pub enum HealthTarget {
    Config(std::path::PathBuf),
    Url(String),
}

/// The most of an answer's body `idemgate health` reads (for the reason of a 503).
const HEALTH_BODY_LIMIT: usize = 4096;

/// `idemgate health`: one `GET` of the admin listener's `/readyz`, all of it (connecting
/// included) within `timeout`. `Ok` with a line to print when it answers 200; `Err` with a
/// one-line reason otherwise, a bad config included: a container `HEALTHCHECK` knows exit 0
/// (healthy) and 1 (unhealthy) only, so `main.rs` exits 1, never 64, for any of them. Plain
/// HTTP only: the admin listener has no TLS. The bearer token of `--config` is sent, though
/// `/readyz` needs none today, so the probe keeps working if the admin API ever asks for it.
pub async fn health(target: &HealthTarget, timeout: std::time::Duration) -> Result<String, String> {
    let (url, token) = match target {
        HealthTarget::Url(url) => (url.clone(), None),
        HealthTarget::Config(path) => {
            let config = Config::load(path).map_err(|e| e.to_string())?;
            let admin = config.admin.ok_or_else(|| {
                format!(
                    "{} has no admin.listen: there is no /readyz to ask",
                    path.display()
                )
            })?;
            (
                format!("http://{}/readyz", probe_addr(admin.listen)),
                admin.token,
            )
        }
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("'{url}' is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "'{url}': only http:// URLs (the admin listener has no TLS)"
        ));
    }
    let authority = uri
        .authority()
        .ok_or_else(|| format!("'{url}' has no host"))?
        .clone();
    let asked = tokio::time::timeout(timeout, get_once(&uri, &authority, token.as_deref())).await;
    match asked {
        Err(_) => Err(format!(
            "no answer from {url} within {}",
            fmt_duration(timeout)
        )),
        Ok(Err(e)) => Err(format!("{url}: {e}")),
        Ok(Ok((status, body))) if status == http::StatusCode::OK => {
            // Ready through a store outage (see admin.rs): say so, and still exit 0.
            match body_field(&body, "status").as_deref() {
                Some("degraded") => Ok(format!(
                    "ready (degraded: {}): {url} answered 200",
                    body_field(&body, "reason").unwrap_or_default()
                )),
                _ => Ok(format!("ready: {url} answered 200")),
            }
        }
        Ok(Ok((status, body))) => {
            // /readyz says why in its JSON body.
            let reason = body_field(&body, "reason")
                .or_else(|| body_field(&body, "status"))
                .map(|r| format!(": {r}"))
                .unwrap_or_default();
            Err(format!("{url} answered {status}{reason}"))
        }
    }
}

/// A string field of a `/readyz` JSON body, on one short line.
fn body_field(body: &[u8], name: &str) -> Option<String> {
    let value = serde_json::from_slice::<serde_json::Value>(body).ok()?;
    let text = value.get(name)?.as_str()?;
    Some(
        text.chars()
            .map(|c| if c.is_control() { ' ' } else { c })
            .take(300)
            .collect(),
    )
}

/// Where to reach a listener from the same host: an unspecified address (`0.0.0.0`, `::`)
/// is reached on the loopback of its family.
fn probe_addr(listen: std::net::SocketAddr) -> std::net::SocketAddr {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    std::net::SocketAddr::new(ip, listen.port())
}

/// One HTTP/1.1 `GET` on a fresh connection: the status and the start of the body.
async fn get_once(
    uri: &http::Uri,
    authority: &http::uri::Authority,
    token: Option<&str>,
) -> Result<(http::StatusCode, bytes::Bytes), String> {
    use http_body_util::BodyExt;
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::net::TcpStream::connect((host, port))
        .await
        .map_err(|e| format!("cannot connect: {e}"))?;
    let (mut sender, conn) =
        hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
            .await
            .map_err(|e| format!("HTTP handshake: {e}"))?;
    tokio::spawn(conn);
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let mut req = http::Request::get(path)
        .header(http::header::HOST, authority.as_str())
        .header(http::header::USER_AGENT, "idemgate-health");
    if let Some(token) = token {
        req = req.header(http::header::AUTHORIZATION, format!("Bearer {token}"));
    }
    let req = req
        .body(http_body_util::Empty::<bytes::Bytes>::new())
        .map_err(|e| format!("building the request: {e}"))?;
    let resp = sender
        .send_request(req)
        .await
        .map_err(|e| format!("no answer: {e}"))?;
    let status = resp.status();
    // Only a 503's reason is of use, and only its start: a stray server's endless body
    // must not keep the probe from answering.
    let body = http_body_util::Limited::new(resp.into_body(), HEALTH_BODY_LIMIT)
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    Ok((status, body))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_are_shown_in_their_two_largest_units() {
        for (ms, shown) in [
            (450, "450ms"),
            (12_345, "12s"),
            (303_000, "5m3s"),
            (7_500_000, "2h5m"),
            (273_600_000, "3d4h"),
            (-5, "0ms"),
        ] {
            assert_eq!(fmt_age(ms), shown);
        }
    }

    #[test]
    fn check_prints_values_as_the_config_spells_them() {
        let dir = std::env::temp_dir().join(format!("idemgate-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gateway.yaml");
        std::fs::write(
            &file,
            r#"
store: { postgres: { url: "postgres://u:secret@localhost/db", tls: { mode: require } } }
replay_cache: { max_bytes: 0 }
upstreams: { app: { url: "http://127.0.0.1:9000", timeout: 30s } }
routes:
  - name: r
    match: { path_prefix: / }
    upstream: app
    idempotency:
      in_flight: reject
      wait_timeout: 1500ms
      on_unknown_outcome: hold
      on_store_error: pass_through
      max_request_body: 64KiB
      serialize: { max_in_flight: 2, wait_timeout: 2s }
"#,
        )
        .unwrap();
        let out = check(&file);
        let _ = std::fs::remove_dir_all(&dir);
        let out = out.unwrap();
        for spelled in [
            "store  postgres (pool 16, acquire 500ms, statement 2s, tls require)",
            "server shutdown: drain_delay 0s then shutdown_grace 30s",
            "server limits: max_connections 10000 max_header_bytes 64KiB max_buffered_bytes 256MiB",
            "replay_cache off (max_bytes 0)",
            "upstream app: http://127.0.0.1:9000/ (connect 1s, timeout 30s)",
            "in_flight reject wait_timeout 1500ms on_unknown_outcome hold on_store_error pass_through",
            "max_request_body 64KiB max_stored_response 1MiB",
            "serialize: 2 in flight per scope, wait 2s",
        ] {
            assert!(out.contains(spelled), "'{spelled}' in:\n{out}");
        }
        // Rust's Debug forms of the same values, and the secret.
        for debug in [
            "Require",
            "Reject",
            "Hold",
            "PassThrough",
            "Some(",
            "1.5s",
            "secret",
        ] {
            assert!(!out.contains(debug), "'{debug}' in:\n{out}");
        }
    }
}
