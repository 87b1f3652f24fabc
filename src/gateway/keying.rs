//! A keyed request's key, scope and fingerprint, read from its head and body once
//! ([`key_request`]), and the repeated-member check that can wait for a replay cache miss
//! ([`refuse_ambiguous`]).
//!
//! Invariant: every error here is the client's (the request cannot be keyed), except a
//! blocking thread that fails (500 `internal`).

use std::sync::Arc;

use bytes::Bytes;

use crate::config::{Idempotency, Route};
use crate::fingerprint::{Fingerprint, fingerprint};
use crate::key::{JsonBody, KeyScope, extract};
use crate::problem::GatewayError;
use crate::routing::Routing;

/// The key, scope and fingerprint of a keyed request; `None` when it has no key and the
/// route does not require one. Every error is the client's: the request cannot be keyed.
///
/// Reading a body is linear in its size (key.rs), but a large one still takes a while: over
/// `INLINE` bytes it is read on a blocking thread, so that the serving thread goes on with
/// its other connections meanwhile, and the repeated-member check runs there too (`settled`
/// is then true). Running the check before the replay cache is looked up changes no answer:
/// the cache holds no body that fails it (see `refuse_ambiguous`).
pub(super) async fn key_request(
    routing: &Arc<Routing>,
    index: usize,
    idem: &Idempotency,
    parts: &http::request::Parts,
    body: &Bytes,
) -> Result<Option<(KeyScope, Fingerprint, bool)>, GatewayError> {
    /// Bodies up to this size are read on the serving thread, where most bodies are: up to
    /// about 0.1 ms for an ordinary one and 0.4 ms for the costliest shape (deep nesting;
    /// `body_1MiB` in benches/micro.rs), against some tens of microseconds for a hand-off.
    const INLINE: usize = 16 * 1024;

    fn key_now(
        route: &Route,
        idem: &Idempotency,
        method: &http::Method,
        uri: &http::Uri,
        headers: &http::HeaderMap,
        body: &Bytes,
        check_now: bool,
    ) -> Result<Option<(KeyScope, Fingerprint, bool)>, GatewayError> {
        let mut json = JsonBody::new(body);
        let Some(keyed) = extract(idem, headers, &mut json)? else {
            return Ok(None);
        };
        // A raw fingerprint pins the body's bytes, so the repeated-member check can wait for
        // a replay cache miss (see `refuse_ambiguous`); a canonical one does not, so it runs
        // here: the parse that the canonical form reads refuses a repeated member.
        let mut settled = json.is_parsed() || idem.fingerprint.json_canonical;
        let json_value = if idem.fingerprint.json_canonical {
            Some(json.get()?)
        } else {
            None
        };
        // The path was normalized before routing (see `route_request`).
        let pq = uri.path_and_query().map(|pq| pq.as_str()).unwrap_or("/");
        let fp = fingerprint(
            &idem.fingerprint,
            method,
            &route.name,
            pq,
            headers,
            body,
            json_value,
        )?;
        if check_now && !settled {
            json.refuse_ambiguous(headers)?;
            settled = true;
        }
        Ok(Some((keyed, fp, settled)))
    }

    let route = &routing.config.routes[index];
    if body.len() <= INLINE {
        return key_now(
            route,
            idem,
            &parts.method,
            &parts.uri,
            &parts.headers,
            body,
            false,
        );
    }
    let routing = Arc::clone(routing);
    let (method, uri, headers) = (
        parts.method.clone(),
        parts.uri.clone(),
        parts.headers.clone(),
    );
    let body = body.clone();
    let keying = tokio::task::spawn_blocking(move || {
        let route = &routing.config.routes[index];
        let idem = route
            .idempotency
            .as_ref()
            .expect("a keyed route has its idempotency");
        key_now(route, idem, &method, &uri, &headers, &body, true)
    });
    keying.await.unwrap_or_else(|e| {
        tracing::error!(error = %e, "keying a request's body on a blocking thread failed");
        Err(GatewayError::Internal(
            "keying a request's body failed".to_string(),
        ))
    })
}

/// The repeated-member check of a keyed request whose key, scope and fingerprint are known
/// (`settled`: `key_request` checked already, because the body was parsed or the fingerprint
/// is canonical). Run after the replay cache missed: a hit needs no check, because the cache
/// holds only bodies without a repeated member or not JSON at all (`KeyedRequest::work`), and a
/// raw fingerprint equal to an entry's means the very same bytes, on which the check cannot
/// fail whatever `Content-Type` says.
pub(super) fn refuse_ambiguous(
    parts: &http::request::Parts,
    body: &Bytes,
    settled: bool,
) -> Result<(), GatewayError> {
    if settled {
        return Ok(());
    }
    Ok(JsonBody::new(body).refuse_ambiguous(&parts.headers)?)
}
