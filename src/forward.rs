//! The upstream side: one pooled keep-alive client per upstream, header hygiene, timeouts.
//!
//! Outbound requests lose their hop-by-hop headers (RFC 9110 section 7.6.1: the fixed list
//! and every header named in `Connection`) and their `Host` (the client sets the upstream's
//! authority), and gain `X-Forwarded-For/-Proto/-Host`. Responses lose their hop-by-hop
//! headers on the way back. Failures are classified by what they mean for the key:
//! [`UpstreamError::Connect`] means the request never left (safe to release),
//! [`UpstreamError::Timeout`] and [`UpstreamError::Failed`] mean it may have been processed.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri, Version};
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;

use crate::config::UpstreamConfig;

/// Boxed error for bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type used on both sides of the proxy.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body from bytes.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    http_body_util::Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A streamed body from a hyper body.
pub fn stream(body: Incoming) -> Body {
    body.map_err(|e| Box::new(e) as BoxError).boxed_unsync()
}

/// The hop-by-hop headers of RFC 9110 section 7.6.1 (plus the legacy `proxy-connection`).
/// Pre-parsed, so stripping them costs no header-name parsing per request.
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

const X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
const X_FORWARDED_PROTO: HeaderName = HeaderName::from_static("x-forwarded-proto");
const X_FORWARDED_HOST: HeaderName = HeaderName::from_static("x-forwarded-host");

pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

/// Removes hop-by-hop headers, including every header named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    if headers.contains_key(header::CONNECTION) {
        let named: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|t| HeaderName::from_bytes(t.trim().as_bytes()).ok())
            .collect();
        for name in named {
            headers.remove(name);
        }
    }
    for name in &HOP_BY_HOP {
        headers.remove(name);
    }
}

/// Why a forward failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The request never reached the upstream (refused, DNS, connect timeout).
    #[error("connect: {0}")]
    Connect(String),
    /// No complete answer within the upstream's `timeout`; it may have been processed.
    #[error("timed out")]
    Timeout,
    /// The connection failed after the request was sent; it may have been processed.
    #[error("failed: {0}")]
    Failed(String),
}

/// One client per upstream, sharing nothing but the executor.
pub struct Upstreams {
    clients: HashMap<String, UpstreamClient>,
}

pub struct UpstreamClient {
    pub config: UpstreamConfig,
    client: Client<HttpsConnector<HttpConnector>, Body>,
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
                let connector = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_or_http()
                    .enable_http1()
                    .wrap_connector(connector);
                let client = Client::builder(TokioExecutor::new())
                    .pool_idle_timeout(Duration::from_secs(60))
                    .build(connector);
                (
                    cfg.name.clone(),
                    UpstreamClient {
                        config: cfg.clone(),
                        client,
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

/// What the gateway knows about the client side of a request (one per connection).
#[derive(Debug, Clone)]
pub struct ClientInfo {
    pub addr: SocketAddr,
    pub tls: bool,
    /// The client's IP as a header value, made once per connection, not per request.
    ip: HeaderValue,
}

impl ClientInfo {
    pub fn new(addr: SocketAddr, tls: bool) -> ClientInfo {
        let ip = HeaderValue::from_str(&addr.ip().to_string())
            .expect("an IP address is a valid header value");
        ClientInfo { addr, tls, ip }
    }
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
        let uri = self.upstream_uri(&parts.uri);

        let host = parts.headers.get(header::HOST).cloned().or_else(|| {
            parts
                .uri
                .authority()
                .and_then(|a| HeaderValue::from_str(a.as_str()).ok())
        });
        let headers = &mut parts.headers;
        strip_hop_by_hop(headers);
        headers.remove(header::HOST);
        // Several X-Forwarded-For lines are one list (RFC 9110 section 5.3): keep them all.
        let xff = if headers.contains_key(&X_FORWARDED_FOR) {
            let mut all: Vec<&str> = headers
                .get_all(&X_FORWARDED_FOR)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .collect();
            all.push(client.ip.to_str().unwrap_or_default());
            HeaderValue::from_str(&all.join(", ")).ok()
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
        if let Some(host) = host {
            headers.insert(X_FORWARDED_HOST, host);
        }
        if let Some((name, key)) = forward_key
            && let Ok(v) = HeaderValue::from_str(key)
        {
            headers.insert(name.clone(), v);
        }
        parts.uri = uri;
        parts.version = Version::HTTP_11;
        Request::from_parts(parts, body)
    }

    /// The upstream URI for a request: the upstream's scheme and authority, its path prefix,
    /// then the request's path and query. Without a prefix the path and query are reused as
    /// they are (no copy, no re-parse).
    fn upstream_uri(&self, incoming: &Uri) -> Uri {
        let base = &self.config.url;
        let prefix = base.path().trim_end_matches('/');
        let path_and_query = match incoming.path_and_query() {
            Some(pq) if prefix.is_empty() => pq.clone(),
            Some(pq) => format!("{prefix}{}", pq.as_str())
                .parse()
                .unwrap_or_else(|_| pq.clone()),
            None => http::uri::PathAndQuery::from_static("/"),
        };
        let mut parts = http::uri::Parts::default();
        parts.scheme = base.scheme().cloned();
        parts.authority = base.authority().cloned();
        parts.path_and_query = Some(path_and_query);
        Uri::from_parts(parts).unwrap_or_else(|_| base.clone())
    }

    /// Sends a request and waits for the response head, bounded by the upstream's `timeout`.
    pub async fn send(&self, req: Request<Body>) -> Result<Response<Incoming>, UpstreamError> {
        match tokio::time::timeout(self.config.timeout, self.client.request(req)).await {
            Err(_) => Err(UpstreamError::Timeout),
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) if e.is_connect() => Err(UpstreamError::Connect(error_chain(&e))),
            Ok(Err(e)) => Err(UpstreamError::Failed(error_chain(&e))),
        }
    }
}

/// Headers only the gateway may say (SPEC 8.1): an upstream's own are dropped.
const GATEWAY_ONLY: [HeaderName; 2] = [
    HeaderName::from_static("idempotent-replayed"),
    HeaderName::from_static("idempotency-status"),
];

/// Cleans an upstream response's headers for the client: hop-by-hop headers, and the
/// headers by which the gateway says a response is a replay or bypassed its store.
pub fn clean_response_headers(headers: &mut HeaderMap) {
    strip_hop_by_hop(headers);
    for name in &GATEWAY_ONLY {
        headers.remove(name);
    }
}

/// An error and its causes on one line, for logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connection_named_headers_are_stripped() {
        let mut h = HeaderMap::new();
        h.insert("connection", "close, x-secret".parse().unwrap());
        h.insert("x-secret", "1".parse().unwrap());
        h.insert("keep-alive", "timeout=5".parse().unwrap());
        h.insert("te", "trailers".parse().unwrap());
        h.insert("content-type", "text/plain".parse().unwrap());
        strip_hop_by_hop(&mut h);
        assert_eq!(h.len(), 1);
        assert!(h.contains_key("content-type"));
    }
}
