//! A client connection's requests: the request line checked, the path normalized and the
//! route found once (by index in the connection's routing snapshot), then the plain or the
//! keyed way; whatever happens, one problem response for an error, one access line and the
//! route's counters.

use std::sync::Arc;

use http::header::{self, HeaderValue};
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use tokio::time::Instant;

use super::Gateway;
use super::plain::{proxy, tunnel};
use crate::access::RequestLog;
use crate::forward::{Body, ClientInfo, stream};
use crate::metrics::outcome;
use crate::problem::GatewayError;
use crate::routing::Routing;

/// What the requests of one client connection share (`server.rs` makes one per
/// connection): the gateway, the client, the connection's slot of `max_connections`, and
/// the routing snapshot its last request used.
///
/// Per request this touches only the connection's own memory, which stays with the task that
/// serves the connection: the runtime's workers do not pass the gateway's reference count,
/// nor the routing lock and count, from core to core at every request. A reload is seen by
/// the next request: the snapshot is taken again when [`Gateway`]'s reload count changed.
pub struct Connection {
    gateway: Arc<Gateway>,
    client: ClientInfo,
    slot: Option<crate::limits::ConnectionSlot>,
    /// The reload count it was taken at, and the snapshot.
    routing: std::sync::Mutex<(u64, Arc<ConnectionRouting>)>,
}

/// A connection's own reference to a routing snapshot: its requests clone this `Arc`, whose
/// count only the connection's task writes, instead of the snapshot's, which every worker
/// shares.
struct ConnectionRouting(Arc<Routing>);

impl Connection {
    pub fn new(
        gateway: Arc<Gateway>,
        client: ClientInfo,
        slot: Option<crate::limits::ConnectionSlot>,
    ) -> Connection {
        let routing = std::sync::Mutex::new(ConnectionRouting::taken(&gateway));
        gateway.metrics.client_connections.inc();
        Connection {
            gateway,
            client,
            slot,
            routing,
        }
    }

    /// The routing snapshot in force now.
    fn routing(&self) -> Arc<ConnectionRouting> {
        let generation = self
            .gateway
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        let mut cached = self.routing.lock().unwrap_or_else(|e| e.into_inner());
        if cached.0 != generation {
            *cached = ConnectionRouting::taken(&self.gateway);
        }
        Arc::clone(&cached.1)
    }

    /// Serves one request on this connection; never fails.
    pub async fn handle(self: Arc<Self>, req: Request<Incoming>) -> Response<Body> {
        let routing = self.routing();
        self.gateway
            .handle(&routing.0, req, &self.client, self.slot.clone())
            .await
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.gateway.metrics.client_connections.dec();
    }
}

impl ConnectionRouting {
    /// `gateway`'s snapshot now, with the reload count read before it: a count seen new is
    /// never paired with an older snapshot.
    fn taken(gateway: &Gateway) -> (u64, Arc<ConnectionRouting>) {
        let generation = gateway
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        (generation, Arc::new(ConnectionRouting(gateway.routing())))
    }
}

impl Gateway {
    /// Serves one request of `client`'s connection with the routing snapshot `routing`;
    /// never fails. `connection` is the connection's slot of `max_connections`: only a tunnel
    /// keeps it past the response.
    pub(super) async fn handle(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        mut req: Request<Incoming>,
        client: &ClientInfo,
        connection: Option<crate::limits::ConnectionSlot>,
    ) -> Response<Body> {
        let started = Instant::now();
        // The request id travels to the upstream with the request's headers.
        let request_id = crate::access::request_id(req.headers());
        req.headers_mut()
            .insert(crate::access::X_REQUEST_ID, request_id.clone());
        let declared_in = req
            .headers()
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
            .or_else(|| hyper::body::Body::is_end_stream(req.body()).then_some(0));
        let (method, uri, version) = (req.method().clone(), req.uri().clone(), req.version());
        let mut log = RequestLog::new(outcome::PROXIED);
        if let Some(telemetry) = &self.telemetry {
            log.trace = Some(telemetry.server_span(req.method(), req.headers()));
        }
        let (mut resp, error) = match self
            .route_request(routing, req, client, connection, &mut log)
            .await
        {
            Ok(resp) => (resp, None),
            Err(err) => {
                log.outcome = err.outcome();
                let close = err.closes_connection();
                let mut resp = err
                    .problem()
                    .with_request_id(request_id.to_str().unwrap_or_default())
                    .into_response();
                if close {
                    resp.headers_mut()
                        .insert(header::CONNECTION, HeaderValue::from_static("close"));
                }
                (resp, Some(err))
            }
        };
        // While draining, an HTTP/1 client is told to reconnect (through its load balancer,
        // which no longer sends here) instead of reusing this connection. h2 gets GOAWAY when
        // the listener stops accepting.
        if self.readiness.draining() && version < http::Version::HTTP_2 {
            resp.headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        // No route matched: counted under `route=""`.
        let handles = log
            .route
            .unwrap_or_else(|| Arc::clone(self.metrics.unrouted()));
        let counted = handles.request(log.outcome, resp.status().as_u16());
        if let Some(took) = log.upstream {
            handles.upstream(took);
            if let Some(index) = log.index {
                routing.upstream_durations[index].observe(took.as_secs_f64());
            }
        }
        resp.headers_mut()
            .insert(crate::access::X_REQUEST_ID, request_id.clone());
        let line = crate::access::AccessLine {
            method,
            uri,
            version,
            client_ip: client.addr.ip(),
            request_id,
            started,
            route: handles,
            counted,
            outcome: log.outcome,
            status: resp.status().as_u16(),
            key_id: log.key_id.map(String::from),
            upstream: log.upstream,
            bytes_in: log.bytes_in.or(declared_in),
            error: error.map(|e| e.to_string()),
            trace: log.trace.take(),
        };
        let (parts, body) = resp.into_parts();
        let body = crate::access::Logged::new(body, line, log.counted_in, log.held);
        Response::from_parts(parts, body.boxed_unsync())
    }

    async fn route_request(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        mut req: Request<Incoming>,
        client: &ClientInfo,
        connection: Option<crate::limits::ConnectionSlot>,
        log: &mut RequestLog,
    ) -> Result<Response<Body>, GatewayError> {
        check_request_line(&req)?;
        let raw = req.uri().path();
        // `OPTIONS *` is routed as the root and forwarded in asterisk form.
        let asterisk = raw == "*";
        let normal = if asterisk {
            std::borrow::Cow::Borrowed("/")
        } else {
            crate::path::normalize(raw).map_err(|_| GatewayError::PathInvalid)?
        };
        let index = routing.route_index(req.method(), &normal)?;
        let route = &routing.config.routes[index];
        let canonical = route.path.canonical(&normal);
        if canonical != raw && !asterisk {
            let uri = with_path(req.uri(), canonical);
            *req.uri_mut() = uri;
        }
        log.route = Some(Arc::clone(&routing.metrics[index]));
        log.index = Some(index);
        let upstream = routing.upstream_of(route);
        match &route.idempotency {
            Some(idem) if idem.methods.contains(req.method()) => {
                // The body is buffered: its bytes are reserved as they arrive.
                let admission = self.admit(upstream, true)?;
                self.keyed(routing, index, idem, upstream, req, client, log, admission)
                    .await
            }
            _ => {
                let admission = self.admit(upstream, false)?;
                let upgrade = crate::tunnel::requested(&req, &upstream.config)
                    .map(|protocols| (protocols, hyper::upgrade::on(&mut req)));
                let (parts, body) = req.into_parts();
                let body = if parts.headers.contains_key(header::CONTENT_LENGTH) {
                    stream(body)
                } else {
                    // Counted for the access line (its length was not declared).
                    let count = Arc::new(std::sync::atomic::AtomicU64::new(0));
                    log.counted_in = Some(Arc::clone(&count));
                    crate::access::Counted { body, count }
                        .map_err(|e| Box::new(e) as crate::forward::BoxError)
                        .boxed_unsync()
                };
                let mut out = upstream.prepare(parts, body, client, None);
                match upgrade {
                    None => proxy(upstream, out, log, admission, Some(&client.timer)).await,
                    Some((protocols, on_client)) => {
                        crate::tunnel::ask(&mut out, protocols);
                        let hold = (admission, connection);
                        Box::pin(tunnel(upstream, out, log, hold, on_client, &route.name)).await
                    }
                }
            }
        }
    }
}

/// What is refused before a request is routed: a method `routing::check_method` refuses,
/// and an HTTP/1.1 request without `Host` (RFC 9112 section 3.2).
fn check_request_line<B>(req: &Request<B>) -> Result<(), GatewayError> {
    crate::routing::check_method(req.method())?;
    if req.version() == http::Version::HTTP_11 && !req.headers().contains_key(header::HOST) {
        return Err(GatewayError::HostMissing);
    }
    Ok(())
}

/// `uri` with another path, its query kept.
fn with_path(uri: &http::Uri, path: &str) -> http::Uri {
    let pq = match uri.query() {
        Some(q) => format!("{path}?{q}"),
        None => path.to_string(),
    };
    let mut parts = uri.clone().into_parts();
    parts.path_and_query = pq.parse().ok().or(parts.path_and_query);
    http::Uri::from_parts(parts).unwrap_or_else(|_| uri.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn another_spelling_of_the_path_keeps_the_query() {
        let uri: http::Uri = "/a//b?x=1&y=%2F".parse().unwrap();
        assert_eq!(with_path(&uri, "/a/b").to_string(), "/a/b?x=1&y=%2F");
        let bare: http::Uri = "/a/./b".parse().unwrap();
        assert_eq!(with_path(&bare, "/a/b").to_string(), "/a/b");
    }
}
