//! A configuration snapshot and the upstream clients built from it ([`Routing`]): what a
//! request resolves its route, idempotency settings and upstream client against. A reload
//! builds a new one and swaps it in whole; a request keeps the snapshot it started with.
//!
//! Invariants: an upstream's admission counter ([`UpstreamLimit`]) is the same object in
//! every snapshot ([`LimitRegistry`] hands it out by upstream name), so slots taken under an
//! old snapshot are counted against the new limit; `Routing::metrics[i]` are the metric
//! handles of `config.routes[i]`, resolved when the snapshot is built (the same handles for a
//! route name in every snapshot), so a request counts without looking its route up by name.

use std::sync::Arc;

use crate::config::{Config, Idempotency, Route};
use crate::forward::{UpstreamClient, Upstreams};
use crate::limits::UpstreamLimit;
use crate::metrics::{Metrics, RouteHandles};

/// One configuration and the upstream clients built from it.
pub struct Routing {
    pub config: Arc<Config>,
    pub(crate) upstreams: Upstreams,
    /// The metric handles of `config.routes[i]` at `i`.
    pub(crate) metrics: Vec<Arc<RouteHandles>>,
}

impl Routing {
    pub(crate) fn new(config: Arc<Config>, gateway_limits: &LimitRegistry<'_>) -> Routing {
        let upstreams = Upstreams::new(config.upstreams.values(), |up| gateway_limits.get(up));
        let metrics = config
            .routes
            .iter()
            .map(|r| gateway_limits.metrics.route(&r.name))
            .collect();
        Routing {
            config,
            upstreams,
            metrics,
        }
    }

    pub(crate) fn route(&self, name: &str) -> Option<(&Route, &Idempotency, &UpstreamClient)> {
        let route = self.config.routes.iter().find(|r| r.name == name)?;
        let idem = route.idempotency.as_ref()?;
        let upstream = self.upstreams.get(&route.upstream)?;
        Some((route, idem, upstream))
    }
}

/// Hands out each upstream's admission counter, the same one across reloads.
pub(crate) struct LimitRegistry<'a> {
    pub(crate) limits: &'a std::sync::Mutex<std::collections::HashMap<String, Arc<UpstreamLimit>>>,
    pub(crate) metrics: &'a Metrics,
}

impl LimitRegistry<'_> {
    pub(crate) fn get(&self, up: &crate::config::UpstreamConfig) -> Arc<UpstreamLimit> {
        let mut limits = self.limits.lock().expect("limits lock");
        let limit = limits.entry(up.name.clone()).or_insert_with(|| {
            let gauge = self
                .metrics
                .upstream_in_flight
                .get_or_create(&crate::metrics::UpstreamLabel {
                    upstream: up.name.clone(),
                })
                .clone();
            Arc::new(UpstreamLimit::new(up.max_in_flight, gauge))
        });
        limit.set_max(up.max_in_flight);
        Arc::clone(limit)
    }
}
