//! The admin listener (`admin.listen`): metrics, liveness, readiness and the key API
//! (docs/contract.md §6).
//!
//! - `GET /metrics`: OpenMetrics when asked for, else the Prometheus text format (see
//!   `metrics.rs`).
//! - `GET /healthz`: 200 while the process serves.
//! - `GET /readyz`: whether a load balancer should send this instance traffic (see
//!   [`readyz`]): 503 while draining (contract §8.3), until the store has been ready once,
//!   and while the store refuses to keep commits (contract §8.4); 200 otherwise, also during
//!   a store outage once the store has been ready, with the trouble in the body.
//! - `GET /v1/keys?scope=S&key=K[&route=R]`: the row as JSON (404 when absent). `S` is the
//!   scope value the client sent; `R` chooses among routes whose scopes share that value
//!   (400 when it is ambiguous without it; see `keys.rs`).
//! - `GET /v1/keys[?state=&route=&scope=&older_than=&limit=&cursor=]` (no `key`): one page
//!   of the keys, in `(scope, key)` order, with the cursor of the next (see `keys::list`); a
//!   parameter that is not valid is 400 `invalid-parameter`, naming it.
//! - `DELETE /v1/keys?scope=S&key=K[&route=R][&force=true]`: deletes the row (releases a held
//!   or stuck key), 204, or 404 when absent. A key in flight under a live lease is refused
//!   with 409 `key-in-flight` unless forced; a forced delete of one is logged and counted
//!   (`idemgate_leases_total{event="force_deleted"}`). This instance's replay cache forgets
//!   the key at once; other instances' caches on the NOTIFY.
//!
//! With `admin.token` set, the key API requires `Authorization: Bearer <token>` (the scheme
//! in any case; 401 without it, compared in constant time); metrics and health stay open.
//! A non-loopback `admin.listen` requires a token (a config error otherwise). The token is
//! read from the configuration in force, so a reload can rotate it.

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::forward::{Body, full};
use crate::gateway::Gateway;
use crate::keys::LookupError;
use crate::store::KeyInfo;

/// Serves the admin API until `shutdown` resolves.
pub async fn run(listener: TcpListener, gateway: Arc<Gateway>, shutdown: impl Future<Output = ()>) {
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(std::time::Duration::from_secs(10));
    tokio::pin!(shutdown);
    loop {
        let (stream, _) = tokio::select! {
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(_) => { tokio::time::sleep(std::time::Duration::from_millis(50)).await; continue }
            },
            () = &mut shutdown => return,
        };
        let gateway = Arc::clone(&gateway);
        let svc = service_fn(move |req| {
            let gateway = Arc::clone(&gateway);
            async move { Ok::<_, Infallible>(handle(req, &gateway).await) }
        });
        let conn = builder
            .serve_connection(TokioIo::new(stream), svc)
            .into_owned();
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
}

fn json(status: StatusCode, value: serde_json::Value) -> Response<Body> {
    let mut r = Response::new(full(Bytes::from(value.to_string())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        "application/json".parse().expect("static"),
    );
    r
}

/// The JSON an operator sees for one key (CLI and HTTP alike).
pub fn key_json(info: &KeyInfo) -> serde_json::Value {
    serde_json::json!({
        "scope": info.scope,
        "key": info.key,
        "route": info.route,
        "state": info.state,
        "status": info.status,
        "attempts": info.attempts,
        "body_bytes": info.body_bytes,
        "created_at": info.created_at,
        "completed_at": info.completed_at,
        "lease_expires_at": info.lease_expires_at,
        "expires_at": info.expires_at,
        "fingerprint": info.fingerprint_hex,
        "key_id": crate::key::KeyId::of(&info.scope, &info.key).as_str(),
    })
}

/// Whether the request carries the bearer token (or none is configured).
fn authorized(req: &Request<Incoming>, token: Option<&str>) -> bool {
    let Some(token) = token else { return true };
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .map(|v| bearer(v.as_bytes()))
        .unwrap_or_default();
    // Constant time in the token's length (RFC 6750: the scheme is case-insensitive).
    use subtle::ConstantTimeEq;
    bool::from(given.ct_eq(token.as_bytes()))
}

/// The credentials of a `Bearer` authorization (the scheme matched in any case), or empty.
fn bearer(value: &[u8]) -> &[u8] {
    let Some(space) = value.iter().position(|&b| b == b' ') else {
        return &[];
    };
    let (scheme, rest) = value.split_at(space);
    if !scheme.eq_ignore_ascii_case(b"bearer") {
        return &[];
    }
    let rest = &rest[1..];
    let start = rest.iter().position(|&b| b != b' ').unwrap_or(rest.len());
    &rest[start..]
}

async fn handle(req: Request<Incoming>, gateway: &Gateway) -> Response<Body> {
    let store = gateway.store().as_ref();
    let path = req.uri().path();
    match (req.method(), path) {
        (&Method::GET, "/metrics") => {
            let accept = req
                .headers()
                .get(header::ACCEPT)
                .and_then(|v| v.to_str().ok());
            let format = crate::metrics::Format::negotiate(accept);
            let mut r = Response::new(full(Bytes::from(gateway.render_metrics(format))));
            r.headers_mut().insert(
                header::CONTENT_TYPE,
                format.content_type().parse().expect("static"),
            );
            r
        }
        (&Method::GET, "/healthz") => json(StatusCode::OK, serde_json::json!({"status": "ok"})),
        (&Method::GET, "/readyz") => readyz(gateway).await,
        (m, "/v1/keys") if m == Method::GET || m == Method::DELETE => {
            let config = gateway.config();
            let token = config.admin.as_ref().and_then(|a| a.token.as_deref());
            if !authorized(&req, token) {
                let mut r = json(
                    StatusCode::UNAUTHORIZED,
                    serde_json::json!({"error": "a bearer token is required"}),
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, "Bearer".parse().expect("static"));
                return r;
            }
            let query = req.uri().query().unwrap_or("");
            if m == Method::GET && query_param(query, "key").is_none() {
                return list(store, &config, query).await;
            }
            let (Some(scope), Some(key)) = (query_param(query, "scope"), query_param(query, "key"))
            else {
                return json(
                    StatusCode::BAD_REQUEST,
                    serde_json::json!({"error": "give both scope and key query parameters"}),
                );
            };
            let route = query_param(query, "route");
            let route = route.as_deref();
            let force = query_param(query, "force").is_some_and(|v| v == "true" || v == "1");
            let found = if m == Method::GET {
                crate::keys::find(store, &config, &scope, &key, route)
                    .await
                    .map(|info| json(StatusCode::OK, key_json(&info)))
            } else {
                crate::keys::delete(store, &config, &scope, &key, route, force)
                    .await
                    .map(|(info, live_lease)| {
                        // Our own replay cache forgets the key now, not on the NOTIFY.
                        gateway
                            .inflight()
                            .wake(crate::key::KeyId::of(&info.scope, &key).as_str());
                        if live_lease {
                            gateway.metrics().lease(&info.route, "force_deleted");
                        }
                        let mut r = Response::new(full(Bytes::new()));
                        *r.status_mut() = StatusCode::NO_CONTENT;
                        r
                    })
            };
            found.unwrap_or_else(|e| lookup_error(&e))
        }
        _ => json(
            StatusCode::NOT_FOUND,
            serde_json::json!({"error": "not found"}),
        ),
    }
}

/// The longest `/readyz` waits for the store: a store slower than this counts as
/// unreachable, and the probe is answered before a kubelet's default timeout (1s) passes.
const READY_CHECK_BOUND: std::time::Duration = std::time::Duration::from_millis(800);

/// `GET /readyz`. Readiness decides whether this instance gets traffic, so it fails only
/// when another instance would serve better:
///
/// - draining (SIGTERM received): 503 `{"status":"draining"}`, so the load balancer stops
///   sending while the listener still serves for `server.drain_delay`;
/// - the store has never been ready in this process (starting, a wrong URL, the database
///   down since start, migrations not applied): 503 `not ready`, so a rollout does not
///   replace working instances with ones that cannot reach their store;
/// - the store answers but may lose commits (`synchronous_commit = off` without
///   `allow_async_commit`, docs/contract.md §8.4): 503 `not ready`, always: that is a
///   configuration error, not an outage;
/// - the store was ready before and does not answer now: 200 `{"status":"degraded"}` with
///   the reason. The outage is shared by every instance on that database, so failing
///   readiness would pull all of them out at once and turn 503 `store-unavailable` (with
///   `Retry-After`) on keyed routes into connection errors on every route, plain and
///   `pass_through` ones included: the gateway would become the outage of the service
///   behind it. `idemgate_requests_total{outcome="store_unavailable"|"bypassed"}` alerts
///   on it instead.
async fn readyz(gateway: &Gateway) -> Response<Body> {
    use crate::store::StoreError;
    let readiness = gateway.readiness();
    if readiness.draining() {
        return json(
            StatusCode::SERVICE_UNAVAILABLE,
            serde_json::json!({"status": "draining"}),
        );
    }
    let checked = tokio::time::timeout(READY_CHECK_BOUND, gateway.store().ready())
        .await
        .unwrap_or(Err(StoreError::Timeout));
    match checked {
        Ok(()) => {
            readiness.store_ready();
            json(StatusCode::OK, serde_json::json!({"status": "ready"}))
        }
        Err(e @ StoreError::NotDurable(_)) => not_ready(&e),
        Err(e) if readiness.store_was_ready() => json(
            StatusCode::OK,
            serde_json::json!({"status": "degraded", "store": "unavailable", "reason": e.to_string()}),
        ),
        Err(e) => not_ready(&e),
    }
}

fn not_ready(e: &crate::store::StoreError) -> Response<Body> {
    json(
        StatusCode::SERVICE_UNAVAILABLE,
        serde_json::json!({"status": "not ready", "reason": e.to_string()}),
    )
}

/// `GET /v1/keys` without `key`: one page of the listing (see `keys::list`), as
/// `{"keys": [...], "next_cursor": ...}`; a parameter that is not valid is 400
/// `invalid-parameter`, whose detail names it.
async fn list(
    store: &dyn crate::store::Store,
    config: &crate::config::Config,
    query: &str,
) -> Response<Body> {
    let args = crate::keys::ListArgs {
        state: query_param(query, "state"),
        route: query_param(query, "route"),
        scope: query_param(query, "scope"),
        older_than: query_param(query, "older_than"),
        limit: query_param(query, "limit"),
        cursor: query_param(query, "cursor"),
    };
    let listed = match crate::keys::ListRequest::parse(config, args) {
        Ok(req) => crate::keys::list(store, config, &req).await,
        Err(e) => Err(e),
    };
    match listed {
        Ok(page) => json(StatusCode::OK, list_json(&page)),
        Err(e) => lookup_error(&e),
    }
}

/// A page of a listing as JSON (CLI and HTTP alike): each key as [`key_json`] shows it.
pub fn list_json(page: &crate::keys::Listed) -> serde_json::Value {
    serde_json::json!({
        "keys": page.keys.iter().map(key_json).collect::<Vec<_>>(),
        "next_cursor": page.next_cursor,
    })
}

/// An operator's lookup that found no single key, as an answer.
fn lookup_error(e: &LookupError) -> Response<Body> {
    let status = match e {
        LookupError::NotFound { .. } => StatusCode::NOT_FOUND,
        LookupError::Ambiguous { .. } | LookupError::UnknownRoute(_) => StatusCode::BAD_REQUEST,
        LookupError::InFlight { key } => {
            return crate::problem::Problem {
                status: StatusCode::CONFLICT,
                slug: "key-in-flight",
                title: "Key in flight",
                detail: format!(
                    "Key '{key}' is in flight under a live lease: deleting it lets a retry forward again while the first attempt may still complete (a possible double). Add force=true to delete it anyway."
                ),
                retry_after: None,
                request_id: None,
            }
            .into_response();
        }
        LookupError::Invalid { param, why } => {
            return crate::problem::Problem {
                status: StatusCode::BAD_REQUEST,
                slug: "invalid-parameter",
                title: "Invalid parameter",
                detail: format!("Query parameter '{param}': {why}."),
                retry_after: None,
                request_id: None,
            }
            .into_response();
        }
        LookupError::Store(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    json(status, serde_json::json!({"error": e.to_string()}))
}

/// One query parameter, percent-decoded (`+` is a space).
pub fn query_param(query: &str, name: &str) -> Option<String> {
    query.split('&').find_map(|pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        (percent_decode(k)? == name)
            .then(|| percent_decode(v))
            .flatten()
    })
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s.get(i + 1..i + 3)?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive() {
        assert_eq!(bearer(b"Bearer abc"), b"abc");
        assert_eq!(bearer(b"bearer abc"), b"abc");
        assert_eq!(bearer(b"BEARER  abc"), b"abc");
        assert_eq!(bearer(b"Basic abc"), b"");
        assert_eq!(bearer(b"Bearerabc"), b"");
    }

    #[test]
    fn query_params_are_decoded() {
        let q = "scope=acct%201&key=a%2Bb+c";
        assert_eq!(query_param(q, "scope").as_deref(), Some("acct 1"));
        assert_eq!(query_param(q, "key").as_deref(), Some("a+b c"));
        assert_eq!(query_param(q, "nope"), None);
        assert_eq!(query_param("key=%zz", "key"), None);
    }
}
