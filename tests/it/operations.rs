//! Running it: metrics, health, the admin key API and its token, reload, access logs.

use std::time::Duration;

use http::Method;

use crate::support::process::GatewayProcess;
use crate::support::*;

async fn admin_get(gw: &TestGateway, path: &str, token: Option<&str>) -> Reply {
    admin_call(gw, Method::GET, path, token).await
}

async fn admin_call(gw: &TestGateway, method: Method, path: &str, token: Option<&str>) -> Reply {
    let auth = token.map(|t| format!("Bearer {t}"));
    admin_request(gw, method, path, auth.as_deref()).await
}

#[tokio::test]
async fn metrics_count_requests_by_route_and_outcome_without_keys_or_scopes() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    post(&c, &gw, "secret-account", "secret-key-1", "x").await;
    post(&c, &gw, "secret-account", "secret-key-1", "x").await;
    post(&c, &gw, "secret-account", "secret-key-1", "other").await;
    send(&c, Method::GET, &gw.url("/plain"), &[], "").await;
    let m = admin_get(&gw, "/metrics", None).await;
    assert_eq!(m.status, 200);
    let text = String::from_utf8_lossy(&m.body).to_string();
    let requests = |route: &str, outcome: &str| requests_counted(&text, route, outcome);
    assert_eq!(requests("payments", "forwarded"), 1.0);
    assert_eq!(requests("payments", "replayed"), 1.0);
    assert_eq!(requests("payments", "mismatch"), 1.0);
    assert_eq!(requests("rest", "proxied"), 1.0);
    // By the status class of the answer: the mismatch was a 422, the rest 201s.
    let class = |route: &str, outcome: &str, class: &str| {
        metric(
            &text,
            &format!(
                "idemgate_requests_total{{route=\"{route}\",outcome=\"{outcome}\",status_class=\"{class}\"}} "
            ),
        )
    };
    assert_eq!(class("payments", "mismatch", "4xx"), 1.0);
    assert_eq!(class("payments", "forwarded", "2xx"), 1.0);
    // Created at 0 with the routes, for the upstream-errors alert.
    assert_eq!(class("payments", "forwarded", "5xx"), 0.0);
    assert_eq!(class("rest", "proxied", "2xx"), 1.0);
    // Each request's duration, by outcome; the upstream's, by upstream.
    for outcome in ["forwarded", "replayed", "mismatch"] {
        assert_eq!(
            metric(
                &text,
                &format!(
                    "idemgate_request_duration_seconds_count{{route=\"payments\",outcome=\"{outcome}\"}} "
                )
            ),
            1.0,
            "{outcome}"
        );
    }
    assert_eq!(
        metric(
            &text,
            "idemgate_upstream_duration_seconds_count{upstream=\"app\"} "
        ),
        2.0,
        "the forward and the plain GET"
    );
    for event in ["taken_over", "lost", "force_deleted"] {
        assert_eq!(
            metric(
                &text,
                &format!("idemgate_leases_total{{route=\"payments\",event=\"{event}\"}} ")
            ),
            0.0,
            "{event}: at 0 from the start"
        );
    }
    assert_eq!(
        metric(
            &text,
            &format!(
                "idemgate_build_info{{version=\"{}\"}} ",
                env!("CARGO_PKG_VERSION")
            )
        ),
        1.0
    );
    assert!(metric(&text, "process_resident_memory_bytes ") > 0.0);
    assert!(metric(&text, "process_open_fds ") > 0.0);
    // This scrape's connection is one of them (the client may keep others open).
    assert!(metric(&text, "idemgate_client_connections ") >= 0.0);
    assert!(
        metric(
            &text,
            "idemgate_upstream_latency_seconds_count{route=\"payments\"}"
        ) >= 1.0
    );
    assert!(metric(&text, "idemgate_store_latency_seconds_count{op=\"claim\"}") >= 3.0);
    // The start's migrations are an operation of the store too.
    assert_eq!(
        metric(
            &text,
            "idemgate_store_latency_seconds_count{op=\"migrate\"}"
        ),
        1.0
    );
    assert!(metric(&text, "idemgate_store_pool_connections{state=\"max\"}") >= 1.0);
    // The test cluster streams to no standby.
    assert_eq!(metric(&text, "idemgate_store_async_standbys "), 0.0);
    assert_eq!(metric(&text, "idemgate_forwards_in_flight"), 0.0);
    assert!(
        !text.contains("secret"),
        "keys and scopes never become label values"
    );
}

/// Each route's metric handles are resolved when its configuration is loaded: after a reload
/// that reorders the routes and renames one, every request still counts under its own route.
#[tokio::test]
async fn metrics_follow_each_route_across_a_reload_that_reorders_and_renames_routes() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let routes = |first: &str, second: &str, swapped: bool| {
        let a = format!("  - {{ name: {first}, match: {{ path_prefix: /a/ }}, upstream: app }}\n");
        let b = format!("  - {{ name: {second}, match: {{ path_prefix: /b/ }}, upstream: app }}\n");
        format!(
            "{head}upstreams:\n  app: {{ url: \"{url}\", connect_timeout: 200ms, timeout: 5s }}\nroutes:\n{list}",
            head = config_head(&pg_store_block(&db)),
            url = up.url(),
            list = if swapped { b + &a } else { a + &b },
        )
    };
    let gw = TestGateway::start(&routes("first", "second", false), &db).await;
    let at_start =
        String::from_utf8_lossy(&admin_get(&gw, "/metrics", None).await.body).to_string();
    for route in ["first", "second"] {
        assert_eq!(
            metric(
                &at_start,
                &format!("idemgate_upstream_latency_seconds_count{{route=\"{route}\"}}")
            ),
            0.0,
            "each configured route's latency series exists from the start: {at_start}"
        );
    }
    let c = client();
    let get = |path: &'static str| {
        let url = gw.url(path);
        let c = &c;
        async move { send(c, Method::GET, &url, &[], "").await }
    };
    assert_eq!(get("/a/x").await.status, 201);
    assert_eq!(get("/b/x").await.status, 201);
    let reloaded = idemgate::config::Config::from_yaml(&routes("first", "renamed", true)).unwrap();
    gw.gateway.reload(reloaded).unwrap();
    assert_eq!(get("/a/x").await.status, 201);
    assert_eq!(get("/a/y").await.status, 201);
    assert_eq!(get("/b/x").await.status, 201);
    let text = String::from_utf8_lossy(&admin_get(&gw, "/metrics", None).await.body).to_string();
    let proxied = |route: &str| requests_counted(&text, route, "proxied");
    assert_eq!(proxied("first"), 3.0, "{text}");
    assert_eq!(proxied("second"), 1.0, "{text}");
    assert_eq!(proxied("renamed"), 1.0, "{text}");
}

/// Readiness used to fail during a store outage; it no longer does once the store has been
/// ready (see `admin::readyz` and `rollout.rs` for the reasons and the rest of the rule).
#[tokio::test]
async fn health_is_always_ok_and_readiness_reports_a_store_outage_without_failing() {
    let cluster = pg::Cluster::start_async().await;
    let db = cluster.new_database().await;
    let up = Upstream::start().await;
    let gw = TestGateway::start(&config_yaml(&db, &up.url(), ""), &db).await;
    assert_eq!(admin_get(&gw, "/healthz", None).await.status, 200);
    let ready = admin_get(&gw, "/readyz", None).await;
    assert_eq!(
        (ready.status, &ready.json()["status"]),
        (200, &"ready".into())
    );
    let cluster = cluster.crashed().await;
    let r = admin_get(&gw, "/readyz", None).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "degraded");
    assert_eq!(r.json()["store"], "unavailable");
    assert_eq!(admin_get(&gw, "/healthz", None).await.status, 200);
    let _cluster = cluster.restarted().await;
    wait_until("ready again", Duration::from_secs(20), || async {
        admin_get(&gw, "/readyz", None).await.json()["status"] == "ready"
    })
    .await;
}

#[tokio::test]
async fn the_key_api_needs_the_bearer_token_when_one_is_set() {
    let up = Upstream::start().await;
    let token = "a-long-admin-token-1234";
    let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "", |y| {
        format!("{y}admin: {{ listen: 127.0.0.1:0, token: {token} }}\n")
    })
    .await;
    let c = client();
    post(&c, &gw, "acct 1", "k/1", "x").await;
    let q = "/v1/keys?scope=acct%201&key=k%2F1";
    let none = admin_get(&gw, q, None).await;
    assert_eq!(none.status, 401);
    assert_eq!(none.headers["www-authenticate"], "Bearer");
    assert_eq!(
        admin_get(&gw, q, Some("a-long-admin-token-1235"))
            .await
            .status,
        401
    );
    let shown = admin_get(&gw, q, Some(token)).await;
    assert_eq!(shown.status, 200);
    assert_eq!(shown.json()["state"], "completed");
    assert_eq!(admin_call(&gw, Method::DELETE, q, None).await.status, 401);
    assert_eq!(
        row_state(&gw, "acct 1", "k/1").await.as_deref(),
        Some("completed"),
        "not deleted"
    );
    assert_eq!(
        admin_call(&gw, Method::DELETE, q, Some(token)).await.status,
        204
    );
    assert_eq!(row_state(&gw, "acct 1", "k/1").await, None);
    assert_eq!(admin_get(&gw, q, Some(token)).await.status, 404);
    // Metrics and health need no token.
    assert_eq!(admin_get(&gw, "/metrics", None).await.status, 200);
    assert_eq!(admin_get(&gw, "/healthz", None).await.status, 200);
}

#[tokio::test]
async fn sighup_swaps_in_a_valid_file_keeps_the_old_one_on_a_bad_file_and_spares_in_flight_requests()
 {
    let a = Upstream::start_with(Behavior {
        delay: Duration::from_millis(800),
        ..Default::default()
    })
    .await;
    let b = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml(&db, &a.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let c = client();
    // In flight on upstream A when the reload lands.
    let slow = in_flight(&gw.url("/pay"), &a, "acct", "during-reload", "x").await;
    let text = std::fs::read_to_string(&gw.config).unwrap();
    let to_b = text.patch(&a.url(), &b.url());
    std::fs::write(&gw.config, &to_b).unwrap();
    gw.hangup();
    let url = gw.url("/pay");
    // Each probe a new key: a probe that reached A before the reload landed is stored, and
    // repeating its key would only replay it.
    let probes = std::sync::atomic::AtomicUsize::new(0);
    wait_until(
        "new requests go to upstream B",
        Duration::from_secs(10),
        || async {
            let n = probes.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            post_to(&c, &url, "acct", &format!("probe-{n}"), "x")
                .await
                .status
                == 201
                && b.executions() > 0
        },
    )
    .await;
    let r = slow.await.unwrap();
    assert_eq!(
        r.status, 201,
        "the in-flight request finished on upstream A"
    );
    let on_a: Vec<_> = a
        .seen()
        .iter()
        .map(|s| s.headers["idempotency-key"].to_str().unwrap().to_string())
        .collect();
    assert_eq!(
        on_a.iter().filter(|k| *k == "during-reload").count(),
        1,
        "the in-flight request ran once, on A"
    );
    assert!(
        on_a.iter()
            .all(|k| k == "during-reload" || k.starts_with("probe-")),
        "nothing else went to A: {on_a:?}"
    );
    assert!(
        post_to(&c, &url, "acct", "during-reload", "x")
            .await
            .replayed(),
        "and was stored"
    );

    // A bad file is refused; the running configuration stays.
    std::fs::write(&gw.config, to_b.patch("timeout: 5s", "timeout: 5 seconds")).unwrap();
    gw.hangup();
    wait_until("the refusal is logged", Duration::from_secs(10), || async {
        gw.log_text().contains("reload refused")
    })
    .await;
    assert!(
        gw.log_text().contains("upstreams.app.timeout"),
        "the log names the YAML path"
    );
    let before = b.executions();
    assert_eq!(
        post_to(&c, &url, "acct", "after-bad-file", "x")
            .await
            .status,
        201
    );
    assert_eq!(
        b.executions(),
        before + 1,
        "still served by the last good configuration"
    );

    // A store change is refused whole: leases were checked against timeouts not in force.
    std::fs::write(
        &gw.config,
        to_b.patch("statement_timeout: 1s", "statement_timeout: 3s"),
    )
    .unwrap();
    gw.hangup();
    wait_until(
        "the store change is refused",
        Duration::from_secs(10),
        || async { gw.log_text().contains("the store section changed") },
    )
    .await;
    // One reload swapped in, two refused: each counted by its result.
    let metrics = format!("http://{}/metrics", gw.admin.expect("an admin listener"));
    let text =
        String::from_utf8_lossy(&send(&c, Method::GET, &metrics, &[], "").await.body).to_string();
    assert_eq!(metric(&text, "idemgate_reloads_total{result=\"ok\"} "), 1.0);
    assert_eq!(
        metric(&text, "idemgate_reloads_total{result=\"error\"} "),
        2.0
    );
    gw.kill();
}

#[tokio::test]
async fn json_access_logs_have_one_line_per_request_and_no_secrets() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        "{}log: {{ format: json }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let body = r#"{"card":"4111-secret-body"}"#;
    let r = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", "raw-key-secret"),
            ("x-account-id", "acct-secret"),
            ("authorization", "Bearer credential-secret"),
        ],
        body,
    )
    .await;
    // A retry, answered from the store without the upstream.
    let retry = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", "raw-key-secret"),
            ("x-account-id", "acct-secret"),
            ("authorization", "Bearer credential-secret"),
        ],
        body,
    )
    .await;
    assert!(retry.replayed(), "{retry:?}");
    wait_until(
        "both access lines are written",
        Duration::from_secs(10),
        || async {
            let log = gw.log_text();
            log.contains("\"outcome\":\"forwarded\"") && log.contains("\"outcome\":\"replayed\"")
        },
    )
    .await;
    let log = gw.log_text();
    let access: Vec<serde_json::Value> = log
        .lines()
        .filter(|l| l.contains("\"outcome\":"))
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(access.len(), 2, "one line per request:\n{log}");
    let line_of = |outcome: &str| {
        access
            .iter()
            .find(|l| l["outcome"] == outcome)
            .unwrap_or_else(|| panic!("no {outcome} line:\n{log}"))
    };
    let (v, replayed) = (line_of("forwarded"), line_of("replayed"));
    assert_eq!(v["route"], "payments");
    assert_eq!(v["status"], 201);
    assert_eq!(
        v["key"].as_str().unwrap().len(),
        32,
        "the key appears only as its hash"
    );
    assert_eq!(replayed["key"], v["key"], "the same key, the same hash");
    // The upstream's time is measured for a forwarded request; a replay never reached it
    // (-1).
    assert!(v["upstream_us"].as_i64().unwrap() >= 0);
    assert_eq!(replayed["upstream_us"], -1, "{replayed}");
    assert_ne!(replayed["request_id"], v["request_id"]);
    assert!(v["duration_us"].as_u64().unwrap() >= v["upstream_us"].as_u64().unwrap());
    assert_eq!(v["proto"], "HTTP/1.1");
    assert_eq!(v["client"], "127.0.0.1");
    assert_eq!(v["bytes_out"].as_u64().unwrap() as usize, r.body.len());
    assert!(v["bytes_in"].as_u64().unwrap() > 0);
    assert_eq!(
        v["request_id"].as_str().unwrap(),
        r.headers["x-request-id"].to_str().unwrap(),
        "the line names the id the client got"
    );
    assert!(!log.contains("\u{1b}["), "no ANSI escapes into a file");
    assert!(
        !log.contains("secret"),
        "no body, raw key, scope or credential in the log:\n{log}"
    );
    gw.kill();
}

/// The default text format into a file (the process's stderr is the test's log file, not a
/// terminal): the access line is written, without a single ANSI escape.
#[tokio::test]
async fn text_logs_into_a_file_carry_the_access_line_and_no_ansi_colour() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let mut gw = GatewayProcess::start(&config_yaml(&db, &up.url(), "")).await;
    let r = post_to(&client(), &gw.url("/pay"), "a", "k-text", "x").await;
    assert_eq!(r.status, 201);
    let id = r.headers["x-request-id"].to_str().unwrap().to_string();
    wait_until(
        "the access line is written",
        Duration::from_secs(10),
        || async { gw.log_text().contains(&id) },
    )
    .await;
    let log = gw.log_text();
    let line = log.lines().find(|l| l.contains(&id)).unwrap();
    assert!(
        line.contains("idemgate::access") && line.contains("forwarded"),
        "a text access line: {line}"
    );
    assert!(
        !log.contains('\u{1b}'),
        "no ANSI escape in a log that is not a terminal:\n{log:?}"
    );
    gw.kill();
}

/// `idemgate keys show` and the key API print the `key_id` that the access line names the
/// request's key by, so an operator can go from a log line to the row and back.
#[tokio::test]
async fn keys_show_and_the_key_api_print_the_key_id_of_the_access_line() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        "{}log: {{ format: json }}\nadmin: {{ listen: \"127.0.0.1:0\" }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let r = post_to(&client(), &gw.url("/pay"), "acct 7", "k/7", "x").await;
    assert_eq!(r.status, 201);
    let request_id = r.headers["x-request-id"].to_str().unwrap().to_string();
    let needle = format!("\"request_id\":\"{request_id}\"");
    wait_until(
        "the access line is written",
        Duration::from_secs(10),
        || async { gw.log_text().contains(&needle) },
    )
    .await;
    let log = gw.log_text();
    let line: serde_json::Value =
        serde_json::from_str(log.lines().find(|l| l.contains(&needle)).unwrap()).unwrap();
    let logged = line["key"].as_str().unwrap().to_string();
    assert_eq!(logged.len(), 32, "{line}");

    let config = gw.config.clone();
    let shown = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::support::bin::idemgate())
            .args(["keys", "show", "--config"])
            .arg(&config)
            .args(["--scope", "acct 7", "--key", "k/7"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(shown.status.success(), "{shown:?}");
    let cli: serde_json::Value = serde_json::from_slice(&shown.stdout).unwrap();
    assert_eq!(cli["key_id"], logged.as_str(), "keys show: {cli}");

    let admin = gw.admin.expect("an admin listener");
    let api = send(
        &client(),
        Method::GET,
        &format!("http://{admin}/v1/keys?scope=acct%207&key=k%2F7"),
        &[],
        "",
    )
    .await;
    assert_eq!(api.status, 200, "{api:?}");
    assert_eq!(api.json()["key_id"], logged.as_str(), "GET /v1/keys");
    gw.kill();
}

#[tokio::test]
async fn a_request_id_is_kept_or_made_forwarded_returned_and_in_problem_bodies() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        "{}log: {{ format: json }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let given = [
        ("idempotency-key", "k1"),
        ("x-account-id", "a"),
        ("x-request-id", "trace-42"),
    ];
    let r = send(&c, Method::POST, &gw.url("/pay"), &given, "{}").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.headers["x-request-id"], "trace-42", "returned");
    assert_eq!(
        up.seen()[0].headers["x-request-id"],
        "trace-42",
        "forwarded"
    );
    // Made when absent (or not visible ASCII), different each time.
    let plain1 = send(&c, Method::GET, &gw.url("/x"), &[], "").await;
    let plain2 = send(
        &c,
        Method::GET,
        &gw.url("/x"),
        &[("x-request-id", "bad id")],
        "",
    )
    .await;
    let (id1, id2) = (
        &plain1.headers["x-request-id"],
        &plain2.headers["x-request-id"],
    );
    assert_ne!(id1, id2);
    assert_ne!(id2, "bad id");
    assert_eq!(up.seen()[1].headers["x-request-id"], id1);
    // A problem body names the request.
    let bad = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", "k2"),
            ("idempotency-key", "k3"),
            ("x-account-id", "a"),
            ("x-request-id", "trace-43"),
        ],
        "{}",
    )
    .await;
    assert_eq!(bad.problem(), "key-invalid");
    assert_eq!(bad.json()["request_id"], "trace-43");
    wait_until("the lines are written", Duration::from_secs(10), || async {
        gw.log_text().contains("\"request_id\":\"trace-43\"")
    })
    .await;
    let log = gw.log_text();
    let line = log.lines().find(|l| l.contains("trace-43")).unwrap();
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["outcome"], "key_invalid");
    assert_eq!(v["status"], 400);
}

/// The periodic collection runs in the gateway `serve` builds: an expired key disappears
/// without anyone running `idemgate gc`, and a live one stays.
#[tokio::test]
async fn the_periodic_gc_collects_expired_keys_by_itself() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "lease: 3s\n      ttl: 4s")
        .patch(" timeout: 5s }", " timeout: 500ms }")
        .patch(
            "statement_timeout: 1s }",
            "statement_timeout: 1s }\n  gc: { interval: 200ms }",
        );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "short", "x").await.status, 201);
    assert_eq!(
        row_state(&gw, "a", "short").await.as_deref(),
        Some("completed")
    );
    wait_until(
        "the expired key is collected by the gateway's own loop",
        Duration::from_secs(10),
        || async { row_state(&gw, "a", "short").await.is_none() },
    )
    .await;
    // The collections are counted, and the row they deleted.
    let text = String::from_utf8_lossy(&admin_get(&gw, "/metrics", None).await.body).to_string();
    assert!(
        metric(&text, "idemgate_gc_runs_total{result=\"ok\"} ") >= 1.0,
        "{text}"
    );
    assert_eq!(metric(&text, "idemgate_gc_rows_total "), 1.0, "{text}");
    assert_eq!(
        metric(&text, "idemgate_gc_runs_total{result=\"error\"} "),
        0.0
    );
    gw.shutdown().await;
}

/// A database that streams to a standby that is not synchronous (a failover to it can lose
/// commits a client was answered from): `serve` warns at start and the gauge counts it.
#[tokio::test]
async fn async_standbys_are_reported_at_start_and_as_a_gauge() {
    let cluster = pg::Cluster::start_async().await;
    let _standby = cluster.stream_wal();
    let db = cluster.new_database().await;
    let admin = sql(&db).await;
    wait_until("the standby streams", Duration::from_secs(30), || async {
        admin
            .query_one("SELECT count(*) FROM pg_stat_replication", &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 1
    })
    .await;
    let up = Upstream::start().await;
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let gw = GatewayProcess::start(&yaml).await;
    let metrics = format!("http://{}/metrics", gw.admin.expect("an admin listener"));
    let c = client();
    wait_until(
        "the gauge counts the standby",
        Duration::from_secs(30),
        || async {
            let text = send(&c, Method::GET, &metrics, &[], "").await.body;
            metric(
                &String::from_utf8_lossy(&text),
                "idemgate_store_async_standbys ",
            ) == 1.0
        },
    )
    .await;
    let log = gw.log_text();
    assert!(
        log.contains("WARN") && log.contains("standbys that are not synchronous"),
        "{log}"
    );
}

/// Logs never carry raw keys, scopes or bodies, at any level: at `trace` (and with the
/// PostgreSQL driver asked for `trace` by name), a keyed request, its replay and a mismatch
/// leave none of them in the log.
#[tokio::test]
async fn no_key_scope_or_body_reaches_the_log_even_at_trace() {
    let up = Upstream::start_with(Behavior {
        body: Some(bytes::Bytes::from_static(b"answer-body-7f3a")),
        ..Behavior::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let gw = GatewayProcess::start_with_env(
        &config_yaml(&db, &up.url(), ""),
        &[(
            "RUST_LOG",
            "trace,tokio_postgres=trace,tokio_postgres::query=trace",
        )],
    )
    .await;
    let c = client();
    let url = gw.url("/pay");
    let first = post_to(
        &c,
        &url,
        "scope-value-7f3a",
        "key-value-7f3a",
        "request-body-7f3a",
    )
    .await;
    assert_eq!(first.status, 201);
    let retry = post_to(
        &c,
        &url,
        "scope-value-7f3a",
        "key-value-7f3a",
        "request-body-7f3a",
    )
    .await;
    assert!(retry.replayed());
    let other = post_to(
        &c,
        &url,
        "scope-value-7f3a",
        "key-value-7f3a",
        "another-body-7f3a",
    )
    .await;
    assert_eq!(other.status, 422);
    wait_until(
        "the access lines are written",
        Duration::from_secs(10),
        || async {
            gw.log_text().matches("status=").count() >= 3
                || gw.log_text().matches("\"status\"").count() >= 3
        },
    )
    .await;
    let log = gw.log_text();
    assert!(
        log.contains("TRACE") || log.contains("DEBUG"),
        "the log is at trace"
    );
    for secret in [
        "scope-value-7f3a",
        "key-value-7f3a",
        "request-body-7f3a",
        "another-body-7f3a",
        "answer-body-7f3a",
    ] {
        assert!(!log.contains(secret), "{secret} is in the log");
    }
}

/// A change that needs a restart is reported against what runs: a second SIGHUP with the
/// file unchanged reports it again, and the running value stays in force meanwhile (a body
/// read timeout changed in the file does not apply until the restart).
#[tokio::test]
async fn a_pending_restart_is_reported_against_what_runs_and_nothing_of_it_applies() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "");
    let mut gw = GatewayProcess::start(&yaml).await;
    let changed = yaml.patch(
        "server: { shutdown_grace: 5s, header_read_timeout: 2s }",
        "server: { shutdown_grace: 5s, header_read_timeout: 2s, body_read_timeout: 1ms }",
    );
    std::fs::write(&gw.config, &changed).unwrap();
    for n in 1..=2 {
        gw.hangup();
        wait_until("the reload is logged", Duration::from_secs(30), || async {
            gw.log_text()
                .matches("these changes apply after a restart")
                .count()
                >= n
        })
        .await;
    }
    let log = gw.log_text();
    let pending: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("these changes apply after a restart"))
        .collect();
    assert_eq!(pending.len(), 2, "{log}");
    assert!(pending.iter().all(|l| l.contains("server")), "{pending:?}");
    // A body sent 100 ms after its head: under a 1 ms read timeout it would be refused.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    conn.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: slow-body\r\nx-account-id: a\r\ncontent-length: 1\r\nconnection: close\r\n\r\n",
    )
    .await
    .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    conn.write_all(b"x").await.unwrap();
    let mut answer = Vec::new();
    conn.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        answer.starts_with("HTTP/1.1 201"),
        "the running body_read_timeout stays in force: {answer}"
    );
    gw.kill();
}

/// Under an open-file limit too low for the configuration, `serve` says so at start with the
/// numbers and the fix; the shipped systemd unit raises the limit.
#[tokio::test]
async fn an_open_file_limit_too_low_for_the_config_is_named_at_start() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let dir = std::env::temp_dir().join(format!("idemgate-nofile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, config_yaml(&db, &up.url(), "")).unwrap();
    let out = tokio::time::timeout(
        Duration::from_secs(60),
        tokio::process::Command::new("sh")
            .args([
                "-c",
                "ulimit -n 64 && exec timeout -s INT 3 \"$0\" serve --config \"$1\"",
            ])
            .arg(crate::support::bin::idemgate())
            .arg(&config)
            .output(),
    )
    .await
    .expect("serve ran")
    .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("warning: the open-file limit is 64") && text.contains("LimitNOFILE"),
        "{text}"
    );
    // A soft limit below the hard one is raised to it at start, as servers do.
    std::fs::write(
        &config,
        config_yaml(&db, &up.url(), "").patch(
            "server: { shutdown_grace: 5s, header_read_timeout: 2s }",
            "server: { shutdown_grace: 5s, header_read_timeout: 2s, max_connections: 100 }",
        ),
    )
    .unwrap();
    let out = tokio::process::Command::new("sh")
        .args([
            "-c",
            "ulimit -Sn 64 && ulimit -Hn 4096 && RUST_LOG=info exec timeout -s INT 3 \"$0\" serve --config \"$1\"",
        ])
        .arg(crate::support::bin::idemgate())
        .arg(&config)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(
        text.contains("raised the open-file limit")
            && text.contains("from=64")
            && text.contains("to=4096"),
        "{text}"
    );
    assert!(!text.contains("warning: the open-file limit"), "{text}");
    let unit = std::fs::read_to_string(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/systemd/idemgate.service"),
    )
    .unwrap();
    assert!(unit.contains("LimitNOFILE=65536"), "{unit}");
    let _ = std::fs::remove_dir_all(&dir);
}
