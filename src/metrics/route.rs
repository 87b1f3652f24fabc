//! One route's request series, resolved once per route ([`RouteHandles`]): what a request
//! counts itself in without a lock, a map lookup or an allocation once its outcome and status
//! class have been seen on the route.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::family::Family;

use super::{
    Metrics, RouteLabel, RouteOutcome, RouteOutcomeClass, STATUS_CLASSES, ShardedCounter,
    ShardedHistogram, outcome, status_class,
};

/// One route's request counters (by outcome and status class, filled on first use), its
/// request-duration histograms (by outcome) and its upstream latency histogram, resolved once
/// per route: `Routing` holds one per configured route, so a request counts without looking
/// its route up by name, and without a lock.
pub struct RouteHandles {
    /// The route's name (the label of its series, and the access line's `route`).
    pub name: Arc<str>,
    /// One slot per outcome this route has had, filled in the order they first came.
    pub(super) outcomes: [OnceLock<OutcomeHandles>; OUTCOME_SLOTS],
    pub(super) upstream: ShardedHistogram,
    /// `Metrics::requests`, for a class or outcome this route has not had yet.
    pub(super) requests: Family<RouteOutcomeClass, ShardedCounter>,
    /// `Metrics::request_duration`, likewise.
    pub(super) durations: Family<RouteOutcome, ShardedHistogram>,
}

/// One outcome's series of one route: a counter per status class and the duration
/// histogram, each made on its first use.
pub(super) struct OutcomeHandles {
    outcome: &'static str,
    classes: [OnceLock<ShardedCounter>; STATUS_CLASSES.len()],
    duration: OnceLock<ShardedHistogram>,
}

/// More than there are outcome names (`outcome`); past them a count takes the family's lock.
const OUTCOME_SLOTS: usize = 32;

/// Which of its route's outcome slots a request was counted in (what
/// [`RouteHandles::finished`] observes its duration in without searching again).
#[derive(Clone, Copy, Debug)]
pub struct Counted(usize);

impl RouteHandles {
    pub(super) fn new(route: &str, metrics: &Metrics) -> RouteHandles {
        RouteHandles {
            name: Arc::from(route),
            outcomes: std::array::from_fn(|_| OnceLock::new()),
            upstream: metrics
                .upstream_latency
                .get_or_create(&RouteLabel {
                    route: route.to_string(),
                })
                .clone(),
            requests: metrics.requests.clone(),
            durations: metrics.request_duration.clone(),
        }
    }

    /// The slot of `outcome`, filled if it is new; `None` once every slot holds another.
    fn slot(&self, outcome: &'static str) -> Option<(usize, &OutcomeHandles)> {
        for (i, slot) in self.outcomes.iter().enumerate() {
            // A free slot is filled once; two threads filling it at once get the same value.
            let h = slot.get_or_init(|| OutcomeHandles {
                outcome,
                classes: std::array::from_fn(|_| OnceLock::new()),
                duration: OnceLock::new(),
            });
            // The names are constants: the same pointer, or a (short) comparison.
            if std::ptr::eq(h.outcome, outcome) || h.outcome == outcome {
                return Some((i, h));
            }
        }
        None
    }

    fn counter(&self, outcome: &'static str, class: usize) -> ShardedCounter {
        self.requests
            .get_or_create(&RouteOutcomeClass {
                route: self.name.to_string(),
                outcome,
                status_class: STATUS_CLASSES[class],
            })
            .clone()
    }

    fn histogram(&self, outcome: &'static str) -> ShardedHistogram {
        self.durations
            .get_or_create(&RouteOutcome {
                route: self.name.to_string(),
                outcome,
            })
            .clone()
    }

    /// Counts a request of this route that ended with `outcome`, answered `status`.
    pub fn request(&self, outcome: &'static str, status: u16) -> Counted {
        let class = status_class(status);
        match self.slot(outcome) {
            Some((i, h)) => {
                h.classes[class]
                    .get_or_init(|| self.counter(outcome, class))
                    .inc();
                Counted(i)
            }
            None => {
                self.counter(outcome, class).inc();
                Counted(usize::MAX)
            }
        }
    }

    /// Creates the series of `outcome` answered in `class` (an index in [`STATUS_CLASSES`])
    /// at 0, if it is not there yet.
    pub(super) fn create(&self, outcome: &'static str, class: usize) {
        match self.slot(outcome) {
            Some((_, h)) => {
                let _created = h.classes[class].get_or_init(|| self.counter(outcome, class));
            }
            None => {
                let _created = self.counter(outcome, class);
            }
        }
    }

    /// Observes how long a request counted as `counted` (with `outcome`) took, to the end of
    /// its response (what the access line's `duration_us` says).
    pub fn finished(&self, counted: Counted, outcome: &'static str, took: Duration) {
        let secs = took.as_secs_f64();
        match self.outcomes.get(counted.0).and_then(|s| s.get()) {
            Some(h) if h.outcome == outcome => {
                h.duration
                    .get_or_init(|| self.histogram(outcome))
                    .observe(secs);
            }
            _ => self.histogram(outcome).observe(secs),
        }
    }

    /// Observes how long this route's upstream took to answer.
    pub fn upstream(&self, took: Duration) {
        self.upstream.observe(took.as_secs_f64());
    }
}

/// The request series the shipped alerts read (deploy/prometheus/alerts.yml), created at 0
/// for every route (`keyed`: for every keyed route) so that a rate over a series' first
/// increase is not lost: (outcome, status class index).
pub(super) const ALERTED: [(&str, usize); 5] = [
    (outcome::PROXIED, 4),
    (outcome::UPSTREAM_UNAVAILABLE, 4),
    (outcome::UPSTREAM_TIMEOUT, 4),
    (outcome::INTERNAL, 4),
    (outcome::OVERLOADED, 4),
];
pub(super) const ALERTED_KEYED: [(&str, usize); 10] = [
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
