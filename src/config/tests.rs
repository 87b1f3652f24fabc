use std::time::Duration;

use super::*;

const MINIMAL: &str = r#"
store: { postgres: { url: "postgres://u@localhost/db" } }
upstreams: { app: { url: "http://127.0.0.1:9000", timeout: 30s } }
routes:
  - name: r
    match: { path_prefix: / }
    upstream: app
    idempotency: {}
"#;

fn err(yaml: &str) -> String {
    Config::from_yaml_with_env(yaml, &|_| None)
        .unwrap_err()
        .to_string()
}

#[test]
fn minimal_config_gets_defaults() {
    let c = Config::from_yaml(MINIMAL).unwrap();
    let idem = c.routes[0].idempotency.as_ref().unwrap();
    assert_eq!(idem.lease, Duration::from_secs(45));
    assert_eq!(idem.ttl, Duration::from_secs(86400));
    assert_eq!(idem.methods, vec![Method::POST, Method::PATCH]);
    assert!(idem.retry_statuses.contains(503));
    assert!(idem.retry_statuses.contains(429));
    assert!(!idem.retry_statuses.contains(404));
    assert_eq!(c.listen.to_string(), "0.0.0.0:8080");
}

#[test]
fn batch_keys_defaults_to_32_and_is_bounded() {
    let c = Config::from_yaml(MINIMAL).unwrap();
    let StoreConfig::Postgres(pg) = &c.store else {
        panic!("a postgres store: {:?}", c.store)
    };
    assert_eq!(pg.batch_keys, 32);
    for (value, ok) in [("0", false), ("1", true), ("1000", true), ("1001", false)] {
        let yaml = MINIMAL.replace(
            r#"url: "postgres://u@localhost/db" }"#,
            &format!(r#"url: "postgres://u@localhost/db", batch_keys: {value} }}"#),
        );
        match Config::from_yaml(&yaml) {
            Ok(c) => {
                assert!(ok, "batch_keys {value} was accepted");
                let StoreConfig::Postgres(pg) = &c.store else {
                    panic!("a postgres store")
                };
                assert_eq!(pg.batch_keys.to_string(), value);
            }
            Err(e) => {
                assert!(!ok, "batch_keys {value} was refused: {e}");
                assert_eq!(
                    e.to_string(),
                    "store.postgres.batch_keys: must be from 1 to 1000"
                );
            }
        }
    }
}

#[test]
fn lease_not_longer_than_timeout_names_the_path() {
    let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { lease: 30s }");
    assert_eq!(
        err(&yaml),
        "routes[0].idempotency.lease: must be longer than upstream 'app' timeout (30s)"
    );
}

#[test]
fn a_lease_short_of_the_record_bound_names_the_store_settings_that_make_it() {
    let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { lease: 31s }");
    assert_eq!(
        err(&yaml),
        "routes[0].idempotency.lease: must be longer than upstream 'app' timeout (30s) plus the \
         time to record the answer (the store's acquire_timeout + statement_timeout = 2500ms)"
    );
    let embedded = yaml.replace(
        r#"postgres: { url: "postgres://u@localhost/db" }"#,
        "sqlite: { path: /var/lib/idemgate/keys.db }",
    );
    assert_eq!(
        err(&embedded),
        "routes[0].idempotency.lease: must be longer than upstream 'app' timeout (30s) plus the \
         time to record the answer (the store's busy_timeout + 500ms = 2500ms)"
    );
}

/// With `serialize`, a slot is asked for only while the lease has room for the slot's store
/// call, the forward and the recording: a lease that passed a check counting one store call
/// left no wait at all (every request 409) once the store's timeouts were long.
#[test]
fn a_serialized_lease_leaves_room_for_the_slot_call_and_the_recording() {
    let with = |lease: &str| {
        MINIMAL.replace(
            "idempotency: {}",
            &format!("idempotency: {{ lease: {lease}, serialize: {{ wait_timeout: 10s }} }}"),
        )
    };
    // 30s + 10s + 2 x 2500ms.
    assert_eq!(
        err(&with("45s")),
        "routes[0].idempotency.lease: must be longer than upstream 'app' timeout (30s) plus \
         serialize.wait_timeout (10s) plus twice the time of one store call (the store's \
         acquire_timeout + statement_timeout = 2500ms: the slot's, then the recording's): the \
         claim is held while a slot is awaited"
    );
    let c = Config::from_yaml_with_env(&with("46s"), &|_| None).expect("room for both calls");
    let idem = c.routes[0].idempotency.as_ref().unwrap();
    assert_eq!(idem.lease, Duration::from_secs(46));
    // The default lease (timeout + 15s + wait_timeout) has that room with the default store
    // timeouts.
    let default = MINIMAL.replace(
        "idempotency: {}",
        "idempotency: { serialize: { wait_timeout: 10s } }",
    );
    assert!(Config::from_yaml_with_env(&default, &|_| None).is_ok());
    // With long store timeouts the default grows to fit (a default the check refused would
    // blame a field nobody set): 30s + 10s + 2 x (3s + 5s) + 5s.
    let slow_store = default.replace(
        r#"postgres: { url: "postgres://u@localhost/db" }"#,
        r#"postgres: { url: "postgres://u@localhost/db", acquire_timeout: 3s, statement_timeout: 5s }"#,
    );
    let c = Config::from_yaml_with_env(&slow_store, &|_| None).expect("the default lease fits");
    let idem = c.routes[0].idempotency.as_ref().unwrap();
    assert_eq!(idem.lease, Duration::from_secs(61));
}

#[test]
fn a_url_error_names_its_field_once() {
    let yaml = MINIMAL.replace(
        "postgres://u@localhost/db",
        "postgres://u@localhost/db?sslrootcert=%2Fca.pem",
    );
    assert_eq!(
        err(&yaml),
        "store.postgres.url: sslrootcert needs sslmode=verify-full (or verify-ca)"
    );
}

#[test]
fn a_listen_url_says_what_the_url_says_of_tls_or_nothing() {
    let with = |url: &str, listen: &str| {
        MINIMAL.replace(
            r#"postgres: { url: "postgres://u@localhost/db" }"#,
            &format!(r#"postgres: {{ url: "{url}", listen_url: "{listen}" }}"#),
        )
    };
    let yaml = with(
        "postgres://u@db/x?sslmode=require",
        "postgres://u@pg/x?sslmode=disable",
    );
    assert_eq!(
        err(&yaml),
        "store.postgres.listen_url: sslmode=disable contradicts store.postgres.url's sslmode: \
         require; say it in one place"
    );
    let yaml = with(
        "postgres://u@db/x?sslmode=verify-full",
        "postgres://u@pg/x?sslrootcert=%2Fca.pem",
    );
    assert!(
        err(&yaml).starts_with("store.postgres.listen_url: sslrootcert here alone is not used"),
        "{}",
        err(&yaml)
    );
    // Repeating what `url` says, or saying nothing, is fine.
    for listen in ["postgres://u@pg/x?sslmode=require", "postgres://u@pg/x"] {
        Config::from_yaml(&with("postgres://u@db/x?sslmode=require", listen)).unwrap();
    }
}

#[test]
fn the_database_url_never_reaches_debug_output() {
    let c = Config::from_yaml(&MINIMAL.replace(
        "postgres://u@localhost/db",
        "postgres://u:hunter2@localhost/db",
    ))
    .unwrap();
    let text = format!("{c:?}");
    assert!(!text.contains("hunter2"), "{text}");
    assert!(text.contains("<redacted>"));
}

#[test]
fn reload_decisions_compare_values() {
    let a = Config::from_yaml(MINIMAL).unwrap();
    let b = Config::from_yaml(MINIMAL).unwrap();
    assert_eq!(a, b);
    let c = Config::from_yaml(&MINIMAL.replace("timeout: 30s", "timeout: 29s")).unwrap();
    assert_ne!(a.upstreams, c.upstreams);
}

#[test]
fn yield_on_wake_is_accepted_and_no_longer_read() {
    let retired = "server.yield_on_wake is no longer read; remove it";
    let plain = Config::from_yaml(MINIMAL).unwrap().warnings();
    assert!(!plain.iter().any(|w| w == retired), "{plain:?}");
    let yaml = format!("server: {{ yield_on_wake: false }}\n{MINIMAL}");
    let warned = Config::from_yaml(&yaml).unwrap().warnings();
    assert!(warned.iter().any(|w| w == retired), "{warned:?}");
}

#[test]
fn the_runtime_is_a_thread_per_core_unless_asked_otherwise() {
    let c = Config::from_yaml(MINIMAL).unwrap();
    assert_eq!(c.server.runtime, RuntimeLayout::ThreadPerCore);
    let yaml = format!("server: {{ runtime: work_stealing }}\n{MINIMAL}");
    let c = Config::from_yaml(&yaml).unwrap();
    assert_eq!(c.server.runtime, RuntimeLayout::WorkStealing);
    let e = err(&format!("server: {{ runtime: per_core }}\n{MINIMAL}"));
    assert!(
            e.starts_with("server.runtime: unknown variant `per_core`, expected `thread_per_core` or `work_stealing`"),
            "{e}"
        );
}

#[test]
fn unknown_fields_name_their_path() {
    let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { leese: 30s }");
    let e = err(&yaml);
    assert!(
        e.starts_with("routes[0].idempotency.leese: unknown field `leese`, expected one of"),
        "{e}"
    );
}

#[test]
fn tls_files_that_do_not_exist_are_named() {
    let yaml = format!(
        "{MINIMAL}server: {{ tls: {{ cert: /nonexistent/gw.pem, key: /nonexistent/gw.key }} }}\n"
    );
    let e = err(&yaml);
    assert!(
        e.starts_with("server.tls: cannot read certificates from /nonexistent/gw.pem"),
        "{e}"
    );
    let yaml = MINIMAL.replace(
        "url: \"http://127.0.0.1:9000\", timeout: 30s",
        "url: \"http://127.0.0.1:9000\", timeout: 30s, tls: { ca: /x.pem }",
    );
    assert_eq!(
        err(&yaml),
        "upstreams.app.tls.ca: only an https:// upstream uses a CA"
    );
}

#[test]
fn env_vars_are_interpolated_and_unset_ones_are_named() {
    let yaml = MINIMAL.replace("postgres://u@localhost/db", "${DB_URL}");
    let c = Config::from_yaml_with_env(&yaml, &|n| {
        (n == "DB_URL").then(|| "postgres://x@h/d".to_string())
    })
    .unwrap();
    let StoreConfig::Postgres(pg) = &c.store else {
        panic!("a postgres store")
    };
    assert_eq!(pg.url, "postgres://x@h/d");
    assert_eq!(
        err(&yaml),
        "store.postgres.url: environment variable DB_URL is not set"
    );
}

#[test]
fn async_commit_is_refused_unless_the_config_allows_it() {
    let allowed = |yaml: &str| match Config::from_yaml(yaml).unwrap().store {
        StoreConfig::Postgres(pg) => pg.allow_async_commit,
        StoreConfig::Sqlite(_) => panic!("a postgres store"),
    };
    assert!(!allowed(MINIMAL), "off by default");
    let yaml = MINIMAL.replace(
        "url: \"postgres://u@localhost/db\"",
        "url: \"postgres://u@localhost/db\", allow_async_commit: true",
    );
    assert!(allowed(&yaml));
}

#[test]
fn a_pooler_in_transaction_mode_and_a_listen_url_are_read_and_checked() {
    let pg = |yaml: &str| match Config::from_yaml(yaml).unwrap().store {
        StoreConfig::Postgres(pg) => pg,
        StoreConfig::Sqlite(_) => panic!("a postgres store"),
    };
    let plain = pg(MINIMAL);
    assert_eq!(
        plain.pooler, None,
        "learned from the first connection by default"
    );
    assert_eq!(plain.listen_url, plain.url, "listen_url defaults to url");
    let pooled = pg(&MINIMAL.replace(
        "url: \"postgres://u@localhost/db\"",
        "url: \"postgres://u@bouncer:6432/db\", pooler: transaction, \
             listen_url: \"postgres://u@db:5432/db\"",
    ));
    assert_eq!(pooled.pooler, Some(Pooler::Transaction));
    assert_eq!(pooled.url, "postgres://u@bouncer:6432/db");
    assert_eq!(pooled.listen_url, "postgres://u@db:5432/db");
    assert_eq!(
        err(&MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@localhost/db\", pooler: session"
        )),
        "store.postgres.pooler: 'session' is not one of none, transaction"
    );
    assert!(
        err(&MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            "url: \"postgres://u@localhost/db\", listen_url: \"postgres://u@h:x/db\""
        ))
        .starts_with("store.postgres.listen_url: not a valid PostgreSQL connection string"),
        "the listen URL is checked like the URL, and never echoed"
    );
    let warned = |yaml: &str| {
        Config::from_yaml(yaml)
            .unwrap()
            .warnings()
            .iter()
            .any(|w| w.contains("listen_url is not set"))
    };
    let without_listen = MINIMAL.replace(
        "url: \"postgres://u@localhost/db\"",
        "url: \"postgres://u@bouncer:6432/db\", pooler: transaction",
    );
    assert_ne!(without_listen, MINIMAL);
    assert!(warned(&without_listen), "a pooled listener is warned about");
    assert!(!warned(MINIMAL), "a direct session is not");
}

#[test]
fn status_ranges_parse() {
    let yaml = MINIMAL.replace(
        "idempotency: {}",
        "idempotency: { retry_statuses: [409, 500-502] }",
    );
    let c = Config::from_yaml(&yaml).unwrap();
    let s = &c.routes[0].idempotency.as_ref().unwrap().retry_statuses;
    assert!(s.contains(409) && s.contains(501) && !s.contains(503) && !s.contains(500 - 1));
    let yaml = MINIMAL.replace("idempotency: {}", "idempotency: { retry_statuses: [600] }");
    assert!(err(&yaml).contains("routes[0].idempotency.retry_statuses[0]: 600"));
}

#[test]
fn mode_is_enforce_unless_the_route_says_observe() {
    let mode = |yaml: &str| {
        Config::from_yaml(yaml).unwrap().routes[0]
            .idempotency
            .as_ref()
            .unwrap()
            .mode
    };
    assert_eq!(mode(MINIMAL), Mode::Enforce);
    let observe = MINIMAL.replace("idempotency: {}", "idempotency: { mode: observe }");
    assert_eq!(mode(&observe), Mode::Observe);
    let bad = MINIMAL.replace("idempotency: {}", "idempotency: { mode: shadow }");
    let e = err(&bad);
    assert!(
        e.starts_with(
            "routes[0].idempotency.mode: unknown variant `shadow`, expected `enforce` or `observe`"
        ),
        "{e}"
    );
}

#[test]
fn drain_delay_defaults_to_zero_and_may_be_zero() {
    let delay = |yaml: &str| Config::from_yaml(yaml).unwrap().server.drain_delay;
    assert_eq!(delay(MINIMAL), Duration::ZERO);
    let yaml = format!("{MINIMAL}server: {{ drain_delay: 10s }}\n");
    assert_eq!(delay(&yaml), Duration::from_secs(10));
    let yaml = format!("{MINIMAL}server: {{ drain_delay: 0s }}\n");
    assert_eq!(delay(&yaml), Duration::ZERO);
    let yaml = format!("{MINIMAL}server: {{ drain_delay: soon }}\n");
    assert!(err(&yaml).starts_with("server.drain_delay: "));
}

#[test]
fn the_names_printed_for_values_are_the_ones_the_config_accepts() {
    let idem = |field: String| {
        let yaml = MINIMAL.replace("idempotency: {}", &format!("idempotency: {{ {field} }}"));
        Config::from_yaml(&yaml).unwrap().routes[0]
            .idempotency
            .clone()
            .unwrap()
    };
    for v in [Mode::Enforce, Mode::Observe] {
        assert_eq!(idem(format!("mode: {}", v.as_str())).mode, v);
    }
    for v in [InFlight::Wait, InFlight::Reject] {
        assert_eq!(idem(format!("in_flight: {}", v.as_str())).in_flight, v);
    }
    for v in [OnUnknownOutcome::Reforward, OnUnknownOutcome::Hold] {
        let field = format!("on_unknown_outcome: {}", v.as_str());
        assert_eq!(idem(field).on_unknown_outcome, v);
    }
    for v in [OnStoreError::Reject, OnStoreError::PassThrough] {
        assert_eq!(
            idem(format!("on_store_error: {}", v.as_str())).on_store_error,
            v
        );
    }
    let pg = |field: String| {
        let yaml = MINIMAL.replace(
            "url: \"postgres://u@localhost/db\"",
            &format!("url: \"postgres://u@localhost/db\", {field}"),
        );
        match Config::from_yaml(&yaml).unwrap().store {
            StoreConfig::Postgres(pg) => pg,
            StoreConfig::Sqlite(_) => panic!("a postgres store"),
        }
    };
    for v in Pooler::ALL {
        assert_eq!(pg(format!("pooler: {}", v.as_str())).pooler, Some(v));
    }
    // verify-full needs trusted roots on this machine: its spelling is checked by name.
    for v in PgTlsMode::ALL {
        if v == PgTlsMode::VerifyFull {
            assert_eq!(v.as_str(), "verify-full");
            continue;
        }
        assert_eq!(pg(format!("tls: {{ mode: {} }}", v.as_str())).tls, v);
    }
    for v in [LogFormat::Text, LogFormat::Json] {
        let yaml = format!("{MINIMAL}log: {{ format: {} }}\n", v.as_str());
        assert_eq!(Config::from_yaml(&yaml).unwrap().log_format, v);
    }
}

#[test]
fn unknown_upstream_is_named() {
    let yaml = MINIMAL.replace("upstream: app", "upstream: nope");
    assert_eq!(
        err(&yaml),
        "routes[0].upstream: no upstream named 'nope' (known: app)"
    );
}

#[test]
fn telemetry_is_off_by_default_and_read_with_its_defaults() {
    let c = Config::from_yaml_with_env(MINIMAL, &|_| None).unwrap();
    assert_eq!(c.telemetry, TelemetryConfig::default());
    assert!(c.telemetry.endpoint.is_none());
    let yaml = format!(
        "{MINIMAL}telemetry:\n  service_name: edge\n  sampling_ratio: 0.25\n  otlp:\n    endpoint: http://collector:4318\n    protocol: grpc\n    headers: {{ x-api-key: s3cret }}\n    timeout: 2s\n    max_queue_spans: 100\n"
    );
    let t = Config::from_yaml_with_env(&yaml, &|_| None)
        .unwrap()
        .telemetry;
    assert_eq!(t.endpoint.unwrap().to_string(), "http://collector:4318/");
    assert_eq!(t.protocol, OtlpProtocol::Grpc);
    assert_eq!(t.service_name, "edge");
    assert_eq!(t.sampling_ratio, 0.25);
    assert_eq!(t.timeout, Duration::from_secs(2));
    assert_eq!(t.max_queue_spans, 100);
    assert_eq!(t.headers[0].0.as_str(), "x-api-key");
}

#[test]
fn telemetry_errors_name_their_yaml_path() {
    let with = |section: &str| err(&format!("{MINIMAL}telemetry:\n{section}"));
    assert_eq!(
        with("  sampling_ratio: 1.5\n"),
        "telemetry.sampling_ratio: must be between 0.0 and 1.0, got 1.5"
    );
    assert_eq!(
        with("  sampling_ratio: -0.1\n"),
        "telemetry.sampling_ratio: must be between 0.0 and 1.0, got -0.1"
    );
    assert_eq!(
        with("  otlp: { endpoint: 'collector:4318' }\n"),
        "telemetry.otlp.endpoint: 'collector:4318' is not an http:// or https:// URL with a host"
    );
    assert!(
        with("  otlp: { endpoint: 'https://collector:4317', protocol: grpc }\n")
            .starts_with("telemetry.otlp.endpoint: 'https://collector:4317': https is not supported with protocol grpc"),
    );
    assert!(with("  otlp: { protocol: http/json }\n").starts_with("telemetry.otlp.protocol: "));
    assert_eq!(
        with("  otlp: { timeout: 0s }\n"),
        "telemetry.otlp.timeout: must be greater than zero"
    );
    assert_eq!(
        with("  otlp: { max_queue_spans: 0 }\n"),
        "telemetry.otlp.max_queue_spans: must be between 1 and 1000000, got 0"
    );
    let bad_value = with("  otlp: { headers: { authorization: \"Bearer a\\nb\" } }\n");
    assert_eq!(
        bad_value,
        "telemetry.otlp.headers.authorization: the value is not a valid header value"
    );
    assert_eq!(
        with("  service_name: ''\n"),
        "telemetry.service_name: must not be empty"
    );
    assert!(with("  sampling: 1\n").starts_with("telemetry.sampling: unknown field `sampling`"));
}

#[test]
fn telemetry_headers_are_not_printed_by_debug() {
    let yaml = format!(
        "{MINIMAL}telemetry:\n  otlp:\n    endpoint: http://c:4318\n    headers: {{ x-api-key: s3cret }}\n"
    );
    let c = Config::from_yaml_with_env(&yaml, &|_| None).unwrap();
    let printed = format!("{c:?}");
    assert!(
        printed.contains("x-api-key") && !printed.contains("s3cret"),
        "{printed}"
    );
}
