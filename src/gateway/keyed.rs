//! A keyed request up to its claim, then its own task: the body read (its bytes reserved as
//! they arrive), the key, scope and fingerprint (`keying.rs`), a hot
//! replay from the cache; from the claim on, one [`KeyedRequest`] task that claims, waits
//! for a duplicate in flight, replays a stored answer, or hands the claimed request to
//! `record.rs`.
//!
//! The task is awaited by its `JoinHandle`: a client that hangs up does not cancel it, and a
//! task that panics is a 500 `internal`.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::HeaderValue;
use http::{Request, Response};
use hyper::body::Incoming;
use tokio::time::Instant;

use super::keying::{key_request, refuse_ambiguous};
use super::plain::{forward_unkeyed, proxy};
use super::record::Claimed;
use super::request::KeyedRequest;
use super::{Gateway, IDEMPOTENCY_STATUS};
use crate::access::RequestLog;
use crate::body::{RequestBody, read_body};
use crate::config::{Idempotency, InFlight, Mode, OnStoreError, OnUnknownOutcome};
use crate::forward::{Body, ClientInfo, UpstreamClient, full};
use crate::inflight::wait::wait_in_flight;
use crate::key::KeyId;
use crate::key::KeyScope;
use crate::limits::Admission;
use crate::metrics::{observed, outcome};
use crate::problem::GatewayError;
use crate::routing::Routing;
use crate::store::{Claim, ClaimRequest};

impl Gateway {
    /// A keyed request: its body read, its key found, a hot replay answered here, anything
    /// else handed to a [`KeyedRequest`] task. The rarer ways out (observe's forwards without a
    /// key, a request that has none) are boxed: this future is part of every request's
    /// future, which hyper moves into place whole.
    #[allow(clippy::too_many_arguments)] // one request's parts, named; a struct would only rename them
    pub(super) async fn keyed(
        self: &Arc<Self>,
        routing: &Arc<Routing>,
        index: usize,
        idem: &Idempotency,
        upstream: &UpstreamClient,
        req: Request<Incoming>,
        client: &ClientInfo,
        log: &mut RequestLog,
        mut admission: Admission,
    ) -> Result<Response<Body>, GatewayError> {
        let route = &routing.config.routes[index];
        let observe = idem.mode == Mode::Observe;
        let (parts, body) = req.into_parts();
        let limit = routing.config.server.body_read_timeout;
        let body = crate::timer::timeout(
            Some(&client.timer),
            limit,
            read_body(
                &parts.headers,
                body,
                idem.max_request_body,
                &mut admission.bytes,
            ),
        )
        .await
        .map_err(|_| GatewayError::BodyTimeout(limit))?
        .inspect_err(|e| {
            if let GatewayError::Overloaded(bound) = e {
                self.metrics.refused(&upstream.config.name, bound);
            }
        })?;
        let too_large = GatewayError::BodyTooLarge {
            limit: idem.max_request_body,
        };
        let body = match body {
            RequestBody::Whole(body) => body,
            RequestBody::TooLarge(rest) if observe => {
                self.forward_slot(upstream, &mut admission)?;
                return Box::pin(forward_unkeyed(
                    route, upstream, parts, rest, client, log, admission, too_large,
                ))
                .await;
            }
            RequestBody::TooLarge(_) => return Err(too_large),
        };
        admission.bytes.resize(body.len());
        log.bytes_in = Some(body.len() as u64);
        let keyed = key_request(routing, index, idem, &parts, &body).await;
        let (KeyScope { key, scope }, fp, settled) = match keyed {
            Ok(Some(keyed)) => keyed,
            Ok(None) => {
                // No key and none required: a plain forward.
                self.forward_slot(upstream, &mut admission)?;
                let out = upstream.prepare(parts, full(body), client, None);
                let timer = Some(&client.timer);
                return Box::pin(proxy(upstream, out, log, admission, timer)).await;
            }
            Err(e) if observe => {
                self.forward_slot(upstream, &mut admission)?;
                return Box::pin(forward_unkeyed(
                    route,
                    upstream,
                    parts,
                    full(body),
                    client,
                    log,
                    admission,
                    e,
                ))
                .await;
            }
            Err(e) => return Err(e),
        };
        let id = KeyId::of(&scope, &key);
        // Hot replays skip the store (see `inflight/cache.rs` for why a hit is always a committed,
        // unexpired answer to this very request). An observe route never replays.
        let cache = if observe {
            None
        } else {
            self.inflight.trusted_cache()
        };
        if let Some((cache, _)) = cache
            && let Some(hit) = cache.get(id.as_str(), &fp)
        {
            log.key_id = Some(id);
            log.outcome = outcome::REPLAYED;
            return self.hold_answer(hit.to_replay(), admission.bytes, true, log);
        }
        if let Err(e) = refuse_ambiguous(&parts, &body, settled) {
            if observe {
                self.forward_slot(upstream, &mut admission)?;
                let body = full(body);
                return Box::pin(forward_unkeyed(
                    route, upstream, parts, body, client, log, admission, e,
                ))
                .await;
            }
            return Err(e);
        }
        log.key_id = Some(id.clone());
        // From the claim on, the work runs in its own task: a client that hangs up while the
        // claim is in the database (or while waiting for a duplicate) cannot leave a claimed
        // key without a forward; the forward still happens and its answer is stored.
        let work = KeyedRequest {
            gateway: Arc::clone(self),
            routing: Arc::clone(routing),
            index,
            client: client.clone(),
            scope,
            key,
            id,
            fp,
            cache_epoch: cache.map(|(_, epoch)| epoch),
            admission,
            trace: log.trace.clone(),
        };
        // Awaited by its handle: dropping the handle (the client hung up) does not cancel it.
        // Boxed: `tokio::spawn` moves its future whole several times and writes the task's
        // output over a slot of the future's size, and this one is 5 KB; a box is moved once.
        let ((result, outcome, upstream_took), held) =
            match tokio::spawn(Box::pin(work.run(parts, body))).await {
                Ok(done) => done,
                Err(e) => (joined(Err(e)), None),
            };
        log.outcome = outcome;
        log.upstream = upstream_took;
        match (result, held) {
            (Ok(resp), Some(bytes)) => {
                let replay = outcome == outcome::REPLAYED || outcome == outcome::COALESCED;
                self.hold_answer(resp, bytes, replay, log)
            }
            (result, _) => result,
        }
    }

    /// Counts an answer held in memory in the byte budget until it is written to the client
    /// (the reservation goes with the response body, `access::Logged`). A replay is refused
    /// past the bound (503 `overloaded`: nothing was executed for it); a first answer was,
    /// so it is always held, overdrawing the budget if it must.
    fn hold_answer(
        &self,
        resp: Response<Body>,
        mut bytes: crate::limits::Reservation,
        replay: bool,
        log: &mut RequestLog,
    ) -> Result<Response<Body>, GatewayError> {
        use hyper::body::Body as _;
        // What of it is in memory: all of a whole answer (an exact hint); of one passed on
        // past `max_stored_response`, the head read before it was known too large
        // (`Prefixed`, whose hint starts there).
        let size = resp.body().size_hint().lower();
        let size = usize::try_from(size).unwrap_or(usize::MAX);
        if replay {
            if !bytes.try_resize(size) {
                return Err(GatewayError::Overloaded("max_buffered_bytes"));
            }
        } else {
            bytes.resize(size);
        }
        log.held = Some(Admission { slot: None, bytes });
        Ok(resp)
    }
}

/// What a keyed request ended as: the answer, its outcome name, the upstream's time.
type KeyedResult = (
    Result<Response<Body>, GatewayError>,
    &'static str,
    Option<Duration>,
);

impl KeyedRequest {
    /// The request's result, and its byte reservation when its answer is held in memory (a
    /// first answer captured for the store, or a replay), for `Gateway::keyed` to hold until
    /// the answer is written.
    async fn run(
        self,
        parts: http::request::Parts,
        body: Bytes,
    ) -> (KeyedResult, Option<crate::limits::Reservation>) {
        let mut answer_bytes = None;
        let result = self.work(parts, body, &mut answer_bytes).await;
        (result, answer_bytes)
    }

    async fn work(
        self,
        parts: http::request::Parts,
        body: Bytes,
        answer_bytes: &mut Option<crate::limits::Reservation>,
    ) -> KeyedResult {
        // The snapshot, held here so that `self` can move on to the forward whole.
        let routing = Arc::clone(&self.routing);
        let (route, idem, upstream) = routing.keyed(self.index);
        let gateway = Arc::clone(&self.gateway);
        let (scope, key, id) = (&self.scope, &self.key, &self.id);
        let claim = ClaimRequest {
            scope,
            key,
            route: &route.name,
            fingerprint: &self.fp,
            lease: idem.lease,
            ttl: idem.ttl,
            hold_expired_leases: idem.on_unknown_outcome == OnUnknownOutcome::Hold,
        };
        let observe = idem.mode == Mode::Observe;
        // What an observe route forwards without claiming: the upstream sees it as enforcing
        // would have forwarded it, key header included; nothing is recorded. It takes an
        // upstream slot first, as every forward does.
        let forward_observed =
            |log_outcome: &'static str, parts, body, mut admission: Admission| {
                let slot = gateway.forward_slot(upstream, &mut admission);
                let request = upstream.prepare(
                    parts,
                    full(body),
                    &self.client,
                    Some((&idem.forward_key_header, key)),
                );
                let trace = self.trace.clone();
                // Boxed, as the other rare ways below: `tokio::spawn` moves this future whole.
                Box::pin(async move {
                    if let Err(e) = slot {
                        return (Err(e), outcome::OVERLOADED, None);
                    }
                    let mut log = RequestLog::new(log_outcome);
                    log.trace = trace;
                    let result = proxy(upstream, request, &mut log, admission, None).await;
                    (result, log_outcome, log.upstream)
                })
            };
        let mut claimed_at = Instant::now();
        let claimed = {
            let _span = self.trace.as_ref().map(|t| t.child("claim"));
            gateway.store.claim(claim).await
        };
        let first = match claimed {
            Ok(found) => found,
            Err(e) if observe => {
                tracing::warn!(route = %route.name, key = %id, error = %e, "observe: the store cannot claim; forwarded without idempotency");
                return forward_observed(outcome::BYPASSED, parts, body, self.admission).await;
            }
            Err(e) if idem.on_store_error == OnStoreError::PassThrough && e.is_unavailable() => {
                tracing::warn!(route = %route.name, error = %e, "store unavailable; forwarding without idempotency");
                let mut admission = self.admission;
                if let Err(e) = gateway.forward_slot(upstream, &mut admission) {
                    return (Err(e), outcome::OVERLOADED, None);
                }
                let out = upstream.prepare(parts, full(body), &self.client, None);
                let mut log = RequestLog::new(outcome::BYPASSED);
                log.trace = self.trace.clone();
                let result = Box::pin(proxy(upstream, out, &mut log, admission, None))
                    .await
                    .map(|mut resp| {
                        resp.headers_mut()
                            .insert(IDEMPOTENCY_STATUS, HeaderValue::from_static("bypassed"));
                        resp
                    });
                return (result, outcome::BYPASSED, log.upstream);
            }
            Err(e) => return (Err(e.into()), outcome::STORE_UNAVAILABLE, None),
        };
        if observe {
            let would = match &first {
                Claim::Acquired { .. } => None,
                Claim::Completed(..) | Claim::NotReplayable { .. } | Claim::Held => {
                    Some(observed::WOULD_REPLAY)
                }
                Claim::InFlight { .. } => Some(observed::WOULD_WAIT),
                Claim::Mismatch => Some(observed::WOULD_MISMATCH),
            };
            if let Some(would) = would {
                gateway.metrics.observed(&route.name, would);
                tracing::info!(route = %route.name, key = %id, observed = would, "observe: forwarded a request that enforcing would not have forwarded");
                return forward_observed(outcome::OBSERVED, parts, body, self.admission).await;
            }
        }
        let mut waited = false;
        let found = match first {
            Claim::InFlight { .. } if idem.in_flight == InFlight::Reject => {
                return (
                    Err(GatewayError::in_flight()),
                    outcome::IN_FLIGHT_REJECTED,
                    None,
                );
            }
            Claim::InFlight { .. } => {
                let deadline = Instant::now() + idem.wait_timeout;
                let _span = self.trace.as_ref().map(|t| t.child("wait"));
                match Box::pin(wait_in_flight(
                    gateway.store.as_ref(),
                    &gateway.inflight,
                    claim,
                    deadline,
                ))
                .await
                {
                    Ok(Some((found, at))) => {
                        claimed_at = at;
                        waited = true;
                        found
                    }
                    Ok(None) => {
                        return (
                            Err(GatewayError::in_flight()),
                            outcome::IN_FLIGHT_REJECTED,
                            None,
                        );
                    }
                    Err(e) => return (Err(e.into()), outcome::IN_FLIGHT_REJECTED, None),
                }
            }
            other => other,
        };
        match found {
            Claim::Acquired { token, took_over } => {
                if took_over {
                    gateway.metrics.lease(&route.name, "taken_over");
                    tracing::warn!(route = %route.name, key = %id, "took over an expired lease: the earlier attempt's outcome is unknown");
                }
                let request = upstream.prepare(
                    parts,
                    full(body),
                    &self.client,
                    Some((&idem.forward_key_header, key)),
                );
                let job = Claimed {
                    request: self,
                    token,
                    // Our clock started before the statement that set the lease in database
                    // time, so this is never later than the real end of the lease.
                    lease_ends: claimed_at + idem.lease,
                };
                // Counted as a running job (shutdown waits for it) until its outcome is written.
                let _guard = gateway.jobs.start();
                let mut took = None;
                let (result, bytes) = job.run(request, &mut took).await;
                *answer_bytes = Some(bytes);
                (result, outcome::FORWARDED, took)
            }
            Claim::Completed(stored, expires_in) => {
                let replay = stored.to_replay();
                // Only a body the member check lets through (`refuse_ambiguous`) enters the
                // cache: a hit skips the check.
                if let Some(epoch) = self.cache_epoch
                    && !crate::json::is_ambiguous(&body)
                {
                    gateway.inflight.cache_fill(
                        epoch,
                        id.clone(),
                        self.fp,
                        stored,
                        claimed_at + expires_in,
                    );
                }
                let name = if waited {
                    outcome::COALESCED
                } else {
                    outcome::REPLAYED
                };
                *answer_bytes = Some(self.admission.bytes);
                (Ok(replay), name, None)
            }
            Claim::Mismatch => (
                Err(GatewayError::FingerprintMismatch),
                outcome::MISMATCH,
                None,
            ),
            Claim::Held => (
                Err(GatewayError::OutcomeUnknown),
                outcome::OUTCOME_UNKNOWN,
                None,
            ),
            Claim::NotReplayable { .. } => (
                Err(GatewayError::NotReplayable),
                outcome::NOT_REPLAYABLE,
                None,
            ),
            Claim::InFlight { .. } => (
                Err(GatewayError::in_flight()),
                outcome::IN_FLIGHT_REJECTED,
                None,
            ),
        }
    }
}

/// The answer of a keyed request's task; a task that panicked or was cancelled is a bug,
/// never blamed on the store or the upstream.
fn joined(joined: Result<KeyedResult, tokio::task::JoinError>) -> KeyedResult {
    joined.unwrap_or_else(|e| {
        let why = if e.is_panic() {
            "a keyed request's task panicked"
        } else {
            "a keyed request's task was cancelled"
        };
        tracing::error!(error = %e, "{why}");
        (
            Err(GatewayError::Internal(why.to_string())),
            outcome::INTERNAL,
            None,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_panicked_task_is_a_500_internal_never_blamed_on_the_store() {
        let handle = tokio::spawn(async {
            if true {
                panic!("a bug");
            }
            (
                Ok(Response::new(full(Bytes::new()))),
                outcome::FORWARDED,
                None,
            )
        });
        let (result, name, _) = joined(handle.await);
        let err = result.expect_err("a panic is an error");
        assert_eq!(name, outcome::INTERNAL);
        let problem = err.problem();
        assert_eq!((problem.status.as_u16(), problem.slug), (500, "internal"));
    }

    #[tokio::test]
    async fn a_cancelled_task_is_a_500_internal_never_blamed_on_the_store() {
        let (_hold, wait) = tokio::sync::oneshot::channel::<()>();
        let handle = tokio::spawn(async move {
            let _ = wait.await;
            (
                Ok(Response::new(full(Bytes::new()))),
                outcome::FORWARDED,
                None,
            )
        });
        handle.abort();
        let joined_result = handle.await;
        assert!(joined_result.as_ref().is_err_and(|e| e.is_cancelled()));
        let (result, name, took) = joined(joined_result);
        let err = result.expect_err("a cancelled task is an error");
        assert_eq!(name, outcome::INTERNAL);
        assert!(took.is_none());
        assert!(err.to_string().contains("cancelled"), "{err}");
        let problem = err.problem();
        assert_eq!((problem.status.as_u16(), problem.slug), (500, "internal"));
    }
}
