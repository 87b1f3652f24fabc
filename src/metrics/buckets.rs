//! The bucket bounds of the histograms: latency (100 µs to about 52 s), request and upstream
//! duration (1 ms to 30 s), keys per batched statement (1 to 256).

use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};

use super::sharded::ShardedHistogram;

/// Latency bucket bounds: 100 µs to about 52 s.
pub(super) fn latency_bounds() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.0, 20)
}

pub(super) fn latency_buckets() -> Histogram {
    Histogram::new(latency_bounds())
}

pub(super) fn route_latency_buckets() -> ShardedHistogram {
    ShardedHistogram::new(latency_bounds())
}

/// Request and upstream duration bucket bounds for a proxy: 1 ms to 30 s.
const DURATION_BOUNDS: [f64; 15] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0,
];

pub(super) fn duration_buckets() -> ShardedHistogram {
    ShardedHistogram::new(DURATION_BOUNDS)
}

pub(super) fn batch_buckets() -> Histogram {
    // 1 to 256 keys per statement.
    Histogram::new(exponential_buckets(1.0, 2.0, 9))
}
