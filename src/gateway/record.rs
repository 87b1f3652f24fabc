//! Forward, record, retry: a claimed keyed request from its forward to its recorded outcome
//! (docs/contract.md §2.5-§2.7), inside the request's own task.
//!
//! Invariants:
//! - The outcome is written fenced by the lease token; a write that finds the lease taken
//!   over changes nothing, is counted (`lost`) and logged, and the client still gets what
//!   the upstream said.
//! - A storable answer is committed before it is returned (guarantee 3); the completion is
//!   retried while the lease surely lasts, and never started past it.
//! - Nothing sent (a connect or DNS failure): the key is released, whatever the route's
//!   `on_unknown_outcome`. Something sent and no answer: released (`reforward`) or held
//!   (`hold`).

use std::sync::Arc;
use std::time::Duration;

use http::{Request, Response};
use http_body_util::BodyExt;
use tokio::time::Instant;

use crate::body::{Captured, Prefixed, read_capped};
use crate::config::{Idempotency, Mode, OnUnknownOutcome};
use crate::forward::{Body, UpstreamError, clean_response_headers, full};
use crate::limits::Reservation;
use crate::problem::GatewayError;
use crate::replay::StoredResponse;
use crate::store::{LeaseToken, Outcome, StoreError};

use super::request::KeyedRequest;

/// A claimed request on its way to the upstream, detached from the client connection: the
/// keyed request and the lease it holds.
pub(super) struct Claimed {
    pub(super) request: KeyedRequest,
    pub(super) token: LeaseToken,
    /// Local time by which the lease has surely ended; no write is attempted after it.
    pub(super) lease_ends: Instant,
}

/// How many times a completion is attempted before the client is told it failed.
const FINISH_ATTEMPTS: u32 = 3;

impl Claimed {
    /// Waits for a `serialize` slot if the route has one, takes an upstream slot
    /// (`max_in_flight`; none left: the key is released and the answer is 503 `overloaded`),
    /// forwards, records, frees the slots. Runs inside the keyed request's own task, so a
    /// client that goes away does not stop it. Also sets how long the upstream took, when it
    /// was called. Gives back the request's byte reservation, which then counts the answer
    /// (the caller holds it until the answer is written); the upstream slot ends here.
    pub(super) async fn run(
        mut self,
        request: Request<Body>,
        took: &mut Option<Duration>,
    ) -> (Result<Response<Body>, GatewayError>, Reservation) {
        let result = self.serialized(request, took).await;
        (result, self.request.admission.bytes)
    }

    async fn serialized(
        &mut self,
        request: Request<Body>,
        took: &mut Option<Duration>,
    ) -> Result<Response<Body>, GatewayError> {
        let routing = Arc::clone(&self.request.routing);
        let (_, idem, upstream) = routing.keyed(self.request.index);
        let gateway = Arc::clone(&self.request.gateway);
        let store = gateway.store.as_ref();
        let held = match idem.serialize {
            // Serializing is enforcement: an observe route forwards at once.
            None => None,
            Some(_) if idem.mode == Mode::Observe => None,
            Some(ser) => {
                // The forward and its recording must fit in what is left of the lease.
                let last_start = self.lease_ends
                    - upstream.config.timeout
                    - self.request.routing.config.store.record_bound() * 2;
                let got = gateway
                    .serializer
                    .acquire(
                        store,
                        &gateway.inflight,
                        &self.request.scope,
                        ser,
                        idem.lease,
                        last_start,
                    )
                    .await;
                match got {
                    Ok(Some(held)) => Some(held),
                    Ok(None) | Err(_) => {
                        // Nothing was forwarded: give the key back so a retry can go through.
                        if let Err(e) = self.finish(Outcome::Release, idem.ttl).await {
                            tracing::warn!(route = %self.request.route().name, error = %e, "could not release a key after waiting for a slot; it frees itself when its lease ends");
                        }
                        return Err(match got {
                            Err(e) => GatewayError::from(e),
                            _ => GatewayError::in_flight(),
                        });
                    }
                }
            }
        };
        // A forward that could outlive the lease is not started: past the lease, another
        // attempt may own the key. Only a process paused or starved since its claim (or its
        // wait for a slot) gets here; the lease was checked at load to outlast the upstream's
        // timeout and the record.
        if Instant::now() + upstream.config.timeout >= self.lease_ends {
            if let Err(e) = self.finish(Outcome::Release, idem.ttl).await {
                tracing::warn!(route = %self.request.route().name, error = %e, "could not release a key whose lease was too short to forward; it frees itself when its lease ends");
            }
            tracing::warn!(route = %self.request.route().name, key = %self.request.id, "not forwarded: too little of the lease was left (the process was paused or starved since its claim); released");
            if let Some(held) = held {
                held.release(store).await;
            }
            return Err(GatewayError::in_flight());
        }
        let slot = self.request.admission.take_slot(
            &upstream.limit,
            &upstream.config.name,
            &gateway.metrics,
        );
        let result = match slot {
            Ok(()) => self.forward(request, took).await,
            Err(bound) => {
                // Nothing was forwarded: give the key back so a retry can go through.
                if let Err(e) = self.finish(Outcome::Release, idem.ttl).await {
                    tracing::warn!(route = %self.request.route().name, error = %e, "could not release a key refused an upstream slot; it frees itself when its lease ends");
                }
                Err(GatewayError::Overloaded(bound))
            }
        };
        if let Some(held) = held {
            held.release(store).await;
        }
        result
    }

    /// Forwards once and records the outcome.
    async fn forward(
        &mut self,
        mut request: Request<Body>,
        took: &mut Option<Duration>,
    ) -> Result<Response<Body>, GatewayError> {
        let routing = Arc::clone(&self.request.routing);
        let (_, idem, upstream) = routing.keyed(self.request.index);
        let started = Instant::now();
        let limit = idem.max_stored_response;
        let held = &mut self.request.admission.bytes;
        let span = self
            .request
            .trace
            .as_ref()
            .map(|t| t.forward(request.headers_mut()));
        let exchange = async {
            let resp = upstream.send_streamed(request, None).await?;
            let (parts, body) = resp.into_parts();
            if idem.retry_statuses.contains(parts.status.as_u16()) {
                return Ok((parts, Captured::PassOn(body)));
            }
            let captured = read_capped(body, limit, held).await?;
            Ok::<_, UpstreamError>((parts, captured))
        };
        let result = match tokio::time::timeout(upstream.config.timeout, exchange).await {
            Ok(r) => r,
            Err(_) => Err(UpstreamError::Timeout),
        };
        *took = Some(started.elapsed());
        drop(span);
        match result {
            Err(UpstreamError::Connect(e)) => {
                self.finish(Outcome::Release, idem.ttl).await.ok();
                Err(GatewayError::UpstreamUnavailable(e))
            }
            Err(e) => {
                let outcome = match idem.on_unknown_outcome {
                    OnUnknownOutcome::Reforward => {
                        tracing::warn!(route = %self.request.route().name, key = %self.request.id, error = %e, "outcome unknown: released, a retry forwards again");
                        Outcome::Release
                    }
                    OnUnknownOutcome::Hold => {
                        tracing::warn!(route = %self.request.route().name, key = %self.request.id, error = %e, "outcome unknown: held until an operator decides");
                        Outcome::Unknown
                    }
                };
                if let Err(se) = self.finish(outcome, idem.ttl).await {
                    tracing::warn!(route = %self.request.route().name, error = %se, "could not record an unknown outcome; the key stays in flight until its lease ends");
                }
                Err(e.into())
            }
            Ok((mut parts, Captured::PassOn(body))) => {
                // A retryable status: release, so a retry forwards again, then pass it on.
                if let Err(e) = self.finish(Outcome::Release, idem.ttl).await {
                    tracing::warn!(route = %self.request.route().name, error = %e, "could not release after a retryable status; the key stays in flight until its lease ends");
                }
                clean_response_headers(&mut parts.headers);
                Ok(Response::from_parts(parts, body))
            }
            Ok((mut parts, Captured::Whole(bytes))) => {
                clean_response_headers(&mut parts.headers);
                let stored = StoredResponse::capture(
                    parts.status,
                    &parts.headers,
                    &idem.replay_headers,
                    bytes.clone(),
                );
                self.settle(Outcome::Completed(stored), idem).await?;
                tracing::debug!(route = %self.request.route().name, status = parts.status.as_u16(), elapsed_ms = started.elapsed().as_millis() as u64, "stored");
                Ok(Response::from_parts(parts, full(bytes)))
            }
            Ok((mut parts, Captured::TooLarge { head, rest })) => {
                self.settle(
                    Outcome::NotReplayable {
                        status: parts.status.as_u16(),
                    },
                    idem,
                )
                .await?;
                clean_response_headers(&mut parts.headers);
                let body = Prefixed {
                    head: Some(head),
                    rest,
                };
                Ok(Response::from_parts(parts, body.boxed_unsync()))
            }
        }
    }

    /// Records a final outcome before its answer is passed on. Enforcing, the answer depends
    /// on it ([`record`](Self::record)); an observe route tries once and passes the answer on
    /// whatever happens, since store trouble never blocks it (a key not recorded stays in
    /// flight until its lease ends, so its duplicates count as `would_wait` meanwhile).
    async fn settle(&self, outcome: Outcome, idem: &Idempotency) -> Result<(), GatewayError> {
        if idem.mode == Mode::Enforce {
            return self.record(outcome, idem.ttl).await.map(drop);
        }
        match self.finish(outcome, idem.ttl).await {
            Ok(true) => {}
            Ok(false) => self.lease_lost(),
            Err(e) => {
                tracing::warn!(route = %self.request.route().name, key = %self.request.id, error = %e, "observe: the answer could not be recorded; passed on anyway");
            }
        }
        Ok(())
    }

    /// Records a final outcome, retried a little while the lease lasts; the answer depends on
    /// it (guarantee 3). A retry that could end after the lease is not started: past it,
    /// another attempt may own the key.
    async fn record(&self, outcome: Outcome, ttl: Duration) -> Result<bool, GatewayError> {
        let mut last = None;
        let bound = self.request.routing.config.store.record_bound();
        for attempt in 0..FINISH_ATTEMPTS {
            if attempt > 0 && Instant::now() + bound >= self.lease_ends {
                break;
            }
            match self.finish(outcome.clone(), ttl).await {
                Ok(true) => return Ok(true),
                // After a failed try, "nothing written" may mean that the try did write and
                // only its reply was lost (a connection cut after the commit). A retry is
                // only started while our lease lasts, when no other attempt can have
                // finished the key: a finished row is then ours.
                Ok(false) if last.is_some() && self.finished_already().await => {
                    tracing::info!(route = %self.request.route().name, key = %self.request.id, "the outcome was recorded by an earlier try whose reply was lost");
                    return Ok(true);
                }
                Ok(false) => {
                    self.lease_lost();
                    return Ok(false);
                }
                Err(e) => {
                    tracing::warn!(route = %self.request.route().name, key = %self.request.id, attempt, error = %e, "recording the outcome failed");
                    last = Some(e);
                    tokio::time::sleep(Duration::from_millis(50 << attempt)).await;
                }
            }
        }
        Err(GatewayError::StoreAfterForward(
            last.expect("at least one attempt failed"),
        ))
    }

    /// One fenced write; `Ok(false)`: nothing was written (the lease was lost, or an
    /// earlier try wrote it), and our client still gets what the upstream said.
    async fn finish(&self, outcome: Outcome, ttl: Duration) -> Result<bool, StoreError> {
        let _span = self.request.trace.as_ref().map(|t| t.child("record"));
        self.request
            .gateway
            .store
            .finish(
                &self.request.scope,
                &self.request.key,
                &self.token,
                outcome,
                ttl,
            )
            .await
    }

    /// Counts and logs a completion fenced off: another attempt took this key over.
    fn lease_lost(&self) {
        self.request
            .gateway
            .metrics
            .lease(&self.request.route().name, "lost");
        tracing::warn!(route = %self.request.route().name, key = %self.request.id, "lease lost: another attempt took this key over; not recorded");
    }

    /// Whether the key's row is finished (not in flight); a failed look says no.
    async fn finished_already(&self) -> bool {
        matches!(
            self.request.gateway.store.inspect(&self.request.scope, &self.request.key).await,
            Ok(Some(row)) if row.state != "in_flight"
        )
    }
}
