//! Every client-visible error, and the one table that maps it to a status
//! (docs/contract.md §3).
//!
//! [`GatewayError`] is what the request path returns; [`GatewayError::problem`] is the only
//! place that decides a status, as an exhaustive `match` without a `_` arm, so a new variant
//! cannot be forgotten. Bodies are RFC 9457 `application/problem+json`; the `detail` text is
//! written here for the client and never carries SQL, stack traces or upstream error text
//! (those go to the log, once, in `gateway::handle`).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

use crate::forward::{Body, full};
use crate::store::StoreError;

/// A failure on the request path, by whom it was caused.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("no route matches")]
    NoRoute,
    #[error("the path climbs above the root")]
    PathInvalid,
    /// A path that a lenient backend would read as this keyed route's (`path::lenient`).
    #[error("the path reads as keyed route {0:?} to a lenient backend")]
    PathResembles(String),
    #[error("a standard method spelled in another case")]
    MethodInvalid,
    #[error("CONNECT is not served")]
    MethodNotAllowed,
    #[error("an HTTP/1.1 request without Host")]
    HostMissing,
    #[error("overloaded: {0}")]
    Overloaded(&'static str),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("idempotency key missing")]
    KeyMissing,
    #[error("idempotency key invalid: {0}")]
    KeyInvalid(&'static str),
    #[error("scope missing")]
    ScopeMissing { unauthorized: bool },
    #[error("scope invalid: {0}")]
    ScopeInvalid(&'static str),
    #[error("body is not JSON")]
    BodyNotJson,
    #[error("request body over {limit} bytes")]
    BodyTooLarge { limit: usize },
    #[error("reading the request body failed: {0}")]
    BodyRead(String),
    #[error("the request body did not arrive within {0:?}")]
    BodyTimeout(Duration),

    #[error("same key, different request")]
    FingerprintMismatch,
    #[error("a request with this key is in flight")]
    InFlight { retry_after: Duration },
    /// Built by `From<StoreError>`, which turns a store call that panicked into
    /// [`GatewayError::Internal`].
    #[error("store unavailable: {0}")]
    Store(StoreError),
    #[error("the upstream answered but the answer could not be stored: {0}")]
    StoreAfterForward(StoreError),
    #[error("upstream not reachable: {0}")]
    UpstreamUnavailable(String),
    #[error("upstream failed after the request was sent: {0}")]
    UpstreamFailed(String),
    #[error("upstream timed out")]
    UpstreamTimeout,
    #[error("the outcome of the first request is unknown; the key is held")]
    OutcomeUnknown,
    #[error("the stored response was too large to replay")]
    NotReplayable,
}

impl From<StoreError> for GatewayError {
    /// A store that could not answer is 503 `store-unavailable`; a store call that panicked
    /// is a bug, 500 `internal`.
    fn from(e: StoreError) -> GatewayError {
        match e {
            StoreError::Internal(why) => GatewayError::Internal(why),
            e => GatewayError::Store(e),
        }
    }
}

impl From<crate::key::KeyError> for GatewayError {
    fn from(e: crate::key::KeyError) -> GatewayError {
        use crate::key::KeyError as K;
        match e {
            K::Missing => GatewayError::KeyMissing,
            K::Invalid(why) => GatewayError::KeyInvalid(why),
            K::ScopeMissing { unauthorized } => GatewayError::ScopeMissing { unauthorized },
            K::ScopeInvalid(why) => GatewayError::ScopeInvalid(why),
            K::NotJson => GatewayError::BodyNotJson,
        }
    }
}

impl From<crate::fingerprint::FingerprintError> for GatewayError {
    fn from(e: crate::fingerprint::FingerprintError) -> GatewayError {
        match e {
            crate::fingerprint::FingerprintError::NotJson => GatewayError::BodyNotJson,
        }
    }
}

impl GatewayError {
    /// A duplicate is still in flight: come back in a second.
    pub fn in_flight() -> GatewayError {
        GatewayError::InFlight {
            retry_after: Duration::from_secs(1),
        }
    }
}

impl GatewayError {
    /// The outcome name this error counts under in `idemgate_requests_total`.
    pub fn outcome(&self) -> &'static str {
        use crate::metrics::outcome as o;
        match self {
            GatewayError::NoRoute => o::NO_ROUTE,
            GatewayError::PathInvalid | GatewayError::PathResembles(_) => o::PATH_INVALID,
            GatewayError::MethodInvalid | GatewayError::HostMissing => o::REQUEST_INVALID,
            GatewayError::MethodNotAllowed => o::METHOD_NOT_ALLOWED,
            GatewayError::Overloaded(_) => o::OVERLOADED,
            GatewayError::Internal(_) => o::INTERNAL,
            GatewayError::KeyMissing => o::KEY_MISSING,
            GatewayError::KeyInvalid(_) => o::KEY_INVALID,
            GatewayError::ScopeMissing { .. } | GatewayError::ScopeInvalid(_) => o::SCOPE_MISSING,
            GatewayError::BodyNotJson => o::BODY_NOT_JSON,
            GatewayError::BodyTooLarge { .. } => o::BODY_TOO_LARGE,
            GatewayError::BodyRead(_) | GatewayError::BodyTimeout(_) => o::BODY_UNREADABLE,
            GatewayError::FingerprintMismatch => o::MISMATCH,
            GatewayError::InFlight { .. } => o::IN_FLIGHT_REJECTED,
            GatewayError::Store(_) | GatewayError::StoreAfterForward(_) => o::STORE_UNAVAILABLE,
            GatewayError::UpstreamUnavailable(_) | GatewayError::UpstreamFailed(_) => {
                o::UPSTREAM_UNAVAILABLE
            }
            GatewayError::UpstreamTimeout => o::UPSTREAM_TIMEOUT,
            GatewayError::OutcomeUnknown => o::OUTCOME_UNKNOWN,
            GatewayError::NotReplayable => o::NOT_REPLAYABLE,
        }
    }

    /// Whether the connection must close after this answer: the request body was not read
    /// (or cannot be trusted), so nothing after it on the connection can be parsed safely.
    pub fn closes_connection(&self) -> bool {
        matches!(
            self,
            GatewayError::BodyTooLarge { .. }
                | GatewayError::BodyRead(_)
                | GatewayError::BodyTimeout(_)
        )
    }
}

/// A rendered problem: status, slug, title, detail and an optional `Retry-After`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub status: StatusCode,
    pub slug: &'static str,
    pub title: &'static str,
    pub detail: String,
    pub retry_after: Option<Duration>,
    /// The request's id (`X-Request-Id`), as the extension member `request_id`.
    pub request_id: Option<String>,
}

impl GatewayError {
    /// The one status table (docs/contract.md §3).
    pub fn problem(&self) -> Problem {
        use GatewayError as E;
        let (status, slug, title, detail, retry_after): (u16, _, _, String, _) = match self {
            E::NoRoute => (
                404,
                "no-route",
                "No route",
                "No route matches this method and path.".into(),
                None,
            ),
            E::PathInvalid => (
                400,
                "path-invalid",
                "Path invalid",
                "The path climbs above the root with '..'.".into(),
                None,
            ),
            E::PathResembles(route) => (
                400,
                "path-invalid",
                "Path invalid",
                format!(
                    "This path is not keyed as written, but reads as a path of keyed route '{route}' once '%2F', '%5C' or '\\' is read as '/', ';parameters' are dropped or case is ignored, as some backends read it. Send the path as the route spells it."
                ),
                None,
            ),
            E::MethodInvalid => (
                400,
                "method-invalid",
                "Method invalid",
                "Methods are case-sensitive: send standard methods in upper case (POST, not post).".into(),
                None,
            ),
            E::MethodNotAllowed => (
                405,
                "method-not-allowed",
                "Method not allowed",
                "CONNECT is not served: this is a reverse proxy.".into(),
                None,
            ),
            E::HostMissing => (
                400,
                "host-missing",
                "Host missing",
                "An HTTP/1.1 request must carry a Host header.".into(),
                None,
            ),
            E::Overloaded(_) => (
                503,
                "overloaded",
                "Overloaded",
                "The gateway is at its bound for this upstream or for buffered bytes; the request was not forwarded and no key was held. Retry later.".into(),
                Some(Duration::from_secs(1)),
            ),
            E::Internal(_) => (
                500,
                "internal",
                "Internal error",
                "The gateway failed internally (a bug). If the request was keyed, a retry with the same key gets its recorded outcome, 409 while its lease lasts, or is forwarded again once the lease has ended.".into(),
                None,
            ),
            E::KeyMissing => (
                400,
                "key-missing",
                "Idempotency key missing",
                "This endpoint requires an idempotency key.".into(),
                None,
            ),
            E::KeyInvalid(why) => (
                400,
                "key-invalid",
                "Idempotency key invalid",
                format!("The idempotency key {why}."),
                None,
            ),
            E::ScopeMissing { unauthorized } => (
                if *unauthorized { 401 } else { 400 },
                "scope-missing",
                "Scope missing",
                if *unauthorized {
                    "This endpoint requires an Authorization header.".into()
                } else {
                    "The request does not say whose key this is (scope missing).".into()
                },
                None,
            ),
            E::ScopeInvalid(why) => (
                400,
                "scope-invalid",
                "Scope invalid",
                format!("The scope {why}."),
                None,
            ),
            E::BodyNotJson => (
                400,
                "body-not-json",
                "Body is not JSON",
                "The idempotency key, scope or fingerprint is read from a JSON body, and this body is not valid JSON.".into(),
                None,
            ),
            E::BodyTooLarge { limit } => (
                413,
                "body-too-large",
                "Request body too large",
                format!("The request body is larger than {limit} bytes."),
                None,
            ),
            E::BodyRead(_) => (
                400,
                "body-unreadable",
                "Request body could not be read",
                "The request body ended early or was malformed.".into(),
                None,
            ),
            E::BodyTimeout(limit) => (
                408,
                "body-timeout",
                "Request body too slow",
                format!(
                    "The request body did not arrive within {} seconds.",
                    limit.as_secs()
                ),
                None,
            ),
            E::FingerprintMismatch => (
                422,
                "fingerprint-mismatch",
                "Idempotency key reused",
                "This idempotency key was already used with a different request.".into(),
                None,
            ),
            E::InFlight { retry_after } => (
                409,
                "in-flight",
                "Request in flight",
                "A request with this idempotency key is still being processed; retry later.".into(),
                Some(*retry_after),
            ),
            E::Store(_) => (
                503,
                "store-unavailable",
                "Store unavailable",
                "The idempotency store is unavailable; the request was not forwarded.".into(),
                Some(Duration::from_secs(1)),
            ),
            E::StoreAfterForward(_) => (
                503,
                "store-unavailable",
                "Store unavailable",
                "The upstream answered, but its answer could not be recorded. Until the key's lease ends a retry gets 409 in-flight; after it, a retry is forwarded again, or gets 502 outcome-unknown on a route that holds unknown outcomes.".into(),
                Some(Duration::from_secs(1)),
            ),
            E::UpstreamUnavailable(_) => (
                502,
                "upstream-unavailable",
                "Upstream unavailable",
                "The upstream could not be reached; the request was not processed.".into(),
                None,
            ),
            E::UpstreamFailed(_) => (
                502,
                "upstream-unavailable",
                "Upstream failed",
                "The connection to the upstream failed after the request was sent; its outcome is unknown.".into(),
                None,
            ),
            E::UpstreamTimeout => (
                504,
                "upstream-timeout",
                "Upstream timed out",
                "The upstream did not answer in time; its outcome is unknown.".into(),
                None,
            ),
            E::OutcomeUnknown => (
                502,
                "outcome-unknown",
                "Outcome unknown",
                "The first request with this key may or may not have been processed; the key is held until an operator releases it or it expires.".into(),
                None,
            ),
            E::NotReplayable => (
                502,
                "response-not-replayable",
                "Response not replayable",
                "The first request with this key was processed, but its response was too large to store for replay.".into(),
                None,
            ),
        };
        Problem {
            status: StatusCode::from_u16(status).expect("table holds valid statuses"),
            slug,
            title,
            detail,
            retry_after,
            request_id: None,
        }
    }
}

impl Problem {
    /// The same problem naming the request it answers.
    pub fn with_request_id(mut self, id: &str) -> Problem {
        self.request_id = Some(id.to_string());
        self
    }

    /// The RFC 9457 JSON body.
    pub fn body(&self) -> Bytes {
        let mut v = serde_json::json!({
            "type": format!("urn:idemgate:problem:{}", self.slug),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
        });
        if let Some(id) = &self.request_id {
            v["request_id"] = serde_json::Value::String(id.clone());
        }
        Bytes::from(serde_json::to_vec(&v).expect("a JSON value serializes"))
    }

    /// A complete response with `Content-Type: application/problem+json`.
    pub fn into_response(self) -> Response<Body> {
        let mut resp = Response::new(full(self.body()));
        *resp.status_mut() = self.status;
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            let secs = after.as_secs().max(1);
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// What a failed forward tells the client: the one mapping, for plain and keyed forwards.
impl From<crate::forward::UpstreamError> for GatewayError {
    fn from(e: crate::forward::UpstreamError) -> GatewayError {
        use crate::forward::UpstreamError;
        match e {
            UpstreamError::Connect(e) => GatewayError::UpstreamUnavailable(e),
            UpstreamError::Timeout => GatewayError::UpstreamTimeout,
            UpstreamError::Failed(e) => GatewayError::UpstreamFailed(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problem_body_is_rfc9457() {
        let p = GatewayError::FingerprintMismatch.problem();
        let v: serde_json::Value = serde_json::from_slice(&p.body()).unwrap();
        assert_eq!(v["type"], "urn:idemgate:problem:fingerprint-mismatch");
        assert_eq!(v["status"], 422);
        assert!(v["title"].is_string() && v["detail"].is_string());
    }

    #[test]
    fn a_failed_record_says_what_a_retry_will_get() {
        let p = GatewayError::StoreAfterForward(StoreError::Timeout).problem();
        assert_eq!((p.status.as_u16(), p.slug), (503, "store-unavailable"));
        assert!(p.detail.contains("409"), "{}", p.detail);
        assert!(p.detail.contains("outcome-unknown"), "{}", p.detail);
        assert!(!p.detail.contains("retry later to get it"));
    }

    #[test]
    fn in_flight_carries_retry_after() {
        let resp = GatewayError::InFlight {
            retry_after: Duration::from_secs(2),
        }
        .problem()
        .into_response();
        assert_eq!(resp.status(), 409);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "2");
    }
}
