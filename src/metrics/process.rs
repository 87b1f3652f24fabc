//! The standard `process_*` series, read from `/proc/self` at every scrape (Linux; elsewhere
//! none is written): `process_cpu_seconds_total`, `process_resident_memory_bytes`,
//! `process_virtual_memory_bytes`, `process_open_fds`, `process_max_fds` and
//! `process_start_time_seconds`, named as the Prometheus client libraries name them.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, NoLabelSet};
use prometheus_client::metrics::MetricType;

/// Reads `/proc/self` when scraped.
#[derive(Debug)]
pub(super) struct ProcessCollector;

/// Clock ticks per second of `/proc/self/stat`'s times (`USER_HZ`: 100 on every Linux
/// architecture Rust targets).
const TICKS: f64 = 100.0;

/// What `/proc` says about this process now.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Reading {
    pub cpu_seconds: f64,
    pub resident_bytes: f64,
    pub virtual_bytes: f64,
    pub open_fds: f64,
    pub max_fds: f64,
    pub start_time: f64,
}

impl Reading {
    /// `None` where there is no `/proc/self` (not Linux).
    pub(super) fn now() -> Option<Reading> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // The fields after the command (in parentheses, which may hold spaces); the first
        // of these is field 3, `state`.
        let after = &stat[stat.rfind(')')? + 2..];
        let fields: Vec<&str> = after.split_whitespace().collect();
        let field = |n: usize| -> f64 {
            fields
                .get(n - 3)
                .and_then(|v| v.parse().ok())
                .unwrap_or(0.0)
        };
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find_map(|l| l.strip_prefix("btime "))
                    .and_then(|v| v.trim().parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        let max_fds = std::fs::read_to_string("/proc/self/limits")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("Max open files"))
                    .and_then(|l| l["Max open files".len()..].split_whitespace().next())
                    .and_then(|v| v.parse::<f64>().ok())
            })
            .unwrap_or(0.0);
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .map(|d| d.count() as f64)
            .unwrap_or(0.0);
        Some(Reading {
            // utime and stime, fields 14 and 15.
            cpu_seconds: (field(14) + field(15)) / TICKS,
            // vsize (bytes), field 23; rss (pages), field 24.
            virtual_bytes: field(23),
            resident_bytes: field(24) * page_size(),
            open_fds,
            max_fds,
            // starttime (ticks after boot), field 22.
            start_time: boot_time + field(22) / TICKS,
        })
    }
}

/// The page size, from the kernel's auxiliary vector as `/proc/self/auxv` holds it
/// (`AT_PAGESZ`, 6), else 4096.
fn page_size() -> f64 {
    static SIZE: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *SIZE.get_or_init(|| {
        let auxv = std::fs::read("/proc/self/auxv").unwrap_or_default();
        auxv.chunks_exact(16)
            .find_map(|pair| {
                let key = u64::from_ne_bytes(pair[..8].try_into().ok()?);
                let value = u64::from_ne_bytes(pair[8..].try_into().ok()?);
                (key == 6).then_some(value as f64)
            })
            .unwrap_or(4096.0)
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let Some(r) = Reading::now() else {
            return Ok(());
        };
        encoder
            .encode_descriptor(
                "process_cpu_seconds",
                "Total user and system CPU time spent in seconds",
                None,
                MetricType::Counter,
            )?
            .encode_counter::<NoLabelSet, _, f64>(&r.cpu_seconds, None)?;
        for (name, help, value) in [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                r.resident_bytes,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                r.virtual_bytes,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                r.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                r.max_fds,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                r.start_time,
            ),
        ] {
            encoder
                .encode_descriptor(name, help, None, MetricType::Gauge)?
                .encode_gauge(&value)?;
        }
        Ok(())
    }
}
