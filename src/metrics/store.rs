//! Store-side metrics (`idemgate_store_*`), recorded by the stores and exposed with the rest.

use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;

use super::buckets::{batch_buckets, latency_buckets};
use super::labels::{OpLabel, StateLabel};

/// Store-side metrics, shared (cheap clones) between the store that records them and the
/// registry that exposes them.
#[derive(Clone)]
pub struct StoreMetrics {
    pub latency: Family<OpLabel, Histogram>,
    pub pool_wait: Histogram,
    pub pool: Family<StateLabel, Gauge>,
    pub batch: Family<OpLabel, Histogram>,
    /// Operations that failed, by operation (the same `op` names as `latency`).
    pub errors: Family<OpLabel, Counter>,
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
            errors: Family::default(),
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

    /// Records one operation: its latency, and an error if it failed.
    pub fn record<T, E>(&self, op: &'static str, took: Duration, result: &Result<T, E>) {
        self.observe(op, took);
        if result.is_err() {
            self.errors.get_or_create(&OpLabel { op }).inc();
        }
    }

    /// Runs one operation of the store and [`record`](Self::record)s it under `op`.
    pub async fn timed<T, E>(
        &self,
        op: &'static str,
        operation: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let started = std::time::Instant::now();
        let result = operation.await;
        self.record(op, started.elapsed(), &result);
        result
    }
}
