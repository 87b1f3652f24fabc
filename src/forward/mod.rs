//! The upstream side: keep-alive connections per upstream, header hygiene, timeouts.
//!
//! Outbound requests lose their hop-by-hop headers (RFC 9110 section 7.6.1: the fixed list
//! and every header named in `Connection`) and their `Host` (the client sets the upstream's
//! authority, or with `preserve_host` the client's), and gain `X-Forwarded-For/-Proto/-Host`
//! and a standard `Forwarded` element (RFC 7239). `TE: trailers` is the one hop-by-hop
//! value kept: the gateway passes trailers on, so it may say so (RFC 9110 section 10.1.4;
//! gRPC requires it). Responses lose their hop-by-hop headers on the way back. An upgrade
//! (`tunnel.rs`) puts its own `Connection`/`Upgrade` back.
//!
//! Each upstream speaks HTTP/1.1, or with `http2: true` HTTP/2 (h2c by prior knowledge for
//! `http://`, ALPN `h2` then `http/1.1` for `https://`). Its connections always go to its
//! configured `url` ([`Pinned`]), whatever authority a request names. Plain and keyed
//! forwards to a plain `http://` HTTP/1.1 upstream go over connections driven by the task that
//! forwards (`h1.rs`); upgrades, h2 and TLS go over hyper-util's pooled client.
//!
//! Failures are classified by what they mean for the key: [`UpstreamError::Connect`] means
//! the request never left (safe to release), [`UpstreamError::Timeout`] and
//! [`UpstreamError::Failed`] mean it may have been processed.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::UpstreamConfig;

mod error;
mod h1;

pub use crate::payload::{Body, BoxError, PIECE, error_chain, full, stream};
pub use error::UpstreamError;

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");
const FORWARDED: HeaderName = HeaderName::from_static("forwarded");

/// Removes hop-by-hop headers, including every header named in `Connection`.
///
/// One pass over the names present marks which hop-by-hop names are there (a bit each, no
/// allocation): most messages carry none, or only `Connection` (and `Keep-Alive`), and a map
/// lookup per hop-by-hop name costs more than the pass.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    use crate::headers::{HOP_BY_HOP, HOP_BY_HOP_LENGTHS};
    let present = headers.keys().fold(0u16, |bits, name| {
        // Most names are ruled out by their length alone.
        let len = name.as_str().len();
        if len >= 32 || HOP_BY_HOP_LENGTHS & 1 << len == 0 {
            return bits;
        }
        HOP_BY_HOP
            .iter()
            .position(|h| h == name)
            .map_or(bits, |i| bits | 1 << i)
    });
    if present == 0 {
        return;
    }
    // `Connection` is `HOP_BY_HOP[0]`. Its usual values name nothing but hop-by-hop headers.
    let usual = |v: &HeaderValue| {
        let v = v.as_bytes();
        v.eq_ignore_ascii_case(b"keep-alive") || v.eq_ignore_ascii_case(b"close")
    };
    if present & 1 != 0 && !headers.get_all(header::CONNECTION).iter().all(usual) {
        // A token naming a hop-by-hop header (`keep-alive`, the usual one) is removed below
        // anyway: only other names are collected, so the usual case allocates nothing.
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .filter(|t| {
                !HOP_BY_HOP
                    .iter()
                    .any(|h| t.eq_ignore_ascii_case(h.as_str()))
            })
            .filter_map(|t| HeaderName::from_bytes(t.as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP.iter().enumerate() {
        if present & 1 << i != 0 {
            headers.remove(name);
        }
    }
}

/// One client per upstream, sharing nothing but the executor.
pub struct Upstreams {
    clients: HashMap<String, UpstreamClient>,
}

pub struct UpstreamClient {
    pub config: UpstreamConfig,
    client: Client<Pinned, Body>,
    /// Plain and keyed forwards to a plain `http://` HTTP/1.1 upstream, without the pooled
    /// client's connection tasks (`forward/h1.rs`).
    direct: Option<std::sync::Arc<h1::Pool>>,
    /// `max_in_flight`: shared with the clients a reload builds for the same upstream name.
    pub limit: std::sync::Arc<crate::limits::UpstreamLimit>,
}

impl Upstreams {
    /// One client per upstream; `limit` gives each its admission counter by name (the same
    /// counter across reloads, so requests admitted before a reload still count).
    pub fn new<'a>(
        configs: impl IntoIterator<Item = &'a UpstreamConfig>,
        limit: impl Fn(&UpstreamConfig) -> std::sync::Arc<crate::limits::UpstreamLimit>,
    ) -> Upstreams {
        let clients = configs
            .into_iter()
            .map(|cfg| {
                let mut connector = HttpConnector::new();
                connector.set_connect_timeout(Some(cfg.connect_timeout));
                connector.set_nodelay(true);
                connector.enforce_http(false);
                // The CA file (or the platform's roots) was loaded once at validation; if it
                // cannot be read now, fail closed: no roots, so every https request to this
                // upstream is refused (502).
                let tls = crate::tls::client_config(cfg.tls_ca.as_deref()).unwrap_or_else(|e| {
                    tracing::error!(upstream = %cfg.name, error = %e, "cannot load the upstream's trusted roots; its https requests will fail");
                    rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
                        rustls::crypto::ring::default_provider(),
                    ))
                    .with_safe_default_protocol_versions()
                    .expect("ring supports the default versions")
                    .with_root_certificates(rustls::RootCertStore::empty())
                    .with_no_client_auth()
                });
                let builder = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_or_http()
                    .enable_http1();
                // With `http2`, ALPN offers h2 then http/1.1 and the client follows what was
                // negotiated; in clear there is no negotiation, so h2 by prior knowledge.
                let connector = if cfg.http2 {
                    builder.enable_http2().wrap_connector(connector)
                } else {
                    builder.wrap_connector(connector)
                };
                let h2c = cfg.http2 && cfg.url.scheme() == Some(&http::uri::Scheme::HTTP);
                let client = Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(cfg.idle_timeout)
                    .pool_max_idle_per_host(h1::MAX_IDLE)
                    .http2_only(h2c)
                    .build(Pinned {
                        inner: connector,
                        to: origin(&cfg.url),
                        connect_timeout: cfg.connect_timeout,
                    });
                (
                    cfg.name.clone(),
                    UpstreamClient {
                        config: cfg.clone(),
                        client,
                        direct: h1::Pool::for_upstream(cfg),
                        limit: limit(cfg),
                    },
                )
            })
            .collect();
        Upstreams { clients }
    }

    pub fn get(&self, name: &str) -> Option<&UpstreamClient> {
        self.clients.get(name)
    }
}

/// The scheme and authority of an upstream's URL, without its path prefix.
fn origin(url: &Uri) -> Uri {
    let mut parts = http::uri::Parts::default();
    parts.scheme = url.scheme().cloned();
    parts.authority = url.authority().cloned();
    parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
    Uri::from_parts(parts).unwrap_or_else(|_| url.clone())
}

/// A connector that always connects to its upstream's configured origin, whatever authority
/// the request names. With `preserve_host` a request's URI carries the client's `Host` (so
/// it becomes HTTP/1.1's `Host` and h2's `:authority`), but the connection, its TLS server
/// name and certificate check stay those of the upstream's `url`. Requests naming different
/// hosts get their own pooled connections (the pool is keyed by URI authority), all to it.
///
/// A connection is up within `connect_timeout`, its TLS handshake included (the TCP
/// connector bounds only the socket's connect): a server that accepts and never completes
/// the handshake has been sent nothing, so it is a connect failure (502, the key released),
/// never the exchange's `timeout` and an unknown outcome.
#[derive(Clone)]
struct Pinned {
    inner: HttpsConnector<HttpConnector>,
    to: Uri,
    connect_timeout: std::time::Duration,
}

type Connected = <HttpsConnector<HttpConnector> as tower_service::Service<Uri>>::Response;

impl tower_service::Service<Uri> for Pinned {
    type Response = Connected;
    type Error = BoxError;
    type Future = std::pin::Pin<
        Box<dyn std::future::Future<Output = Result<Connected, BoxError>> + Send + 'static>,
    >;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, _requested: Uri) -> Self::Future {
        let connecting = self.inner.call(self.to.clone());
        let limit = self.connect_timeout;
        Box::pin(async move {
            match tokio::time::timeout(limit, connecting).await {
                Ok(connected) => connected,
                Err(_) => Err(format!(
                    "the connection was not up within connect_timeout ({})",
                    crate::config::fmt_duration(limit)
                )
                .into()),
            }
        })
    }
}

/// What the gateway knows about the client side of a request (one per connection).
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub addr: SocketAddr,
    pub tls: bool,
    /// The connection's sleep for its requests' body reads and upstream exchanges, reused
    /// from one to the next (`timer.rs`): a request reads its body before it forwards, so on
    /// HTTP/1 one sleep serves both; requests at once (h2) get more from the spare.
    pub(crate) timer: crate::timer::Spare,
    /// The client's IP as a header value, made once per connection, not per request.
    ip: HeaderValue,
    /// `for=<ip>;proto=<scheme>` of this connection's `Forwarded` element, made once.
    forwarded: std::sync::Arc<str>,
}

impl ClientInfo {
    pub fn new(addr: SocketAddr, tls: bool) -> ClientInfo {
        let ip = HeaderValue::from_str(&addr.ip().to_string())
            .expect("an IP address is a valid header value");
        // RFC 7239 section 6: an IPv6 address is bracketed, and then must be quoted.
        let node = match addr.ip().to_canonical() {
            IpAddr::V4(v4) => v4.to_string(),
            IpAddr::V6(v6) => format!("\"[{v6}]\""),
        };
        let proto = if tls { "https" } else { "http" };
        let forwarded = format!("for={node};proto={proto}").into();
        ClientInfo {
            addr,
            tls,
            timer: crate::timer::Spare::default(),
            ip,
            forwarded,
        }
    }
}

/// This hop's `Forwarded` element (RFC 7239 section 4): the client's address, the scheme it
/// used, and the host it asked for when that is known and printable. Its capacity is its
/// length, so it becomes a header value without a copy ([`owned_value`]).
fn forwarded_element(client: &ClientInfo, host: Option<&HeaderValue>) -> String {
    let host = host.and_then(|h| h.to_str().ok());
    let len = host.map_or(0, |h| ";host=".len() + token_or_quoted_len(h));
    let mut element = String::with_capacity(client.forwarded.len() + len);
    element.push_str(&client.forwarded);
    if let Some(host) = host {
        element.push_str(";host=");
        push_token_or_quoted(&mut element, host);
    }
    element
}

/// `!#$%&'*+-.^_`|~`, the token characters besides letters and digits (RFC 9110 section
/// 5.6.2), a bit each.
const TCHAR_PUNCTUATION: u128 = {
    let mut bits = 0u128;
    let chars = b"!#$%&'*+-.^_`|~";
    let mut i = 0;
    while i < chars.len() {
        bits |= 1 << chars[i];
        i += 1;
    }
    bits
};

fn is_token(value: &str) -> bool {
    let tchar = |b: u8| b.is_ascii_alphanumeric() || (b < 128 && TCHAR_PUNCTUATION >> b & 1 == 1);
    !value.is_empty() && value.bytes().all(tchar)
}

/// What [`push_token_or_quoted`] writes for `value`, in bytes.
fn token_or_quoted_len(value: &str) -> usize {
    if is_token(value) {
        return value.len();
    }
    let escaped = value.bytes().filter(|&b| b == b'"' || b == b'\\').count();
    value.len() + escaped + 2
}

/// A parameter value as a token when it is one, else as a quoted-string (RFC 9110 section
/// 5.6.4, which RFC 7239 section 4 uses): a host with a port has a `:`, which is not a token
/// character.
fn push_token_or_quoted(out: &mut String, value: &str) {
    if is_token(value) {
        out.push_str(value);
        return;
    }
    out.push('"');
    for c in value.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
}

/// A header value made from `value` without copying it when its capacity is its length (a
/// `Bytes` made from a longer buffer would allocate to remember the rest).
fn owned_value(value: String) -> Option<HeaderValue> {
    HeaderValue::from_maybe_shared(Bytes::from(value.into_bytes())).ok()
}

/// Several lines of one list header as one value (RFC 9110 section 5.3), with `last` added.
fn append_to_list(headers: &HeaderMap, name: &HeaderName, last: String) -> Option<HeaderValue> {
    let mut all = String::new();
    for v in headers.get_all(name).iter().filter_map(|v| v.to_str().ok()) {
        all.push_str(v);
        all.push_str(", ");
    }
    if all.is_empty() {
        return owned_value(last);
    }
    all.push_str(&last);
    HeaderValue::from_str(&all).ok()
}

/// Whether a `TE` header asks for trailers (`TE: trailers`, maybe among codings).
fn accepts_trailers(headers: &HeaderMap) -> bool {
    headers
        .get_all(header::TE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("trailers"))
}

impl UpstreamClient {
    /// Builds the outbound request: upstream URI, clean headers, forwarding headers, and the
    /// idempotency key under `forward_key`.
    pub fn prepare(
        &self,
        mut parts: http::request::Parts,
        body: Body,
        client: &ClientInfo,
        forward_key: Option<(&HeaderName, &str)>,
    ) -> Request<Body> {
        // The host the client asked for: its `Host`, or an h2 request's `:authority`.
        let host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        // With `preserve_host` it is the authority sent on (a `Host` that is not a valid
        // authority cannot be, and the upstream's is sent instead).
        let authority = host
            .as_ref()
            .filter(|_| self.config.preserve_host)
            .and_then(|h| http::uri::Authority::try_from(h.as_bytes()).ok());
        // To the direct pool, with the upstream's own `Host`, the request is made as it will
        // be written: origin-form, `Host` replaced where it stands (what `h1::origin_form`
        // would do to an absolute-form request, without building one to take it apart).
        let direct_host = self
            .direct_pool(&parts.method)
            .filter(|_| authority.is_none())
            .and_then(|pool| pool.host_value());
        let uri = match direct_host {
            Some(_) => Uri::from(self.upstream_path(&parts.uri)),
            None => self.upstream_uri(&parts.uri, authority),
        };

        let headers = &mut parts.headers;
        let trailers = accepts_trailers(headers);
        strip_hop_by_hop(headers);
        match direct_host {
            Some(value) => {
                headers.insert(header::HOST, value.clone());
            }
            None => {
                headers.remove(header::HOST);
            }
        }
        if trailers {
            headers.insert(header::TE, HeaderValue::from_static("trailers"));
        }
        // Several X-Forwarded-For lines are one list (RFC 9110 section 5.3): keep them all.
        let xff = if headers.contains_key(&X_FORWARDED_FOR) {
            append_to_list(
                headers,
                &X_FORWARDED_FOR,
                client.ip.to_str().unwrap_or_default().to_owned(),
            )
        } else {
            Some(client.ip.clone())
        };
        if let Some(v) = xff {
            headers.insert(X_FORWARDED_FOR, v);
        }
        headers.insert(
            X_FORWARDED_PROTO,
            HeaderValue::from_static(if client.tls { "https" } else { "http" }),
        );
        // `Forwarded` is a list too: earlier proxies' elements first, this hop's last.
        if let Some(v) = append_to_list(
            headers,
            &FORWARDED,
            forwarded_element(client, host.as_ref()),
        ) {
            headers.insert(FORWARDED, v);
        }
        // A client's own `X-Forwarded-Host` never reaches the upstream: this hop's host, or
        // none when the request named none.
        match host {
            Some(host) => {
                headers.insert(X_FORWARDED_HOST, host);
            }
            None => {
                headers.remove(X_FORWARDED_HOST);
            }
        }
        if let Some((name, key)) = forward_key
            && let Ok(v) = HeaderValue::from_str(key)
        {
            headers.insert(name.clone(), v);
        }
        parts.uri = uri;
        // The client's version says nothing about the upstream's. Marked HTTP/1.1, a request
        // may go on a pooled connection of either version (for https, ALPN decides); marked
        // HTTP/2 it would be refused on an HTTP/1.1 one. h2c is HTTP/2 by configuration.
        parts.version =
            if self.config.http2 && self.config.url.scheme() == Some(&http::uri::Scheme::HTTP) {
                Version::HTTP_2
            } else {
                Version::HTTP_11
            };
        Request::from_parts(parts, body)
    }

    /// The upstream URI for a request: the upstream's scheme and authority (or `authority`),
    /// its path prefix, then the request's path and query. Without a prefix the path and
    /// query are reused as they are (no copy, no re-parse).
    fn upstream_uri(&self, incoming: &Uri, authority: Option<http::uri::Authority>) -> Uri {
        self.absolute(authority, self.upstream_path(incoming))
    }

    /// The upstream's scheme and authority (or `authority`) with `path_and_query`.
    fn absolute(
        &self,
        authority: Option<http::uri::Authority>,
        path_and_query: http::uri::PathAndQuery,
    ) -> Uri {
        let base = &self.config.url;
        let mut parts = http::uri::Parts::default();
        parts.scheme = base.scheme().cloned();
        parts.authority = authority.or_else(|| base.authority().cloned());
        parts.path_and_query = Some(path_and_query);
        Uri::from_parts(parts).unwrap_or_else(|_| base.clone())
    }

    /// The direct HTTP/1.1 pool, when a request with `method` goes through it: every request
    /// to a plain `http://` HTTP/1.1 upstream but `CONNECT` (one rule for `prepare`, which
    /// shapes the request for it, and `send_streamed`, which sends it there).
    fn direct_pool(&self, method: &http::Method) -> Option<&std::sync::Arc<h1::Pool>> {
        self.direct
            .as_ref()
            .filter(|_| method != http::Method::CONNECT)
    }

    /// The upstream's path prefix, then the request's path and query.
    fn upstream_path(&self, incoming: &Uri) -> http::uri::PathAndQuery {
        let prefix = self.config.url.path().trim_end_matches('/');
        match incoming.path_and_query() {
            // `OPTIONS *` stays in asterisk form: it asks about the server, not a path.
            Some(pq) if pq.as_str() == "*" => pq.clone(),
            Some(pq) if prefix.is_empty() => pq.clone(),
            Some(pq) => format!("{prefix}{}", pq.as_str())
                .parse()
                .unwrap_or_else(|_| pq.clone()),
            None => http::uri::PathAndQuery::from_static("/"),
        }
    }

    /// Sends a forward (plain or keyed) and waits for the response head (bounded by the upstream's
    /// `timeout`); the body streams. Over the direct HTTP/1.1 pool when the upstream has one.
    pub async fn send_streamed(
        &self,
        req: Request<Body>,
        timer: Option<&crate::timer::Spare>,
    ) -> Result<Response<Body>, UpstreamError> {
        match self.direct_pool(req.method()) {
            Some(pool) => pool.send(req, timer).await,
            None => Ok(self.send(req).await?.map(stream)),
        }
    }

    /// Sends a request and waits for the response head, bounded by the upstream's `timeout`.
    /// A request `prepare` made for the direct pool (origin-form) is put back in absolute-form,
    /// which the pooled client needs (a tunnel's request takes this way).
    pub async fn send(&self, mut req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        if req.uri().scheme().is_none()
            && let Some(pq) = req.uri().path_and_query().cloned()
        {
            *req.uri_mut() = self.absolute(None, pq);
        }
        match tokio::time::timeout(self.config.timeout, self.client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(UpstreamError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(UpstreamError::Failed(error_chain(&e))),
        }
    }
}

/// Headers only the gateway may say (docs/contract.md §8.1): an upstream's own are dropped.
const GATEWAY_ONLY: [HeaderName; 2] = [
    HeaderName::from_static("idempotent-replayed"),
    HeaderName::from_static("idempotency-status"),
];

/// Cleans an upstream response's headers for the client: hop-by-hop headers, and the
/// headers by which the gateway says a response is a replay or bypassed its store.
pub fn clean_response_headers(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    // Almost never there: looked for in one pass before any lookup.
    if headers.keys().any(|name| GATEWAY_ONLY.contains(name)) {
        for name in &GATEWAY_ONLY {
            headers.remove(name);
        }
    }
}

#[cfg(test)]
mod tests;
