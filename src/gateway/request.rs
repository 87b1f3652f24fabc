//! A keyed request from its claim on: the one context that the claim, the wait, the replay
//! (`keyed.rs`) and the forward and its record (`record.rs`) read. It holds its route by
//! index in the routing snapshot it started with, so no stage looks a route up again, and a
//! reload does not change it midway.

use std::sync::Arc;

use super::Gateway;
use crate::config::Route;
use crate::fingerprint::Fingerprint;
use crate::forward::ClientInfo;
use crate::key::KeyId;
use crate::limits::Admission;
use crate::routing::Routing;

/// A keyed request from its claim on, owned by its own task (see `Gateway::keyed`): what
/// every later stage reads (the claim, the wait, the replay, then `record.rs`), its route
/// held by index in the routing snapshot it started with, never looked up again.
pub(super) struct KeyedRequest {
    pub(super) gateway: Arc<Gateway>,
    /// The configuration the request started with (a reload does not change it midway).
    pub(super) routing: Arc<Routing>,
    /// The route's index in `routing`: a keyed route.
    pub(super) index: usize,
    pub(super) client: ClientInfo,
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) id: KeyId,
    pub(super) fp: Fingerprint,
    pub(super) cache_epoch: Option<u64>,
    /// The buffered bytes (and, once forwarded, the upstream slot), held until this task
    /// ends.
    pub(super) admission: Admission,
    /// The request's trace (traces on): the claim, the wait, the forward and the record
    /// are its child spans.
    pub(super) trace: Option<crate::telemetry::RequestTrace>,
}

impl KeyedRequest {
    /// The request's route.
    pub(super) fn route(&self) -> &Route {
        &self.routing.config.routes[self.index]
    }
}
