//! Counters and histograms kept in one cell per shard (`shard.rs`) and summed when read or
//! scraped: the series every request writes, so that the runtime's workers do not pass one
//! cache line between their cores at every request.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};

use crate::shard::{Padded, SHARDS};

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
