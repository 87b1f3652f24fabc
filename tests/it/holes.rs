//! The holes of docs/contract.md §8.1 and §8.2: no way around a keyed route (path spellings,
//! ambiguity, scope namespaces, the gateway's own headers) and no way to exhaust it
//! (admission bounds), through the same gateway wiring as `serve`.

use std::time::Duration;

use http::Method;
use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;

use crate::support::*;

/// A keyed exact route above a plain catch-all, as in front of a legacy service.
fn catch_all_yaml(db: &str, upstream: &str, extra_upstream: &str) -> String {
    format!(
        r#"
listen: 127.0.0.1:0
server: {{ shutdown_grace: 5s, header_read_timeout: 2s }}
store:
{store}
upstreams:
  app: {{ url: "{upstream}", connect_timeout: 200ms, timeout: 5s {extra_upstream} }}
routes:
  - name: webhooks
    match: {{ path: /webhooks/payments }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
  - name: api
    match: {{ path_prefix: /api/ }}
    upstream: app
    idempotency:
      scope: {{ fixed: webhooks }}
  - name: rest
    match: {{ path_prefix: / }}
    upstream: app
"#,
        store = pg_store_block(db)
    )
}

async fn keyed(c: &TestClient, url: &str, headers: &[(&str, &str)], body: &str) -> Reply {
    send(c, Method::POST, url, headers, body.to_string()).await
}

#[tokio::test]
async fn every_spelling_of_a_keyed_path_is_one_request_executed_once() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    let spellings = [
        "/webhooks/payments",
        "/webhooks/payments/",
        "/webhooks//payments",
        "//webhooks/payments",
        "/webhooks/%70ayments",
        "/webhooks/./payments",
        "/webhooks/x/../payments",
        "/webhooks/payments?x=1",
    ];
    let headers = [("idempotency-key", "evt-1"), ("x-account-id", "a")];
    let first = keyed(&c, &gw.url(spellings[0]), &headers, "{}").await;
    assert_eq!(first.status, 201);
    for spelling in &spellings[1..7] {
        let r = keyed(&c, &gw.url(spelling), &headers, "{}").await;
        assert_eq!(r.status, 201, "{spelling}");
        assert!(r.replayed(), "{spelling} is the same request: replayed");
        assert_eq!(r.body, first.body, "{spelling}");
    }
    // The query string is part of the request: another query is another request.
    let other = keyed(&c, &gw.url(spellings[7]), &headers, "{}").await;
    assert_eq!(other.status, 422, "same key, another query: a mismatch");
    assert_eq!(up.executions(), 1, "executed once, whatever the spelling");
    let seen = up.seen();
    assert_eq!(
        seen[0].uri, "/webhooks/payments",
        "forwarded in normal form"
    );
}

/// What reaches the upstream is the normalized path, on a prefix route, an exact route and
/// the catch-all alike; each request below has a key of its own, so each is forwarded and the
/// upstream records the URI it received.
#[tokio::test]
async fn the_upstream_receives_the_normalized_path_whatever_the_client_spelled() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    let cases = [
        // The prefix route `/api/` (keyed, fixed scope).
        ("//api//b/./c", "/api/b/c"),
        ("/api/x/../b/%63", "/api/b/c"),
        // Unreserved escapes decoded, others upper-cased; the query is left as it came.
        ("/api//b/%7e%2fz?q=%2f1", "/api/b/~%2Fz?q=%2f1"),
        // The exact route: its one trailing slash dropped, the configured spelling forwarded.
        ("/webhooks/payments/", "/webhooks/payments"),
        ("/webhooks//%70ayments/", "/webhooks/payments"),
        ("/webhooks/./x/../payments", "/webhooks/payments"),
        // The catch-all (not keyed) forwards the normal form too.
        ("//a//b/./c", "/a/b/c"),
    ];
    for (i, (spelled, _)) in cases.iter().enumerate() {
        let key = format!("spelling-{i}");
        let h = [("idempotency-key", key.as_str()), ("x-account-id", "a")];
        let r = keyed(&c, &gw.url(spelled), &h, "{}").await;
        assert_eq!(r.status, 201, "{spelled}");
        assert!(!r.replayed(), "{spelled}: a key of its own, forwarded");
    }
    let received: Vec<String> = up.seen().into_iter().map(|s| s.uri).collect();
    let expected: Vec<String> = cases.iter().map(|(_, n)| n.to_string()).collect();
    assert_eq!(received, expected, "the upstream received the normal forms");
}

#[tokio::test]
async fn a_prefix_matches_on_a_segment_boundary_and_climbing_above_the_root_is_refused() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    // `/api/` (configured with its slash) matches `/api` and `/api/x`, never `/apix`.
    let h = [("idempotency-key", "k1")];
    assert_eq!(keyed(&c, &gw.url("/api/x"), &h, "{}").await.status, 201);
    assert!(keyed(&c, &gw.url("/api//x"), &h, "{}").await.replayed());
    let apix = keyed(&c, &gw.url("/apix"), &h, "{}").await;
    assert_eq!(apix.status, 201);
    assert!(!apix.replayed(), "/apix is the catch-all's, not keyed");
    assert_eq!(up.executions(), 2);
    for path in ["/..", "/webhooks/../../etc/passwd", "/%2e%2e/x"] {
        let r = keyed(&c, &gw.url(path), &h, "{}").await;
        assert_eq!(
            (r.status, r.problem().as_str()),
            (400, "path-invalid"),
            "{path}"
        );
    }
    assert_eq!(
        up.executions(),
        2,
        "nothing climbing above the root is forwarded"
    );
}

#[tokio::test]
async fn spellings_that_normalize_to_one_path_get_one_execution_property() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    // Random spellings of `/webhooks/payments` (an exact route) and `/api/pay-in_v1.0~x` (a
    // prefix route): each character plain or percent-encoded in either case, separators
    // doubled, `.` and `x/..` detours, a trailing slash on the exact route; one key per
    // generated pair, whose first spelling reaches the upstream in normal form.
    let seg = |word: &'static str| {
        let chars: Vec<_> = word
            .chars()
            .map(|ch| {
                proptest::prop_oneof![
                    proptest::strategy::Just(ch.to_string()),
                    proptest::strategy::Just(format!("%{:02x}", ch as u32)),
                    proptest::strategy::Just(format!("%{:02X}", ch as u32)),
                ]
            })
            .collect();
        chars.prop_map(|parts| parts.concat())
    };
    let sep = || {
        proptest::prop_oneof![
            proptest::strategy::Just("/"),
            proptest::strategy::Just("//"),
            proptest::strategy::Just("/./"),
            proptest::strategy::Just("/zz/../"),
        ]
    };
    // The exact route accepts one trailing slash; the prefix route's path carries every
    // unreserved punctuation character (`-._~`), each escaped in either case too.
    let slash =
        || proptest::prop_oneof![proptest::strategy::Just(""), proptest::strategy::Just("/")];
    let exact = (sep(), seg("webhooks"), sep(), seg("payments"), slash())
        .prop_map(|(a, w, b, p, t)| format!("{a}{w}{b}{p}{t}"))
        .boxed();
    let prefix = (sep(), seg("api"), sep(), seg("pay-in_v1.0~x"))
        .prop_map(|(a, w, b, p)| format!("{a}{w}{b}{p}"))
        .boxed();
    let mut runner = TestRunner::deterministic();
    let cases = 48;
    for i in 0..cases {
        let spelling = if i % 2 == 0 { &exact } else { &prefix };
        let one = spelling.new_tree(&mut runner).unwrap().current();
        let two = spelling.new_tree(&mut runner).unwrap().current();
        let key = format!("prop-{i}");
        let h = [("idempotency-key", key.as_str()), ("x-account-id", "p")];
        let a = keyed(&c, &gw.url(&one), &h, "{}").await;
        let b = keyed(&c, &gw.url(&two), &h, "{}").await;
        assert_eq!((a.status, b.status), (201, 201), "{one} / {two}");
        assert!(b.replayed(), "{two} replays {one}");
        let normal = if i % 2 == 0 {
            "/webhooks/payments"
        } else {
            "/api/pay-in_v1.0~x"
        };
        assert_eq!(up.seen().last().unwrap().uri, normal, "{one}");
    }
    assert_eq!(
        up.executions(),
        cases,
        "one execution per key, whatever the spellings"
    );
}

#[tokio::test]
async fn repeated_key_or_scope_headers_with_different_values_are_refused() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    let url = gw.url("/webhooks/payments");
    let two_keys = [
        ("idempotency-key", "k1"),
        ("idempotency-key", "k2"),
        ("x-account-id", "a"),
    ];
    let r = keyed(&c, &url, &two_keys, "{}").await;
    assert_eq!((r.status, r.problem().as_str()), (400, "key-invalid"));
    // An auth proxy that appends its X-Account-Id instead of replacing the client's.
    let two_scopes = [
        ("idempotency-key", "k1"),
        ("x-account-id", "victim"),
        ("x-account-id", "attacker"),
    ];
    let r = keyed(&c, &url, &two_scopes, "{}").await;
    assert_eq!((r.status, r.problem().as_str()), (400, "scope-invalid"));
    // The same value twice is not ambiguous.
    let same = [
        ("idempotency-key", "k1"),
        ("idempotency-key", "k1"),
        ("x-account-id", "a"),
        ("x-account-id", "a"),
    ];
    assert_eq!(keyed(&c, &url, &same, "{}").await.status, 201);
    assert_eq!(up.executions(), 1, "nothing ambiguous was forwarded");
}

#[tokio::test]
async fn a_json_body_with_a_repeated_member_name_is_refused() {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(Backend::Postgres, &up, "").await;
    let c = client();
    let h = [
        ("idempotency-key", "k1"),
        ("x-account-id", "a"),
        ("content-type", "application/json"),
    ];
    let url = gw.url("/pay");
    let r = keyed(&c, &url, &h, r#"{"amount":1,"amount":1000}"#).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "body-not-json"));
    let nested = keyed(&c, &url, &h, r#"{"a":{"to":"x","to":"y"}}"#).await;
    assert_eq!(nested.status, 400);
    // A repeat past a part nested deeper than the gateway reads (129 levels) cannot be seen:
    // the body is refused for its depth, not forwarded unchecked.
    let depth = idemgate::json::MAX_DEPTH + 1;
    let deep = format!(
        r#"{{"pad":{}1{},"amount":1,"amount":1000}}"#,
        "[".repeat(depth),
        "]".repeat(depth)
    );
    let r = keyed(&c, &url, &h, &deep).await;
    assert_eq!((r.status, r.problem().as_str()), (400, "body-not-json"));
    assert_eq!(keyed(&c, &url, &h, r#"{"amount":1}"#).await.status, 201);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn a_header_scope_cannot_squat_a_fixed_scopes_key() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&catch_all_yaml(&db, &up.url(), ""), &db).await;
    let c = client();
    // A client claims key k under the header scope "webhooks"...
    let squat = [("idempotency-key", "k"), ("x-account-id", "webhooks")];
    assert_eq!(
        keyed(&c, &gw.url("/webhooks/payments"), &squat, "{}")
            .await
            .status,
        201
    );
    // ...which is not the `fixed: webhooks` scope of the api route: its k is its own.
    let r = keyed(&c, &gw.url("/api/pay"), &[("idempotency-key", "k")], "{}").await;
    assert_eq!(r.status, 201);
    assert!(!r.replayed());
    assert_eq!(up.executions(), 2);
    let db = gw.sql().await;
    let scopes: Vec<String> = db
        .query("SELECT scope FROM idemgate_keys ORDER BY scope", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(scopes, ["fixed:webhooks", "header:webhooks"]);
}

/// A scope read from the body (`json:`) and one read from a header (`header:`) with the same
/// value are two scopes: the same key under each is two requests.
#[tokio::test]
async fn a_json_scope_and_a_header_scope_with_the_same_value_do_not_share_a_key() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = format!(
        r#"{head}upstreams:
  app: {{ url: "{up}", connect_timeout: 200ms, timeout: 5s }}
routes:
  - name: by-body
    match: {{ path: /orders }}
    upstream: app
    idempotency:
      scope: {{ json: /account }}
  - name: by-header
    match: {{ path_prefix: / }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
"#,
        head = config_head(&pg_store_block(&db)),
        up = up.url(),
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let body = r#"{"account":"acme"}"#;
    let json = [
        ("idempotency-key", "k"),
        ("content-type", "application/json"),
    ];
    let first = keyed(&c, &gw.url("/orders"), &json, body).await;
    assert_eq!(first.status, 201);
    let header = [
        ("idempotency-key", "k"),
        ("x-account-id", "acme"),
        ("content-type", "application/json"),
    ];
    let other = keyed(&c, &gw.url("/orders/x"), &header, body).await;
    assert_eq!(other.status, 201);
    assert!(!other.replayed(), "another scope's key: forwarded");
    assert!(keyed(&c, &gw.url("/orders"), &json, body).await.replayed());
    assert_eq!(up.executions(), 2);
    let scopes: Vec<String> = gw
        .sql()
        .await
        .query("SELECT scope FROM idemgate_keys ORDER BY scope", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(scopes, ["header:acme", "json:acme"]);
}

#[tokio::test]
async fn an_upstreams_own_replay_headers_never_reach_the_client() {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(Backend::Postgres, &up, "").await;
    let c = client();
    // The test upstream always answers with Idempotent-Replayed and Idempotency-Status.
    let first = post(&c, &gw, "a", "k", "{}").await;
    assert_eq!(first.status, 201);
    assert!(!first.headers.contains_key("idempotent-replayed"));
    assert!(!first.headers.contains_key("idempotency-status"));
    let plain = send(&c, Method::GET, &gw.url("/other"), &[], "").await;
    assert!(!plain.headers.contains_key("idempotent-replayed"));
    assert!(!plain.headers.contains_key("idempotency-status"));
    let again = post(&c, &gw, "a", "k", "{}").await;
    assert_eq!(again.headers["idempotent-replayed"], "true", "only ours");
}

#[tokio::test]
async fn an_upstreams_max_in_flight_bounds_detached_work_and_refusals_are_not_forwarded() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(600),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = catch_all_yaml(&db, &up.url(), ", max_in_flight: 3");
    let gw = TestGateway::start(&yaml, &db).await;
    let keys: Vec<(String, String)> = (0..20)
        .map(|i| ("acct".to_string(), format!("storm-{i}")))
        .collect();
    let url = gw.url("/webhooks/payments");
    let replies = at_once(std::slice::from_ref(&url), keys.clone(), "{}").await;
    let ok = replies.iter().filter(|r| r.status == 201).count();
    let refused: Vec<_> = replies.iter().filter(|r| r.status == 503).collect();
    assert_eq!(ok + refused.len(), 20, "every answer is 201 or 503");
    assert!(ok >= 3, "the slots were used");
    assert!(!refused.is_empty(), "the storm passed the bound");
    for r in &refused {
        assert_eq!(r.problem(), "overloaded");
        assert!(r.headers.contains_key("retry-after"));
    }
    assert!(
        up.max_concurrency() <= 3,
        "never more than max_in_flight at the upstream"
    );
    assert_eq!(up.executions(), ok, "no refused request was forwarded");
    // No key was held for a refusal: a retry later is forwarded and succeeds.
    let c = client();
    let (account, key) = &keys[replies.iter().position(|r| r.status == 503).unwrap()];
    let retry = post_to(&c, &url, account, key, "{}").await;
    assert_eq!(retry.status, 201);
    assert!(!retry.replayed());
    let metrics = send(
        &c,
        Method::GET,
        &format!("http://{}/metrics", gw.admin),
        &[],
        "",
    )
    .await;
    let text = String::from_utf8_lossy(&metrics.body);
    assert!(
        text.contains("idemgate_overloaded_total{upstream=\"app\",bound=\"max_in_flight\"}"),
        "{text}"
    );
    assert!(text.contains("idemgate_upstream_in_flight{upstream=\"app\"} 0"));
}

#[tokio::test]
async fn clients_that_hang_up_still_hold_their_slot_until_the_forward_ends() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(800),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = catch_all_yaml(&db, &up.url(), ", max_in_flight: 2");
    let gw = TestGateway::start(&yaml, &db).await;
    let url = gw.url("/webhooks/payments");
    // Two clients send and hang up while their forwards run.
    for k in ["gone-1", "gone-2"] {
        let task = in_flight(&url, &up, "a", k, "{}").await;
        task.abort();
    }
    let c = client();
    let r = post_to(&c, &url, "a", "third", "{}").await;
    assert_eq!(
        r.problem(),
        "overloaded",
        "the detached forwards hold both slots"
    );
    wait_until(
        "the detached forwards end",
        Duration::from_secs(10),
        || async { up.answered() == 2 },
    )
    .await;
    wait_until("a slot is free again", Duration::from_secs(10), || async {
        post_to(&c, &url, "a", "third", "{}").await.status == 201
    })
    .await;
    assert_eq!(up.executions(), 3);
}

/// The catch-all config in front of `upstream` with `server.max_buffered_bytes: 1MiB`.
async fn gateway_with_a_1mib_budget(upstream: &str) -> TestGateway {
    let db = pg::fresh_database().await;
    let yaml = catch_all_yaml(&db, upstream, "").patch(
        "server: { shutdown_grace: 5s, header_read_timeout: 2s }",
        "server: { shutdown_grace: 5s, header_read_timeout: 2s, max_buffered_bytes: 1MiB }",
    );
    TestGateway::start(&yaml, &db).await
}

/// Eight keyed POSTs of 300 KiB each (keys `{prefix}-0` to `{prefix}-7`), all at once.
fn eight_300kib_keyed_posts(gw: &TestGateway, prefix: &str) -> Vec<tokio::task::JoinHandle<Reply>> {
    let body = "x".repeat(300 * 1024);
    let url = gw.url("/webhooks/payments");
    (0..8)
        .map(|i| {
            let (c, url, body) = (client(), url.clone(), body.clone());
            let key = format!("{prefix}-{i}");
            tokio::spawn(async move {
                let h = [("idempotency-key", key.as_str()), ("x-account-id", "a")];
                send(&c, Method::POST, &url, &h, body).await
            })
        })
        .collect()
}

#[tokio::test]
async fn a_slow_upstream_cannot_make_the_gateway_buffer_more_than_max_buffered_bytes() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(800),
        ..Default::default()
    })
    .await;
    let gw = gateway_with_a_1mib_budget(&up.url()).await;
    let tasks = eight_300kib_keyed_posts(&gw, "big");
    let mut peak = 0;
    while tasks.iter().any(|t| !t.is_finished()) {
        peak = peak.max(gw.gateway.buffered_bytes());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let mut ok = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            201 => ok += 1,
            503 => assert_eq!(r.problem(), "overloaded"),
            other => panic!("unexpected {other}"),
        }
    }
    // 1 MiB holds three 300 KiB bodies (plus their small answers, counted as they arrive).
    assert!((1..=3).contains(&ok), "{ok} admitted");
    assert_eq!(up.executions(), ok);
    assert!(peak <= 1024 * 1024, "peak {peak} bytes");
    assert_eq!(gw.gateway.buffered_bytes(), 0, "every byte given back");
}

/// An HTTP/1.1 upstream on raw TCP that reads each request body slowly: after the head and
/// a first few bytes of the body it stops reading until released, then reads the rest a few
/// bytes at a time and answers `201 {}`. It counts the requests it saw (their heads) and how
/// many bodies it is reading now.
struct SlowReader {
    addr: std::net::SocketAddr,
    heads: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    reading: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    release: std::sync::Arc<tokio::sync::Semaphore>,
    _task: tokio::task::JoinHandle<()>,
}

impl SlowReader {
    async fn start() -> SlowReader {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicUsize, Ordering};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (heads, reading) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let (h, r, rel) = (heads.clone(), reading.clone(), release.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let (h, r, rel) = (h.clone(), r.clone(), rel.clone());
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut few = [0u8; 16];
                    loop {
                        // The head (read a few bytes at a time, never past its end by much).
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            match conn.read(&mut few).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&few[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        buf.drain(..end);
                        h.fetch_add(1, Ordering::SeqCst);
                        r.fetch_add(1, Ordering::SeqCst);
                        // Stalled until the test releases this body.
                        rel.acquire().await.unwrap().forget();
                        let mut chunk = [0u8; 512];
                        while buf.len() < length {
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..length);
                        r.fetch_sub(1, Ordering::SeqCst);
                        let answer = "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
                        if conn.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        SlowReader {
            addr,
            heads,
            reading,
            release,
            _task: task,
        }
    }

    fn heads(&self) -> usize {
        self.heads.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn reading(&self) -> usize {
        self.reading.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// `max_buffered_bytes` in front of an upstream that reads bodies slowly: the bodies the
/// gateway admitted stay buffered while the upstream reads them, and new requests past the
/// budget are refused (503 `overloaded`, `Retry-After`), never forwarded; `/metrics` shows
/// the gauge and the refusals by bound.
#[tokio::test]
async fn bodies_held_for_a_slow_reading_upstream_never_exceed_max_buffered_bytes() {
    let up = SlowReader::start().await;
    let gw = gateway_with_a_1mib_budget(&format!("http://{}", up.addr)).await;
    let tasks = eight_300kib_keyed_posts(&gw, "slow");
    // While the upstream reads nothing more, every request is either at the upstream or
    // already answered by the gateway.
    wait_until(
        "every request is answered or at the stalled upstream",
        Duration::from_secs(10),
        || async { tasks.iter().filter(|t| t.is_finished()).count() + up.reading() == 8 },
    )
    .await;
    // Bodies are reserved as they arrive: which of the eight fit in 1 MiB depends on how
    // their bytes interleave, but at most three 300 KiB bodies do, at least one always does
    // (a refusal gives its bytes back at once), and every other is refused, never forwarded.
    let admitted = up.reading();
    assert!(
        (1..=3).contains(&admitted),
        "{admitted} bodies admitted at once"
    );
    let admin = format!("http://{}/metrics", gw.admin);
    let c = client();
    let text =
        String::from_utf8_lossy(&send(&c, Method::GET, &admin, &[], "").await.body).into_owned();
    assert_eq!(
        metric(&text, "idemgate_buffered_bytes "),
        (admitted * 300 * 1024) as f64,
        "the gauge holds the admitted bodies, and nothing of the refused ones"
    );
    assert_eq!(
        metric(
            &text,
            "idemgate_overloaded_total{upstream=\"app\",bound=\"max_buffered_bytes\"}"
        ),
        (8 - admitted) as f64
    );
    up.release.add_permits(8);
    let mut ok = 0;
    for t in tasks {
        let r = t.await.unwrap();
        match r.status {
            201 => ok += 1,
            503 => {
                assert_eq!(r.problem(), "overloaded");
                assert!(r.headers.contains_key("retry-after"));
            }
            other => panic!("unexpected {other}"),
        }
    }
    assert_eq!(ok, admitted);
    assert_eq!(up.heads(), admitted, "no refused request was forwarded");
    wait_until(
        "every byte is given back",
        Duration::from_secs(10),
        || async {
            let m = send(&c, Method::GET, &admin, &[], "").await;
            metric(
                &String::from_utf8_lossy(&m.body),
                "idemgate_buffered_bytes ",
            ) == 0.0
        },
    )
    .await;
}

/// Routes are matched in file order, the first that fits wins, even where a later one is
/// more specific (for the methods they share: a route that an earlier one shadows whole is
/// refused at load); a route's `methods` leaves other methods to the routes after it; an
/// exact `path` takes that path (and its one trailing slash), never a longer one. Two
/// upstreams tell which route took each request.
#[tokio::test]
async fn the_first_route_in_file_order_wins_and_methods_and_exact_paths_leave_the_rest() {
    let (a, b) = (Upstream::start().await, Upstream::start().await);
    let db = pg::fresh_database().await;
    let yaml = format!(
        r#"{head}upstreams:
  a: {{ url: "{a}", connect_timeout: 200ms, timeout: 5s }}
  b: {{ url: "{b}", connect_timeout: 200ms, timeout: 5s }}
routes:
  - name: orders
    match: {{ path_prefix: /orders, methods: [POST] }}
    upstream: a
  - name: special-orders
    match: {{ path_prefix: /orders/special }}
    upstream: b
  - name: submit-post
    match: {{ path: /submit, methods: [POST] }}
    upstream: a
  - name: exact
    match: {{ path: /exact }}
    upstream: a
  - name: rest
    match: {{ path_prefix: / }}
    upstream: b
"#,
        head = config_head(&pg_store_block(&db)),
        a = a.url(),
        b = b.url(),
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    for (method, path) in [
        (Method::POST, "/orders/special/1"),
        (Method::GET, "/orders/special/2"),
        (Method::GET, "/submit"),
        (Method::POST, "/submit"),
        (Method::GET, "/exact"),
        (Method::GET, "/exact/"),
        (Method::GET, "/exact/more"),
        (Method::GET, "/exactly"),
    ] {
        let r = send(&c, method.clone(), &gw.url(path), &[], "").await;
        assert_eq!(r.status, 201, "{method} {path}");
    }
    let took = |up: &Upstream| -> Vec<(String, String)> {
        up.seen().into_iter().map(|s| (s.method, s.uri)).collect()
    };
    let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
        list.iter()
            .map(|(m, p)| (m.to_string(), p.to_string()))
            .collect()
    };
    assert_eq!(
        took(&a),
        pairs(&[
            ("POST", "/orders/special/1"), // orders, first in the file
            ("POST", "/submit"),
            ("GET", "/exact"),
            ("GET", "/exact"), // the trailing slash: the configured spelling is forwarded
        ])
    );
    assert_eq!(
        took(&b),
        pairs(&[
            ("GET", "/orders/special/2"), // not a POST: special-orders'
            ("GET", "/submit"),           // not a POST: the catch-all's
            ("GET", "/exact/more"),
            ("GET", "/exactly"),
        ])
    );
}
