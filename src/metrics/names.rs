//! The fixed label values: the outcome names of `idemgate_requests_total` and
//! `idemgate_observed_total`, and the events and results of the other counters. Every one
//! is documented in docs/operations.md ("Metrics"); a name here is interface.

/// The outcome names of `idemgate_requests_total`.
pub mod outcome {
    /// Proxied on a route or method without idempotency (or keyless, not required).
    pub const PROXIED: &str = "proxied";
    /// Proxied, and the upstream switched protocols: a tunnel was opened (`tunnel.rs`).
    pub const TUNNELED: &str = "tunneled";
    /// Claimed and forwarded; the answer was stored (or released for a retryable status).
    pub const FORWARDED: &str = "forwarded";
    /// Answered from a stored response.
    pub const REPLAYED: &str = "replayed";
    /// Waited for an in-flight duplicate, then answered from its stored response.
    pub const COALESCED: &str = "coalesced";
    pub const MISMATCH: &str = "mismatch";
    pub const IN_FLIGHT_REJECTED: &str = "in_flight_rejected";
    pub const KEY_MISSING: &str = "key_missing";
    pub const KEY_INVALID: &str = "key_invalid";
    pub const SCOPE_MISSING: &str = "scope_missing";
    pub const BODY_NOT_JSON: &str = "body_not_json";
    pub const BODY_TOO_LARGE: &str = "body_too_large";
    pub const BODY_UNREADABLE: &str = "body_unreadable";
    pub const STORE_UNAVAILABLE: &str = "store_unavailable";
    /// Forwarded without idempotency because the store was down (`pass_through`).
    pub const BYPASSED: &str = "bypassed";
    pub const UPSTREAM_UNAVAILABLE: &str = "upstream_unavailable";
    pub const UPSTREAM_TIMEOUT: &str = "upstream_timeout";
    pub const OUTCOME_UNKNOWN: &str = "outcome_unknown";
    pub const NOT_REPLAYABLE: &str = "not_replayable";
    pub const NO_ROUTE: &str = "no_route";
    pub const PATH_INVALID: &str = "path_invalid";
    /// A standard method in another case (`post`), or an HTTP/1.1 request without `Host`:
    /// refused before routing.
    pub const REQUEST_INVALID: &str = "request_invalid";
    /// `CONNECT`: the gateway is no forward proxy.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// Refused by `max_in_flight` or `max_buffered_bytes` before anything was read or claimed.
    pub const OVERLOADED: &str = "overloaded";
    /// A bug: a task panicked or was cancelled.
    pub const INTERNAL: &str = "internal";
    /// On a `mode: observe` route: forwarded, unrecorded, although enforcing would not
    /// have forwarded it; `idemgate_observed_total` says what enforcing would have done.
    pub const OBSERVED: &str = "observed";
}

/// The outcome names of `idemgate_observed_total` (docs/contract.md §8.3): what enforcing
/// would have done with a request an observe route forwarded.
pub mod observed {
    /// The key was completed with the same fingerprint: enforcing would have replayed the
    /// stored answer. Also a key whose stored answer was too large to replay or whose
    /// outcome is unknown (`hold`): enforcing would have answered from the store (502)
    /// without forwarding.
    pub const WOULD_REPLAY: &str = "would_replay";
    /// Another attempt with the same fingerprint was in flight: enforcing would have waited
    /// for its answer (or, with `in_flight: reject`, answered 409).
    pub const WOULD_WAIT: &str = "would_wait";
    /// The key was used with a different request: enforcing would have answered 422.
    pub const WOULD_MISMATCH: &str = "would_mismatch";
    /// All three, in the order they are documented.
    pub const ALL: [&str; 3] = [WOULD_REPLAY, WOULD_WAIT, WOULD_MISMATCH];
}

/// The lease events of `idemgate_leases_total`, every one created at 0 for every keyed
/// route (docs/operations.md, "Alerts worth setting").
pub const LEASE_EVENTS: [&str; 3] = ["taken_over", "lost", "force_deleted"];

/// The results of `idemgate_reloads_total`.
pub const RELOAD_RESULTS: [&str; 2] = ["ok", "error"];

/// The results of `idemgate_gc_runs_total`: `ok` (this instance collected), `skipped`
/// (another instance held the collection lock), `error`.
pub const GC_RESULTS: [&str; 3] = ["ok", "skipped", "error"];
