//! One route's request series, resolved once per route ([`RouteHandles`]): what a request
//! counts itself in without a lock, a map lookup or an allocation once its outcome and status
//! class have been seen on the route.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus_client::metrics::family::Family;

use super::labels::{RouteOutcome, RouteOutcomeClass, STATUS_CLASSES, status_class};
use super::sharded::{ShardedCounter, ShardedHistogram};

/// One route's request counters (by outcome and status class, filled on first use), its
/// request-duration histograms (by outcome) and its upstream latency histogram, resolved once
/// per route: `Routing` holds one per configured route, so a request counts without looking
/// its route up by name, and without a lock.
pub struct RouteHandles {
    /// The route's name (the label of its series, and the access line's `route`).
    pub name: Arc<str>,
    /// One slot per outcome this route has had, filled in the order they first came.
    outcomes: [OnceLock<OutcomeHandles>; OUTCOME_SLOTS],
    upstream: ShardedHistogram,
    /// `Metrics::requests`, for a class or outcome this route has not had yet.
    requests: Family<RouteOutcomeClass, ShardedCounter>,
    /// `Metrics::request_duration`, likewise.
    durations: Family<RouteOutcome, ShardedHistogram>,
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
    /// The handles of `route`: its upstream latency histogram, and the families its request
    /// series are made in.
    pub(super) fn new(
        route: &str,
        upstream: ShardedHistogram,
        requests: Family<RouteOutcomeClass, ShardedCounter>,
        durations: Family<RouteOutcome, ShardedHistogram>,
    ) -> RouteHandles {
        RouteHandles {
            name: Arc::from(route),
            outcomes: std::array::from_fn(|_| OnceLock::new()),
            upstream,
            requests,
            durations,
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
