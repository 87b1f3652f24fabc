use super::*;
use crate::shard::SHARDS;

#[test]
fn the_text_format_names_counters_as_their_samples_and_has_no_eof() {
    let m = Metrics::new(&StoreMetrics::default());
    m.request("payments", outcome::REPLAYED, 200);
    m.wakeups_healthy.set(1);
    let open = m.encode(Format::OpenMetrics);
    assert!(
        open.contains("# TYPE idemgate_requests counter\n"),
        "{open}"
    );
    assert!(open.ends_with("# EOF\n"));
    let text = m.encode(Format::Text);
    assert!(
        text.contains("# HELP idemgate_requests_total Requests by route, outcome and the status class of the answer.\n"),
        "{text}"
    );
    assert!(text.contains("# TYPE idemgate_requests_total counter\n"));
    assert!(text.contains(
        "idemgate_requests_total{route=\"payments\",outcome=\"replayed\",status_class=\"2xx\"} 1\n"
    ));
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
                    h.request(outcomes[(t + i) % 3], 200);
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
            let series = format!(
                "idemgate_requests_total{{route=\"payments\",outcome=\"{o}\",status_class=\"2xx\"}} "
            );
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

#[test]
fn a_request_counts_under_its_outcome_and_status_class_and_its_duration_under_its_outcome() {
    let m = Metrics::new(&StoreMetrics::default());
    let h = m.route("payments");
    let ok = h.request(outcome::FORWARDED, 201);
    h.finished(ok, outcome::FORWARDED, Duration::from_millis(3));
    let failed = h.request(outcome::FORWARDED, 500);
    h.finished(failed, outcome::FORWARDED, Duration::from_millis(3));
    let failed = h.request(outcome::FORWARDED, 503);
    h.finished(failed, outcome::FORWARDED, Duration::from_secs(40));
    let tunneled = h.request(outcome::TUNNELED, 101);
    h.finished(tunneled, outcome::TUNNELED, Duration::from_millis(1));
    let text = m.encode(Format::Text);
    let series = |s: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(s)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {s} in:\n{text}"))
            .to_string()
    };
    let requests = "idemgate_requests_total{route=\"payments\",outcome=";
    assert_eq!(
        series(&format!("{requests}\"forwarded\",status_class=\"2xx\"}}")),
        "1"
    );
    assert_eq!(
        series(&format!("{requests}\"forwarded\",status_class=\"5xx\"}}")),
        "2"
    );
    assert_eq!(
        series(&format!("{requests}\"tunneled\",status_class=\"1xx\"}}")),
        "1"
    );
    let duration = "idemgate_request_duration_seconds";
    let forwarded = "route=\"payments\",outcome=\"forwarded\"";
    assert_eq!(series(&format!("{duration}_count{{{forwarded}}}")), "3");
    assert_eq!(
        series(&format!("{duration}_bucket{{le=\"0.0025\",{forwarded}}}")),
        "0"
    );
    assert_eq!(
        series(&format!("{duration}_bucket{{le=\"0.005\",{forwarded}}}")),
        "2"
    );
    assert_eq!(
        series(&format!("{duration}_bucket{{le=\"30.0\",{forwarded}}}")),
        "2"
    );
    assert_eq!(
        series(&format!("{duration}_bucket{{le=\"+Inf\",{forwarded}}}")),
        "3"
    );
    assert_eq!(
        series(&format!(
            "{duration}_count{{route=\"payments\",outcome=\"tunneled\"}}"
        )),
        "1"
    );
    // A class this route never answered has no series.
    assert!(!text.contains("outcome=\"forwarded\",status_class=\"3xx\""));
}

#[test]
fn every_series_an_alert_reads_exists_at_0_once_the_routes_are_configured() {
    let m = Metrics::new(&StoreMetrics::default());
    let yaml = |routes: &str| {
        format!(
            "listen: 127.0.0.1:0\nstore: {{ sqlite: {{ path: /tmp/unused.db }} }}\nupstreams:\n  app: {{ url: \"http://127.0.0.1:1\" }}\nroutes:\n{routes}"
        )
    };
    let keyed = "  - { name: payments, match: { path_prefix: /p }, upstream: app, idempotency: { scope: { header: X-Account } } }\n  - { name: plain, match: { path_prefix: /x }, upstream: app }\n";
    let config = crate::config::Config::from_yaml(&yaml(keyed)).unwrap();
    m.configure(&config);
    let text = m.encode(Format::Text);
    for event in LEASE_EVENTS {
        let series = format!("idemgate_leases_total{{route=\"payments\",event=\"{event}\"}} 0\n");
        assert!(text.contains(&series), "{series} in:\n{text}");
    }
    assert!(
        !text.contains("idemgate_leases_total{route=\"plain\""),
        "{text}"
    );
    for (route, outcome) in [
        ("payments", "store_unavailable"),
        ("payments", "outcome_unknown"),
        ("payments", "forwarded"),
        ("payments", "upstream_timeout"),
        ("plain", "proxied"),
        ("plain", "upstream_unavailable"),
    ] {
        let series = format!(
            "idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\",status_class=\"5xx\"}} 0\n"
        );
        assert!(text.contains(&series), "{series} in:\n{text}");
    }
    for result in ["ok", "error"] {
        assert!(text.contains(&format!(
            "idemgate_reloads_total{{result=\"{result}\"}} 0\n"
        )));
    }
    assert!(text.contains("idemgate_gc_rows_total 0\n"));
    assert!(text.contains("idemgate_upstream_duration_seconds_count{upstream=\"app\"} 0\n"));
    assert!(text.contains(&format!(
        "idemgate_build_info{{version=\"{}\"}} 1\n",
        env!("CARGO_PKG_VERSION")
    )));
    // A route added by a reload gets its series too; the counts so far stay.
    m.lease("payments", "taken_over");
    let more = format!(
        "{keyed}  - {{ name: orders, match: {{ path_prefix: /o }}, upstream: app, idempotency: {{ scope: {{ header: X-Account }} }} }}\n"
    );
    m.configure(&crate::config::Config::from_yaml(&yaml(&more)).unwrap());
    let text = m.encode(Format::Text);
    assert!(text.contains("idemgate_leases_total{route=\"orders\",event=\"taken_over\"} 0\n"));
    assert!(text.contains("idemgate_leases_total{route=\"payments\",event=\"taken_over\"} 1\n"));
}

#[test]
fn the_process_series_are_read_from_proc() {
    let m = Metrics::new(&StoreMetrics::default());
    let text = m.encode(Format::Text);
    if !std::path::Path::new("/proc/self/stat").exists() {
        assert!(!text.contains("process_"));
        return;
    }
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {name} in:\n{text}"))
            .parse()
            .unwrap()
    };
    assert!(text.contains("# TYPE process_cpu_seconds_total counter\n"));
    assert!(value("process_cpu_seconds_total") >= 0.0);
    assert!(value("process_resident_memory_bytes") > 0.0);
    assert!(value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes"));
    let open = value("process_open_fds");
    assert!(open >= 3.0 && open <= value("process_max_fds"), "{text}");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    let started = value("process_start_time_seconds");
    assert!(started > 1.0e9 && started <= now + 1.0, "{started}");
    // The open-metrics exposition ends once, after the process series.
    let open_metrics = m.encode(Format::OpenMetrics);
    assert_eq!(open_metrics.matches("# EOF").count(), 1);
    assert!(open_metrics.ends_with("# EOF\n"));
}
