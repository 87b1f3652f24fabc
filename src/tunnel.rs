//! Upgrades on plain routes: a WebSocket passes through as a tunnel; no other protocol does.
//!
//! A request asks to switch protocols with `Connection: upgrade` and `Upgrade: <protocols>`
//! (RFC 9110 section 7.8). Both are hop-by-hop, so forwarding strips them; on a request that
//! may be tunnelled they are put back on the outbound request. When the upstream answers
//! `101 Switching Protocols`, the 101 goes back to the client with its `Upgrade` and
//! `Connection: upgrade`, and the two connections, once hyper hands them over, are spliced
//! byte for byte until either side closes. Any other answer is an ordinary response.
//!
//! Which requests may be tunnelled, and why:
//! - Only plain ones: a route without `idempotency`, or a method not in its
//!   `idempotency.methods`. A keyed request's `Upgrade` is ignored, as RFC 9110 section 7.8
//!   lets a server do: it is stripped with the other hop-by-hop headers and the request is
//!   handled as keyed, without it. No key is ever claimed for a tunnel, and a stored answer
//!   is never a 101.
//! - Only from HTTP/1.1 clients: HTTP/2 has no `Upgrade` (RFC 9113 section 8.2.2).
//! - Only to upstreams spoken to in HTTP/1.1: with `http2: true` the `Upgrade` is stripped
//!   and the upstream sees a plain request.
//!
//! Bounds: a tunnel holds its request's admission (one of the upstream's `max_in_flight`
//! slots: it is a request in progress at the upstream) and its connection's slot of
//! `server.max_connections` until it closes. The upstream's `timeout` bounds the wait for
//! the 101; after it a tunnel has no timeout of its own and lasts as long as both ends keep
//! it open. Shutdown does not drain tunnels: they are cut when the process exits.

use http::header::{self, HeaderMap, HeaderValue};
use http::{Request, Version};
use hyper::upgrade::OnUpgrade;
use hyper_util::rt::TokioIo;
use tokio::time::Instant;

use crate::config::UpstreamConfig;
use crate::forward::{Body, clean_response_headers};

/// The protocols a request asks to switch to, when it may be tunnelled to `upstream`.
pub fn requested<B>(req: &Request<B>, upstream: &UpstreamConfig) -> Option<HeaderValue> {
    if req.version() != Version::HTTP_11 || upstream.http2 {
        return None;
    }
    let protocols = req.headers().get(header::UPGRADE)?;
    // WebSocket only: any other protocol (`h2c` above all, an unrouted channel of requests
    // the gateway would never see) is dropped with the other hop-by-hop headers.
    let websocket = protocols.to_str().is_ok_and(|v| {
        v.split(',').all(|p| {
            let name = p.trim().split('/').next().unwrap_or("");
            name.eq_ignore_ascii_case("websocket")
        })
    });
    if !websocket {
        return None;
    }
    let asks = req
        .headers()
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|t| t.trim().eq_ignore_ascii_case("upgrade"));
    asks.then(|| protocols.clone())
}

/// Puts the upgrade back on an outbound request whose hop-by-hop headers were stripped.
pub fn ask(req: &mut Request<Body>, protocols: HeaderValue) {
    let headers = req.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    headers.insert(header::UPGRADE, protocols);
}

/// A 101's headers for the client: cleaned as any response's, the switch itself kept.
pub fn switching_headers(headers: &mut HeaderMap) {
    let protocol = headers.get(header::UPGRADE).cloned();
    clean_response_headers(headers);
    if let Some(protocol) = protocol {
        headers.insert(header::UPGRADE, protocol);
    }
    headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
}

/// Splices the client's and the upstream's connections, once both are handed over, until
/// either side closes, in a task of its own. `hold` (the admission and the connection's
/// slot) is released when the tunnel ends.
pub fn splice<H: Send + 'static>(client: OnUpgrade, upstream: OnUpgrade, route: String, hold: H) {
    tokio::spawn(async move {
        let _hold = hold;
        let started = Instant::now();
        let (client, upstream) = match tokio::try_join!(client, upstream) {
            Ok(both) => both,
            Err(e) => {
                tracing::debug!(route, error = %e, "an upgrade was not completed");
                return;
            }
        };
        let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
        let copied = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
        let elapsed_ms = started.elapsed().as_secs_f64() * 1000.0;
        match copied {
            Ok((to_upstream, to_client)) => {
                tracing::debug!(route, to_upstream, to_client, elapsed_ms, "tunnel closed");
            }
            Err(e) => tracing::debug!(route, elapsed_ms, error = %e, "tunnel cut"),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(http2: bool) -> UpstreamConfig {
        UpstreamConfig {
            name: "app".into(),
            url: "http://127.0.0.1:9000".parse().unwrap(),
            connect_timeout: std::time::Duration::from_secs(1),
            timeout: std::time::Duration::from_secs(5),
            max_in_flight: 1,
            idle_timeout: std::time::Duration::from_millis(800),
            tls_ca: None,
            http2,
            preserve_host: false,
        }
    }

    fn request(version: Version, connection: &str) -> Request<()> {
        Request::builder()
            .version(version)
            .header("connection", connection)
            .header("upgrade", "websocket")
            .body(())
            .unwrap()
    }

    #[test]
    fn only_an_http1_request_naming_upgrade_in_connection_to_an_http1_upstream_asks() {
        let up = upstream(false);
        let asked = requested(&request(Version::HTTP_11, "keep-alive, Upgrade"), &up);
        assert_eq!(asked.unwrap(), "websocket");
        assert!(requested(&request(Version::HTTP_11, "keep-alive"), &up).is_none());
        assert!(requested(&request(Version::HTTP_10, "upgrade"), &up).is_none());
        assert!(requested(&request(Version::HTTP_11, "upgrade"), &upstream(true)).is_none());
    }

    #[test]
    fn only_websocket_is_tunnelled() {
        let up = upstream(false);
        for protocols in ["h2c", "websocket, h2c", "TLS/1.0", ""] {
            let req = Request::builder()
                .header("connection", "upgrade")
                .header("upgrade", protocols)
                .body(())
                .unwrap();
            assert!(requested(&req, &up).is_none(), "{protocols:?}");
        }
        let req = Request::builder()
            .header("connection", "upgrade")
            .header("upgrade", "WebSocket")
            .body(())
            .unwrap();
        assert!(requested(&req, &up).is_some());
    }

    #[test]
    fn a_101_keeps_its_switch_and_loses_other_hop_by_hop_headers() {
        let mut h = HeaderMap::new();
        h.insert("connection", "Upgrade, x-hop".parse().unwrap());
        h.insert("x-hop", "1".parse().unwrap());
        h.insert("upgrade", "websocket".parse().unwrap());
        h.insert("sec-websocket-accept", "abc".parse().unwrap());
        switching_headers(&mut h);
        assert_eq!(h["upgrade"], "websocket");
        assert_eq!(h["connection"], "upgrade");
        assert_eq!(h["sec-websocket-accept"], "abc");
        assert!(!h.contains_key("x-hop"));
    }
}
