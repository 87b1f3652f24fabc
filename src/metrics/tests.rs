use super::*;
use crate::shard::SHARDS;

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
    assert!(text.contains("idemgate_requests_total{route=\"payments\",outcome=\"replayed\"} 1\n"));
    assert!(text.contains("# TYPE idemgate_wakeups_healthy gauge\nidemgate_wakeups_healthy 1\n"));
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
            let series = format!("idemgate_requests_total{{route=\"payments\",outcome=\"{o}\"}} ");
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
