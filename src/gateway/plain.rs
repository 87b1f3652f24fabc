//! Forwards without a key: the request and the answer stream through, bounded by the
//! timeout on the answer's head; a 101 opens a tunnel. Also an observe route's requests that
//! enforcing would refuse before any claim.

use bytes::Bytes;
use http::{Request, Response};
use tokio::time::Instant;

use crate::access::RequestLog;
use crate::config::Route;
use crate::forward::{Body, ClientInfo, UpstreamClient, clean_response_headers, full, stream};
use crate::limits::Admission;
use crate::metrics::outcome;
use crate::problem::GatewayError;

/// A plain forward: the response streams back, bounded by the timeout on its head. The
/// admission is held by the response body until it has been passed on (or dropped).
pub(super) async fn proxy(
    upstream: &UpstreamClient,
    mut req: Request<Body>,
    log: &mut RequestLog,
    admission: Admission,
    timer: Option<&crate::timer::Spare>,
) -> Result<Response<Body>, GatewayError> {
    let _span = log.trace.as_ref().map(|t| t.forward(req.headers_mut()));
    let started = Instant::now();
    let sent = upstream.send_streamed(req, timer).await;
    log.upstream = Some(started.elapsed());
    Ok(passed_on(sent.map_err(GatewayError::from)?, admission, log))
}

/// A plain forward that asked to switch protocols: a 101 from the upstream opens a tunnel
/// that keeps `hold` (the admission and the connection's slot) until it closes; any other
/// answer is passed on as by [`proxy`].
pub(super) async fn tunnel(
    upstream: &UpstreamClient,
    mut req: Request<Body>,
    log: &mut RequestLog,
    hold: (Admission, Option<crate::limits::ConnectionSlot>),
    on_client: hyper::upgrade::OnUpgrade,
    route: &str,
) -> Result<Response<Body>, GatewayError> {
    let _span = log.trace.as_ref().map(|t| t.forward(req.headers_mut()));
    let started = Instant::now();
    let sent = upstream.send(req).await;
    log.upstream = Some(started.elapsed());
    let mut resp = sent.map_err(GatewayError::from)?;
    if resp.status() != http::StatusCode::SWITCHING_PROTOCOLS {
        return Ok(passed_on(resp.map(stream), hold.0, log));
    }
    let on_upstream = hyper::upgrade::on(&mut resp);
    let (mut parts, _empty) = resp.into_parts();
    crate::tunnel::switching_headers(&mut parts.headers);
    crate::tunnel::splice(on_client, on_upstream, route.to_string(), hold);
    log.outcome = outcome::TUNNELED;
    Ok(Response::from_parts(parts, full(Bytes::new())))
}

/// An upstream's answer streamed back to the client, its headers cleaned; the admission is
/// held by the response body (`access::Logged`, through `log`) until it has been passed on (or
/// dropped). Trailers pass too.
fn passed_on(resp: Response<Body>, admission: Admission, log: &mut RequestLog) -> Response<Body> {
    let (mut parts, body) = resp.into_parts();
    clean_response_headers(&mut parts.headers);
    log.held = Some(admission);
    Response::from_parts(parts, body)
}

/// On an observe route, a request that enforcing would refuse before any claim (`why`: it
/// cannot be keyed, or its body is over `max_request_body`): forwarded without idempotency
/// and counted under the outcome enforcing would have had (an upstream failure counts as
/// itself).
#[allow(clippy::too_many_arguments)] // one request's parts, named
pub(super) async fn forward_unkeyed(
    route: &Route,
    upstream: &UpstreamClient,
    parts: http::request::Parts,
    body: Body,
    client: &ClientInfo,
    log: &mut RequestLog,
    admission: Admission,
    why: GatewayError,
) -> Result<Response<Body>, GatewayError> {
    tracing::info!(route = %route.name, would = why.outcome(), reason = %why, "observe: enforcing would refuse this request; forwarded without idempotency");
    let out = upstream.prepare(parts, body, client, None);
    let resp = proxy(upstream, out, log, admission, Some(&client.timer)).await?;
    log.outcome = why.outcome();
    Ok(resp)
}
