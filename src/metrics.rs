//! Prometheus metrics (`GET /metrics` on `admin.listen`), with prometheus-client.
//!
//! Every name starts with `idemgate_` but the standard `process_*` ones; counters get
//! `_total` from the library. Label values are bounded: route and upstream names (from the
//! config) and fixed outcome, class, event, result and operation names; never keys, scopes
//! or anything a client sends. docs/operations.md ("Metrics") has the table.
//!
//! - `idemgate_requests_total{route, outcome, status_class}`: every request, by what happened
//!   to it (see [`outcome`] for the names) and the class of the answer sent (`1xx`..`5xx`,
//!   [`STATUS_CLASSES`]): an upstream's 500 forwarded is `forwarded`, `5xx`.
//! - `idemgate_request_duration_seconds{route, outcome}`: from a request's arrival to the end
//!   of its response (the access line's `duration_us`), 1 ms to 30 s.
//! - `idemgate_leases_total{route, event}`: `taken_over` (an expired lease was taken over:
//!   a possible double), `lost` (our write found the lease taken; not recorded) and
//!   `force_deleted` (an operator deleted a key under a live lease: a possible double).
//! - `idemgate_upstream_latency_seconds{route}` and `idemgate_upstream_duration_seconds{upstream}`:
//!   from sending the request to the whole response (keyed) or its head (pass-through).
//! - `idemgate_store_latency_seconds{op}`, `idemgate_store_errors_total{op}` and
//!   `idemgate_store_pool_wait_seconds`: recorded by the store, per operation (one or more
//!   statements). `idemgate_store_batch_keys{op}`: keys per statement of the Postgres
//!   store's batched claims (`claim_new`) and completions (`finish`); its count is the
//!   statements, its sum the keys.
//! - `idemgate_forwards_in_flight`, `idemgate_store_pool_connections{state}`,
//!   `idemgate_replay_cache_bytes`, `idemgate_wakeups_healthy`: gauges read at scrape time.
//! - `idemgate_upstream_in_flight{upstream}` and `idemgate_buffered_bytes`: the admission
//!   bounds' gauges (docs/contract.md §8.2), next to the bounds themselves
//!   (`idemgate_upstream_max_in_flight{upstream}`, `idemgate_max_buffered_bytes`);
//!   `idemgate_overloaded_total{upstream, bound}` counts the refusals, `bound` being
//!   `max_in_flight` or `max_buffered_bytes`.
//! - `idemgate_observed_total{route, outcome}`: on `mode: observe` routes, what enforcing
//!   would have done with a request that was forwarded instead (see [`observed`]).
//! - `idemgate_client_connections`, `idemgate_reloads_total{result}`,
//!   `idemgate_gc_runs_total{result}`, `idemgate_gc_rows_total`, `idemgate_build_info{version}`.
//! - `idemgate_trace_spans_dropped_total` and `idemgate_trace_spans_exported_total`: spans
//!   of traces (`telemetry`) lost (queue full, export failed) and accepted by the collector;
//!   0 while tracing is off.
//! - `process_*` (`process.rs`): CPU, memory, file descriptors and start time, read from
//!   `/proc/self` when scraped.
//!
//! Every series an alert (deploy/prometheus/alerts.yml) or the dashboard
//! (deploy/grafana/idemgate.json) reads exists at 0 from the start: [`Metrics::configure`]
//! creates them with the routes and again on every reload, so a rate or `increase()` over a
//! series' first step is not lost (a series born at 1 reads no increase).
//!
//! The series every request writes (`idemgate_requests_total`,
//! `idemgate_request_duration_seconds` and the two upstream histograms) are kept per thread
//! ([`ShardedCounter`], [`ShardedHistogram`], `shard.rs`) and summed when scraped: the
//! runtime's workers do not pass one counter's cache line between their cores at every
//! request. A request reaches them through handles resolved once per route
//! ([`RouteHandles`], `route.rs`) and per route's upstream (`Routing::upstream_durations`):
//! after a route's first request of an outcome and class, counting takes no lock, map lookup
//! or allocation.
//!
//! `/metrics` answers OpenMetrics to a scraper that asks for it (Prometheus does) and the
//! older text format to anyone else; `promtool check metrics` lints the latter in CI.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

mod buckets;
mod format;
mod labels;
mod names;
mod process;
mod route;
mod sharded;
mod store;

use buckets::*;
pub use format::Format;
use format::openmetrics_to_text;
pub use labels::{
    OpLabel, ResultLabel, RouteEvent, StateLabel, UpstreamBound, UpstreamLabel, VersionLabel,
};
pub use labels::{RouteLabel, RouteOutcome, RouteOutcomeClass, STATUS_CLASSES, status_class};
pub use names::{GC_RESULTS, LEASE_EVENTS, RELOAD_RESULTS, observed, outcome};
pub use route::{Counted, RouteHandles};
pub use sharded::{ShardedCounter, ShardedHistogram};
pub use store::StoreMetrics;

/// Every metric of a gateway process.
pub struct Metrics {
    registry: Mutex<Registry>,
    /// The `process_*` series (no `idemgate_` prefix), read from `/proc/self` when scraped.
    process: Registry,
    pub requests: Family<RouteOutcomeClass, ShardedCounter>,
    pub request_duration: Family<RouteOutcome, ShardedHistogram>,
    pub leases: Family<RouteEvent, Counter>,
    pub upstream_latency: Family<RouteLabel, ShardedHistogram>,
    pub upstream_duration: Family<UpstreamLabel, ShardedHistogram>,
    pub forwards_in_flight: Gauge,
    pub replay_cache_bytes: Gauge,
    pub wakeups_healthy: Gauge,
    pub upstream_in_flight: Family<UpstreamLabel, Gauge>,
    /// Each upstream's `max_in_flight`, set with the routes.
    pub upstream_max_in_flight: Family<UpstreamLabel, Gauge>,
    pub buffered_bytes: Gauge,
    /// `server.max_buffered_bytes`, set with the routes.
    pub max_buffered_bytes: Gauge,
    pub overloaded: Family<UpstreamBound, Counter>,
    pub observed: Family<RouteOutcome, Counter>,
    /// Client connections open now (`server.rs` counts them).
    pub client_connections: Gauge,
    pub reloads: Family<ResultLabel, Counter>,
    pub gc_runs: Family<ResultLabel, Counter>,
    pub gc_rows: Counter,
    /// Spans dropped (queue full, or export failed) and spans exported (traces, src/telemetry/).
    pub trace_spans: crate::telemetry::Counters,
    /// Handles resolved once per route, so a request costs no label allocation or hashing
    /// of an owned label set (the families above stay the source of truth).
    per_route: std::sync::RwLock<std::collections::HashMap<String, Arc<RouteHandles>>>,
    /// The handles of `route=""`: a request that matched no route.
    unrouted: Arc<RouteHandles>,
}

/// The request series the shipped alerts read (deploy/prometheus/alerts.yml), created at 0
/// for every route (`keyed`: for every keyed route) so that a rate over a series' first
/// increase is not lost: (outcome, status class index).
const ALERTED: [(&str, usize); 5] = [
    (outcome::PROXIED, 4),
    (outcome::UPSTREAM_UNAVAILABLE, 4),
    (outcome::UPSTREAM_TIMEOUT, 4),
    (outcome::INTERNAL, 4),
    (outcome::OVERLOADED, 4),
];
const ALERTED_KEYED: [(&str, usize); 10] = [
    (outcome::FORWARDED, 4),
    (outcome::OBSERVED, 4),
    (outcome::STORE_UNAVAILABLE, 4),
    (outcome::OUTCOME_UNKNOWN, 4),
    // Forwarded without idempotency: whatever the upstream answered.
    (outcome::BYPASSED, 0),
    (outcome::BYPASSED, 1),
    (outcome::BYPASSED, 2),
    (outcome::BYPASSED, 3),
    (outcome::BYPASSED, 4),
    (outcome::MISMATCH, 3),
];

impl Metrics {
    /// Counts a request refused by `bound` (`max_in_flight`, `max_buffered_bytes`) of
    /// `upstream`.
    pub fn refused(&self, upstream: &str, bound: &'static str) {
        self.overloaded
            .get_or_create(&UpstreamBound {
                upstream: upstream.to_owned(),
                bound,
            })
            .inc();
    }

    pub fn new(store: &StoreMetrics) -> Metrics {
        let mut registry = Registry::with_prefix("idemgate");
        let requests = Family::<RouteOutcomeClass, ShardedCounter>::default();
        let request_duration =
            Family::<RouteOutcome, ShardedHistogram>::new_with_constructor(duration_buckets);
        let leases = Family::<RouteEvent, Counter>::default();
        let upstream_latency =
            Family::<RouteLabel, ShardedHistogram>::new_with_constructor(route_latency_buckets);
        let upstream_duration =
            Family::<UpstreamLabel, ShardedHistogram>::new_with_constructor(duration_buckets);
        let forwards_in_flight = Gauge::default();
        let replay_cache_bytes = Gauge::default();
        let wakeups_healthy = Gauge::default();
        let upstream_in_flight = Family::<UpstreamLabel, Gauge>::default();
        let buffered_bytes = Gauge::default();
        let upstream_max_in_flight = Family::<UpstreamLabel, Gauge>::default();
        let max_buffered_bytes = Gauge::default();
        // The operations every request makes, so that an error rate reads 0 before the
        // first error.
        for op in ["claim", "finish"] {
            let _created = store.errors.get_or_create(&OpLabel { op });
        }
        let overloaded = Family::<UpstreamBound, Counter>::default();
        let observed = Family::<RouteOutcome, Counter>::default();
        let client_connections = Gauge::default();
        let reloads = Family::<ResultLabel, Counter>::default();
        let gc_runs = Family::<ResultLabel, Counter>::default();
        let gc_rows = Counter::default();
        let build_info = Family::<VersionLabel, Gauge>::default();
        build_info
            .get_or_create(&VersionLabel {
                version: env!("CARGO_PKG_VERSION"),
            })
            .set(1);
        for result in RELOAD_RESULTS {
            let _created = reloads.get_or_create(&ResultLabel { result });
        }
        for result in GC_RESULTS {
            let _created = gc_runs.get_or_create(&ResultLabel { result });
        }
        registry.register(
            "build_info",
            "Always 1; the version label is the running binary's",
            build_info,
        );
        registry.register(
            "observed",
            "Requests an observe route forwarded, by what enforcing would have done: would_replay, would_wait, would_mismatch",
            observed.clone(),
        );
        registry.register(
            "upstream_in_flight",
            "Requests admitted to each upstream and not yet finished (bounded by max_in_flight)",
            upstream_in_flight.clone(),
        );
        registry.register(
            "upstream_max_in_flight",
            "Each upstream's max_in_flight: the bound of upstream_in_flight",
            upstream_max_in_flight.clone(),
        );
        registry.register(
            "max_buffered_bytes",
            "server.max_buffered_bytes: the bound of buffered_bytes",
            max_buffered_bytes.clone(),
        );
        registry.register(
            "buffered_bytes",
            "Request bodies and captured responses held in memory (bounded by max_buffered_bytes)",
            buffered_bytes.clone(),
        );
        registry.register(
            "overloaded",
            "Requests refused with 503 overloaded, by upstream and bound",
            overloaded.clone(),
        );
        registry.register(
            "requests",
            "Requests by route, outcome and the status class of the answer",
            requests.clone(),
        );
        registry.register(
            "request_duration_seconds",
            "Time from a request's arrival to the end of its response, by route and outcome",
            request_duration.clone(),
        );
        registry.register(
            "leases",
            "Lease events by route: taken_over and force_deleted (possible doubles), lost (not recorded)",
            leases.clone(),
        );
        registry.register(
            "upstream_latency_seconds",
            "Upstream latency by route",
            upstream_latency.clone(),
        );
        registry.register(
            "upstream_duration_seconds",
            "Upstream latency by upstream",
            upstream_duration.clone(),
        );
        registry.register(
            "store_latency_seconds",
            "Store operation latency by operation",
            store.latency.clone(),
        );
        registry.register(
            "store_errors",
            "Store operations that failed, by operation",
            store.errors.clone(),
        );
        registry.register(
            "store_pool_wait_seconds",
            "Time spent waiting for a pooled store connection",
            store.pool_wait.clone(),
        );
        registry.register(
            "store_batch_keys",
            "Keys per statement of the store's batched claims and completions",
            store.batch.clone(),
        );
        registry.register(
            "store_pool_connections",
            "Pooled store connections by state",
            store.pool.clone(),
        );
        registry.register(
            "store_async_standbys",
            "Streaming standbys of the database that are not synchronous: a failover to one can lose answered commits",
            store.async_standbys.clone(),
        );
        registry.register(
            "forwards_in_flight",
            "Keyed forwards in flight",
            forwards_in_flight.clone(),
        );
        registry.register(
            "replay_cache_bytes",
            "Bytes held by the replay cache",
            replay_cache_bytes.clone(),
        );
        registry.register(
            "wakeups_healthy",
            "1 while wake-ups for in-flight keys flow (LISTEN/NOTIFY or in process)",
            wakeups_healthy.clone(),
        );
        registry.register(
            "client_connections",
            "Client connections open now",
            client_connections.clone(),
        );
        registry.register(
            "reloads",
            "Configuration reloads (SIGHUP) by result: ok or error",
            reloads.clone(),
        );
        registry.register(
            "gc_runs",
            "Garbage collections of expired keys by result: ok, skipped (another instance held the lock), error",
            gc_runs.clone(),
        );
        registry.register(
            "gc_rows",
            "Expired rows deleted by garbage collection",
            gc_rows.clone(),
        );
        let trace_spans = crate::telemetry::Counters::default();
        registry.register(
            "trace_spans_dropped",
            "Spans not exported: the export queue was full, or the collector failed or timed out",
            trace_spans.dropped.clone(),
        );
        registry.register(
            "trace_spans_exported",
            "Spans the OTLP collector accepted",
            trace_spans.exported.clone(),
        );
        let mut process = Registry::default();
        process.register_collector(Box::new(process::ProcessCollector));
        let mut m = Metrics {
            registry: Mutex::new(registry),
            process,
            requests,
            request_duration,
            leases,
            upstream_latency,
            upstream_duration,
            forwards_in_flight,
            replay_cache_bytes,
            wakeups_healthy,
            upstream_in_flight,
            upstream_max_in_flight,
            buffered_bytes,
            max_buffered_bytes,
            overloaded,
            observed,
            client_connections,
            reloads,
            gc_runs,
            gc_rows,
            trace_spans,
            per_route: Default::default(),
            // Replaced just below by the registered handles of `route=""`.
            unrouted: Arc::new(RouteHandles::new(
                "",
                ShardedHistogram::new([]),
                Family::default(),
                Family::new_with_constructor(duration_buckets),
            )),
        };
        m.unrouted = m.route("");
        m
    }

    /// The handles of `route=""`: requests that matched no route.
    pub fn unrouted(&self) -> &Arc<RouteHandles> {
        &self.unrouted
    }

    /// Counts what enforcing would have done with a request an observe route forwarded.
    pub fn observed(&self, route: &str, outcome: &'static str) {
        self.observed
            .get_or_create(&RouteOutcome {
                route: route.to_string(),
                outcome,
            })
            .inc();
    }

    /// Creates at 0 every series an alert or the dashboard reads (deploy/prometheus,
    /// deploy/grafana) of `config`'s routes: a rate or `increase()` over a series' first
    /// events then counts them (a series born at 1 would read 0). Called with the first
    /// configuration and on every reload (a series once created stays):
    /// - `idemgate_leases_total{route, event}` for every keyed route and each of
    ///   [`LEASE_EVENTS`];
    /// - `idemgate_requests_total{route, outcome, status_class}` of the outcomes the alerts
    ///   read ([`ALERTED`], and [`ALERTED_KEYED`] on keyed routes);
    /// - `idemgate_observed_total{route, outcome}` of every observe route.
    pub fn configure(&self, config: &crate::config::Config) {
        self.init_observed(config);
        for route in &config.routes {
            let handles = self.route(&route.name);
            for (outcome, class) in ALERTED {
                handles.create(outcome, class);
            }
            if route.idempotency.is_none() {
                continue;
            }
            for (outcome, class) in ALERTED_KEYED {
                handles.create(outcome, class);
            }
            for event in LEASE_EVENTS {
                let _created = self.leases.get_or_create(&RouteEvent {
                    route: route.name.clone(),
                    event,
                });
            }
        }
        for (name, upstream) in &config.upstreams {
            let label = UpstreamLabel {
                upstream: name.clone(),
            };
            let _created = self.upstream_duration.get_or_create(&label);
            let _created = self.upstream_in_flight.get_or_create(&label);
            self.upstream_max_in_flight
                .get_or_create(&label)
                .set(i64::try_from(upstream.max_in_flight).unwrap_or(i64::MAX));
            for bound in ["max_in_flight", "max_buffered_bytes"] {
                let _created = self.overloaded.get_or_create(&UpstreamBound {
                    upstream: name.clone(),
                    bound,
                });
            }
        }
        self.max_buffered_bytes
            .set(i64::try_from(config.server.max_buffered_bytes).unwrap_or(i64::MAX));
    }

    /// The histogram of `idemgate_upstream_duration_seconds{upstream}`.
    pub fn upstream_duration(&self, upstream: &str) -> ShardedHistogram {
        self.upstream_duration
            .get_or_create(&UpstreamLabel {
                upstream: upstream.to_string(),
            })
            .clone()
    }

    /// Creates the `idemgate_observed_total` series of every observe route at 0 (a reload
    /// adds those of routes switched to observe; a series once created stays).
    pub fn init_observed(&self, config: &crate::config::Config) {
        for route in &config.routes {
            if route
                .idempotency
                .as_ref()
                .is_some_and(|i| i.mode == crate::config::Mode::Observe)
            {
                for outcome in observed::ALL {
                    let _created = self.observed.get_or_create(&RouteOutcome {
                        route: route.name.clone(),
                        outcome,
                    });
                }
            }
        }
    }

    /// The handles of `route`, made on first use and the same ever after (across reloads).
    pub fn route(&self, route: &str) -> Arc<RouteHandles> {
        if let Some(h) = self.per_route.read().expect("metrics lock").get(route) {
            return Arc::clone(h);
        }
        let mut all = self.per_route.write().expect("metrics lock");
        let h = all.entry(route.to_string()).or_insert_with(|| {
            let upstream = self
                .upstream_latency
                .get_or_create(&RouteLabel {
                    route: route.to_string(),
                })
                .clone();
            let (requests, durations) = (self.requests.clone(), self.request_duration.clone());
            Arc::new(RouteHandles::new(route, upstream, requests, durations))
        });
        Arc::clone(h)
    }

    /// Counts a request of `route` that ended with `outcome`, answered `status`.
    pub fn request(&self, route: &str, outcome: &'static str, status: u16) {
        self.route(route).request(outcome, status);
    }

    pub fn lease(&self, route: &str, event: &'static str) {
        self.leases
            .get_or_create(&RouteEvent {
                route: route.to_string(),
                event,
            })
            .inc();
    }

    pub fn upstream(&self, route: &str, took: Duration) {
        self.route(route).upstream(took);
    }

    /// Counts a reload: `ok` or `error`.
    pub fn reloaded(&self, ok: bool) {
        let result = RELOAD_RESULTS[usize::from(!ok)];
        self.reloads.get_or_create(&ResultLabel { result }).inc();
    }

    /// Counts a garbage collection: `Some(deleted)` when it ran, `None` when another
    /// instance held the lock; `Err` when it failed.
    pub fn collected(&self, run: Result<Option<u64>, ()>) {
        let result = match run {
            Ok(Some(deleted)) => {
                self.gc_rows.inc_by(deleted);
                "ok"
            }
            Ok(None) => "skipped",
            Err(()) => "error",
        };
        self.gc_runs.get_or_create(&ResultLabel { result }).inc();
    }

    /// The exposition in `format`.
    pub fn encode(&self, format: Format) -> String {
        use prometheus_client::encoding::text::{encode_eof, encode_registry};
        let mut out = String::new();
        let registry = self.registry.lock().expect("registry lock");
        encode_registry(&mut out, &registry).expect("writing to a String cannot fail");
        encode_registry(&mut out, &self.process).expect("writing to a String cannot fail");
        encode_eof(&mut out).expect("writing to a String cannot fail");
        match format {
            Format::OpenMetrics => out,
            Format::Text => openmetrics_to_text(&out),
        }
    }
}

#[cfg(test)]
mod tests;
