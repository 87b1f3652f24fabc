//! Prometheus metrics (`GET /metrics` on `admin.listen`), with prometheus-client.
//!
//! Every name starts with `idemgate_`; counters get `_total` from the library. Label values
//! are bounded: route names (from the config) and fixed outcome, event and operation names;
//! never keys, scopes or anything a client sends.
//!
//! - `idemgate_requests_total{route, outcome}`: every request, by what happened to it (see
//!   [`outcome`] for the names).
//! - `idemgate_leases_total{route, event}`: `taken_over` (an expired lease was taken over:
//!   a possible double) and `lost` (our write found the lease taken; not recorded).
//! - `idemgate_upstream_latency_seconds{route}`: from sending the request to the whole
//!   response (keyed) or its head (pass-through).
//! - `idemgate_store_latency_seconds{op}` and `idemgate_store_pool_wait_seconds`: recorded
//!   by the store. `idemgate_store_batch_keys{op}`: keys per statement of the Postgres
//!   store's batched claims (`claim_new`) and completions (`finish`); its count is the
//!   statements, its sum the keys.
//! - `idemgate_forwards_in_flight`, `idemgate_store_pool_connections{state}`,
//!   `idemgate_replay_cache_bytes`, `idemgate_wakeups_healthy`: gauges read at scrape time.
//! - `idemgate_upstream_in_flight{upstream}` and `idemgate_buffered_bytes`: the admission
//!   bounds' gauges (docs/contract.md §8.2); `idemgate_overloaded_total{upstream, bound}`
//!   counts the refusals, `bound` being `max_in_flight` or `max_buffered_bytes`.
//! - `idemgate_leases_total{route, event="force_deleted"}`: an operator deleted a key under
//!   a live lease (a possible double, like `taken_over`).
//! - `idemgate_observed_total{route, outcome}`: on `mode: observe` routes, what enforcing
//!   would have done with a request that was forwarded instead (see [`observed`]). The
//!   three series of every observe route exist from the start (at 0), so a rate reads 0,
//!   not "no data", on a route that has seen no duplicate yet.
//!
//! The two series every request writes (`idemgate_requests_total` and
//! `idemgate_upstream_latency_seconds`) are kept per thread ([`ShardedCounter`],
//! [`ShardedHistogram`], `shard.rs`) and summed when scraped: the runtime's workers do not pass
//! one counter's cache line between their cores at every request.
//!
//! `/metrics` answers OpenMetrics to a scraper that asks for it (Prometheus does) and the
//! older text format to anyone else; `promtool check metrics` lints the latter in CI.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use crate::shard::{Padded, SHARDS};

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

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteOutcome {
    pub route: String,
    pub outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteEvent {
    pub route: String,
    pub event: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamLabel {
    pub upstream: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct UpstreamBound {
    pub upstream: String,
    pub bound: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OpLabel {
    pub op: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct StateLabel {
    pub state: &'static str,
}

/// Latency bucket bounds: 100 µs to about 52 s.
fn latency_bounds() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.0, 20)
}

fn latency_buckets() -> Histogram {
    Histogram::new(latency_bounds())
}

fn route_latency_buckets() -> ShardedHistogram {
    ShardedHistogram::new(latency_bounds())
}

/// A counter kept in one cell per shard (`shard.rs`), summed when read or scraped.
#[derive(Clone, Debug, Default)]
pub struct ShardedCounter(Arc<[Padded<AtomicU64>; SHARDS]>);

impl ShardedCounter {
    pub fn inc(&self) {
        self.0[crate::shard::own()]
            .0
            .fetch_add(1, Ordering::Relaxed);
    }

    /// The count: the sum of the shards.
    pub fn get(&self) -> u64 {
        self.0.iter().map(|c| c.0.load(Ordering::Relaxed)).sum()
    }
}

impl TypedMetric for ShardedCounter {
    const TYPE: MetricType = MetricType::Counter;
}

impl EncodeMetric for ShardedCounter {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_counter::<NoLabelSet, _, u64>(&self.get(), None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A histogram kept in one set of cells per shard (`shard.rs`), summed when scraped. A scrape
/// may see an observation's count before its sum (each cell is exact on its own; the
/// exposition of a histogram is not one atomic reading in any case).
#[derive(Clone, Debug)]
pub struct ShardedHistogram(Arc<HistogramCells>);

#[derive(Debug)]
struct HistogramCells {
    /// Upper bounds, the last one `+Inf`.
    bounds: Vec<f64>,
    shards: [Padded<HistogramShard>; SHARDS],
}

#[derive(Debug, Default)]
struct HistogramShard {
    count: AtomicU64,
    /// An `f64`'s bits.
    sum: AtomicU64,
    /// One per bound: the observations that fell in that bucket (not cumulative).
    buckets: Vec<AtomicU64>,
}

impl ShardedHistogram {
    pub fn new(bounds: impl IntoIterator<Item = f64>) -> ShardedHistogram {
        let mut bounds: Vec<f64> = bounds.into_iter().collect();
        bounds.push(f64::INFINITY);
        let shards = std::array::from_fn(|_| {
            Padded(HistogramShard {
                buckets: bounds.iter().map(|_| AtomicU64::new(0)).collect(),
                ..HistogramShard::default()
            })
        });
        ShardedHistogram(Arc::new(HistogramCells { bounds, shards }))
    }

    pub fn observe(&self, v: f64) {
        let cells = &*self.0;
        let shard = &cells.shards[crate::shard::own()].0;
        // NaN falls in the last bucket, as in prometheus-client.
        let bucket = cells
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(cells.bounds.len() - 1);
        shard.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        // Only this thread writes its shard's sum: no retry in practice.
        let _ = shard
            .sum
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bits| {
                Some((f64::from_bits(bits) + v).to_bits())
            });
        shard.count.fetch_add(1, Ordering::Relaxed);
    }

    /// Sum, count and the per-bucket counts, over the shards.
    fn totals(&self) -> (f64, u64, Vec<(f64, u64)>) {
        let cells = &*self.0;
        let mut buckets: Vec<(f64, u64)> = cells.bounds.iter().map(|b| (*b, 0)).collect();
        let (mut sum, mut count) = (0.0, 0);
        for shard in &cells.shards {
            let shard = &shard.0;
            count += shard.count.load(Ordering::Relaxed);
            sum += f64::from_bits(shard.sum.load(Ordering::Relaxed));
            for (total, cell) in buckets.iter_mut().zip(&shard.buckets) {
                total.1 += cell.load(Ordering::Relaxed);
            }
        }
        (sum, count, buckets)
    }
}

impl TypedMetric for ShardedHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for ShardedHistogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let (sum, count, buckets) = self.totals();
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

fn batch_buckets() -> Histogram {
    // 1 to 256 keys per statement.
    Histogram::new(exponential_buckets(1.0, 2.0, 9))
}

/// Store-side metrics, shared (cheap clones) between the store that records them and the
/// registry that exposes them.
#[derive(Clone)]
pub struct StoreMetrics {
    pub latency: Family<OpLabel, Histogram>,
    pub pool_wait: Histogram,
    pub pool: Family<StateLabel, Gauge>,
    pub batch: Family<OpLabel, Histogram>,
    /// Streaming standbys of the database that are not synchronous (found at start).
    pub async_standbys: Gauge,
}

impl Default for StoreMetrics {
    fn default() -> Self {
        StoreMetrics {
            latency: Family::new_with_constructor(latency_buckets),
            pool_wait: latency_buckets(),
            pool: Family::default(),
            batch: Family::new_with_constructor(batch_buckets),
            async_standbys: Gauge::default(),
        }
    }
}

impl StoreMetrics {
    /// One statement of a batched operation carried `keys` keys.
    pub fn batch(&self, op: &'static str, keys: usize) {
        self.batch
            .get_or_create(&OpLabel { op })
            .observe(keys as f64);
    }

    pub fn observe(&self, op: &'static str, took: Duration) {
        self.latency
            .get_or_create(&OpLabel { op })
            .observe(took.as_secs_f64());
    }
}

/// Every metric of a gateway process.
pub struct Metrics {
    registry: Mutex<Registry>,
    pub requests: Family<RouteOutcome, ShardedCounter>,
    pub leases: Family<RouteEvent, Counter>,
    pub upstream_latency: Family<RouteLabel, ShardedHistogram>,
    pub forwards_in_flight: Gauge,
    pub replay_cache_bytes: Gauge,
    pub wakeups_healthy: Gauge,
    pub upstream_in_flight: Family<UpstreamLabel, Gauge>,
    pub buffered_bytes: Gauge,
    pub overloaded: Family<UpstreamBound, Counter>,
    pub observed: Family<RouteOutcome, Counter>,
    /// Handles resolved once per route, so a request costs no label allocation or hashing
    /// of an owned label set (the families above stay the source of truth).
    per_route: std::sync::RwLock<std::collections::HashMap<String, Arc<RouteHandles>>>,
}

/// One route's request counters (by outcome, filled on first use) and latency histogram,
/// resolved once per route: `Routing` holds one per configured route, so a request counts
/// without looking its route up by name, and without a lock.
pub struct RouteHandles {
    /// The route's name (the label of its series, and the access line's `route`).
    pub name: Arc<str>,
    /// One slot per outcome this route has had, filled in the order they first came.
    outcomes: [OnceLock<(&'static str, ShardedCounter)>; OUTCOME_SLOTS],
    upstream: ShardedHistogram,
    /// `Metrics::requests`, for an outcome this route has not had yet.
    requests: Family<RouteOutcome, ShardedCounter>,
}

/// More than there are outcome names (`outcome`); past them a count takes the family's lock.
const OUTCOME_SLOTS: usize = 32;

impl RouteHandles {
    /// Counts a request of this route that ended with `outcome`.
    pub fn request(&self, outcome: &'static str) {
        let counter = || {
            self.requests
                .get_or_create(&RouteOutcome {
                    route: self.name.to_string(),
                    outcome,
                })
                .clone()
        };
        for slot in &self.outcomes {
            // A free slot is filled once; two threads filling it at once get the same value.
            let (name, c) = slot.get_or_init(|| (outcome, counter()));
            if *name == outcome {
                c.inc();
                return;
            }
        }
        counter().inc();
    }

    /// Observes how long this route's upstream took to answer.
    pub fn upstream(&self, took: Duration) {
        self.upstream.observe(took.as_secs_f64());
    }
}

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
        let requests = Family::<RouteOutcome, ShardedCounter>::default();
        let leases = Family::<RouteEvent, Counter>::default();
        let upstream_latency =
            Family::<RouteLabel, ShardedHistogram>::new_with_constructor(route_latency_buckets);
        let forwards_in_flight = Gauge::default();
        let replay_cache_bytes = Gauge::default();
        let wakeups_healthy = Gauge::default();
        let upstream_in_flight = Family::<UpstreamLabel, Gauge>::default();
        let buffered_bytes = Gauge::default();
        let overloaded = Family::<UpstreamBound, Counter>::default();
        let observed = Family::<RouteOutcome, Counter>::default();
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
            "Requests by route and outcome",
            requests.clone(),
        );
        registry.register(
            "leases",
            "Lease events by route: taken_over (possible double), lost (not recorded)",
            leases.clone(),
        );
        registry.register(
            "upstream_latency_seconds",
            "Upstream latency by route",
            upstream_latency.clone(),
        );
        registry.register(
            "store_latency_seconds",
            "Store operation latency by operation",
            store.latency.clone(),
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
        Metrics {
            registry: Mutex::new(registry),
            requests,
            leases,
            upstream_latency,
            forwards_in_flight,
            replay_cache_bytes,
            wakeups_healthy,
            upstream_in_flight,
            buffered_bytes,
            overloaded,
            observed,
            per_route: Default::default(),
        }
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
            Arc::new(RouteHandles {
                name: Arc::from(route),
                outcomes: std::array::from_fn(|_| OnceLock::new()),
                upstream: self
                    .upstream_latency
                    .get_or_create(&RouteLabel {
                        route: route.to_string(),
                    })
                    .clone(),
                requests: self.requests.clone(),
            })
        });
        Arc::clone(h)
    }

    pub fn request(&self, route: &str, outcome: &'static str) {
        self.route(route).request(outcome);
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

    /// The exposition in `format`.
    pub fn encode(&self, format: Format) -> String {
        let mut out = String::new();
        let registry = self.registry.lock().expect("registry lock");
        prometheus_client::encoding::text::encode(&mut out, &registry)
            .expect("writing to a String cannot fail");
        match format {
            Format::OpenMetrics => out,
            Format::Text => openmetrics_to_text(&out),
        }
    }
}

/// The two exposition formats of `GET /metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0: what Prometheus asks for first.
    OpenMetrics,
    /// The Prometheus text format 0.0.4: for whoever does not ask for OpenMetrics (curl,
    /// older scrapers, and `promtool check metrics`, which reads only this one).
    Text,
}

impl Format {
    /// OpenMetrics when the `Accept` header names it, else the text format (the Go
    /// client's rule).
    pub fn negotiate(accept: Option<&str>) -> Format {
        match accept {
            Some(a) if a.contains("application/openmetrics-text") => Format::OpenMetrics,
            _ => Format::Text,
        }
    }

    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }
}

/// OpenMetrics text as the 0.0.4 text format: the samples are the same; a counter's `HELP`
/// and `TYPE` lines name it as its samples do (`_total`), and there is no `# EOF` (nor
/// `# UNIT`, which this registry never writes).
fn openmetrics_to_text(open: &str) -> String {
    let counters: std::collections::HashSet<&str> = open
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(open.len());
    for line in open.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "]
            .into_iter()
            .find_map(|p| line.strip_prefix(p).map(|rest| (p, rest)));
        match meta {
            Some((prefix, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let total = if counters.contains(name) {
                    "_total"
                } else {
                    ""
                };
                out.push_str(&format!("{prefix}{name}{total} {tail}"));
            }
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_text_format_names_counters_as_their_samples_and_has_no_eof() {
        let m = Metrics::new(&StoreMetrics::default());
        m.request("payments", outcome::REPLAYED);
        m.wakeups_healthy.set(1);
        let open = m.encode(Format::OpenMetrics);
        assert!(
            open.contains("# TYPE idemgate_requests counter\n"),
            "{open}"
        );
        assert!(open.ends_with("# EOF\n"));
        let text = m.encode(Format::Text);
        assert!(
            text.contains("# HELP idemgate_requests_total Requests by route and outcome.\n"),
            "{text}"
        );
        assert!(text.contains("# TYPE idemgate_requests_total counter\n"));
        assert!(
            text.contains("idemgate_requests_total{route=\"payments\",outcome=\"replayed\"} 1\n")
        );
        assert!(
            text.contains("# TYPE idemgate_wakeups_healthy gauge\nidemgate_wakeups_healthy 1\n")
        );
        assert!(!text.contains("# EOF"));
    }

    #[test]
    fn counts_from_many_threads_at_once_are_exact_in_the_exposition() {
        let m = Arc::new(Metrics::new(&StoreMetrics::default()));
        let h = m.route("payments");
        let outcomes = [outcome::PROXIED, outcome::REPLAYED, outcome::FORWARDED];
        // More threads than shards, so that some share one.
        let threads: Vec<_> = (0..SHARDS + 4)
            .map(|t| {
                let h = Arc::clone(&h);
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        h.request(outcomes[(t + i) % 3]);
                        // 1 ms, in the bucket up to 1.6 ms.
                        h.upstream(Duration::from_millis(1));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let total = (SHARDS + 4) * 1000;
        let text = m.encode(Format::Text);
        let counted: u64 = outcomes
            .iter()
            .map(|o| {
                let series =
                    format!("idemgate_requests_total{{route=\"payments\",outcome=\"{o}\"}} ");
                let line = text.lines().find(|l| l.starts_with(&series)).unwrap();
                line[series.len()..].parse::<u64>().unwrap()
            })
            .sum();
        assert_eq!(counted, total as u64);
        assert!(text.contains(&format!(
            "idemgate_upstream_latency_seconds_count{{route=\"payments\"}} {total}\n"
        )));
        assert!(text.contains(
            "idemgate_upstream_latency_seconds_bucket{le=\"0.0008\",route=\"payments\"} 0\n"
        ));
        assert!(text.contains(&format!(
            "idemgate_upstream_latency_seconds_bucket{{le=\"0.0016\",route=\"payments\"}} {total}\n"
        )));
        let sum_line = text
            .lines()
            .find(|l| l.starts_with("idemgate_upstream_latency_seconds_sum{route=\"payments\"} "))
            .unwrap();
        let sum: f64 = sum_line.rsplit(' ').next().unwrap().parse().unwrap();
        assert!((sum - total as f64 * 0.001).abs() < 1e-6, "{sum_line}");
    }

    #[test]
    fn openmetrics_only_when_asked_for() {
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prometheus)), Format::OpenMetrics);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Text);
        assert_eq!(Format::negotiate(None), Format::Text);
    }
}
