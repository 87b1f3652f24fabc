//! The request flow of docs/contract.md §2 through a real gateway, Postgres and upstream.

use std::time::Duration;

use http::Method;
use idemgate::store::ClaimRequest;

use crate::support::*;

#[tokio::test]
async fn routes_and_methods_without_idempotency_are_plain_proxied() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    // GET on the keyed route: not in idempotency.methods.
    for _ in 0..2 {
        let r = send(
            &c,
            Method::GET,
            &gw.url("/pay?x=1"),
            &[("idempotency-key", "k"), ("x-account-id", "a")],
            "",
        )
        .await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    // POST on the route without idempotency.
    for _ in 0..2 {
        let r = send(
            &c,
            Method::POST,
            &gw.url("/other"),
            &[("idempotency-key", "k")],
            "b",
        )
        .await;
        assert!(!r.replayed());
    }
    // A keyed route without a key (not required): forwarded without a claim.
    for _ in 0..2 {
        let r = send(
            &c,
            Method::POST,
            &gw.url("/pay"),
            &[("x-account-id", "a")],
            "b",
        )
        .await;
        assert_eq!(r.status, 201);
        assert!(!r.replayed());
    }
    assert_eq!(up.executions(), 6);
    assert_eq!(up.seen()[0].uri, "/pay?x=1", "path and query are forwarded");
}

#[tokio::test]
async fn forwarded_requests_are_clean_and_carry_the_key() {
    // The upstream's answer has hop-by-hop headers of its own, one named in its Connection.
    let mut hop = http::HeaderMap::new();
    hop.insert("connection", "x-up-hop".parse().unwrap());
    hop.insert("x-up-hop", "secret".parse().unwrap());
    hop.insert("keep-alive", "timeout=5".parse().unwrap());
    let up = Upstream::start_with(Behavior {
        headers: hop,
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(&up, "forward_key_header: X-Request-Key").await;
    let c = client();
    let r = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", "\"quoted-key\""),
            ("x-account-id", "a"),
            ("connection", "x-secret"),
            ("x-secret", "hop"),
            ("x-forwarded-for", "10.0.0.1"),
            ("x-forwarded-for", "10.0.0.2"),
            ("host", "public.example"),
            ("proxy-authorization", "Basic eA=="),
        ],
        "b",
    )
    .await;
    assert_eq!(r.status, 201);
    for hop in ["connection", "x-up-hop", "keep-alive"] {
        assert!(
            !r.headers.contains_key(hop),
            "the upstream's {hop} is not passed on: {:?}",
            r.headers
        );
    }
    let seen = &up.seen()[0];
    assert_eq!(
        seen.headers["x-request-key"], "quoted-key",
        "the parsed key is sent on"
    );
    assert!(
        !seen.headers.contains_key("x-secret"),
        "headers named in Connection are stripped"
    );
    assert!(!seen.headers.contains_key("proxy-authorization"));
    assert_eq!(
        seen.headers["x-forwarded-for"], "10.0.0.1, 10.0.0.2, 127.0.0.1",
        "every earlier hop is kept"
    );
    assert_eq!(seen.headers["x-forwarded-proto"], "http");
    assert_eq!(seen.headers["x-forwarded-host"], "public.example");
    assert_eq!(seen.headers["host"], up.addr.to_string());
    assert_eq!((seen.method.as_str(), &seen.body[..]), ("POST", &b"b"[..]));
    // The quoted and the bare form are the same key.
    let again = post(&c, &gw, "a", "quoted-key", "b").await;
    assert!(again.replayed());
}

#[tokio::test]
async fn keys_and_scopes_from_the_json_body() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "")
        .patch(
            "scope: { header: X-Account-Id }",
            "scope: { json: /account_id }\n      key: [ { header: Idempotency-Key }, { json: /payment_id } ]\n      fingerprint: { json_canonical: true, json_ignore: [/sent_at] }",
        );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let webhook = r#"{"payment_id":"pay_1","account_id":"acct_9","amount":5,"sent_at":"t1"}"#;
    let reconcile =
        r#"{ "amount": 5, "sent_at": "t2", "account_id": "acct_9", "payment_id": "pay_1" }"#;
    let r1 = send(&c, Method::POST, &gw.url("/pay"), &[], webhook).await;
    let r2 = send(&c, Method::POST, &gw.url("/pay"), &[], reconcile).await;
    assert_eq!(r1.status, 201);
    assert!(
        r2.replayed(),
        "the same payment by another path is deduplicated"
    );
    assert_eq!(r1.body, r2.body);
    assert_eq!(up.executions(), 1);
    let info = gw.store.inspect("json:acct_9", "pay_1").await.unwrap();
    assert_eq!(
        info.map(|i| i.state).as_deref(),
        Some("completed"),
        "stored under the JSON scope's own namespace"
    );
}

#[tokio::test]
async fn an_authorization_scope_is_hashed_and_never_stored_raw() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "scope: { header: X-Account-Id }",
        "scope: { authorization: true }",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let alice = [
        ("idempotency-key", "k"),
        ("authorization", "Bearer alice-secret"),
    ];
    let bob = [
        ("idempotency-key", "k"),
        ("authorization", "Bearer bob-secret"),
    ];
    let a = send(&c, Method::POST, &gw.url("/pay"), &alice, "x").await;
    let b = send(&c, Method::POST, &gw.url("/pay"), &bob, "x").await;
    assert!(!b.replayed());
    assert!(
        send(&c, Method::POST, &gw.url("/pay"), &alice, "x")
            .await
            .replayed()
    );
    assert_ne!(a.body, b.body);
    let rows = gw
        .sql()
        .await
        .query("SELECT scope FROM idemgate_keys", &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 2);
    for row in rows {
        let scope: String = row.get(0);
        assert!(
            scope.starts_with("authz:") && !scope.contains("secret"),
            "{scope}"
        );
    }
}

#[tokio::test]
async fn many_instances_can_migrate_at_once() {
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, "http://127.0.0.1:9", "");
    let config = idemgate::config::Config::from_yaml(&yaml).unwrap();
    let idemgate::config::StoreConfig::Postgres(pgc) = &config.store else {
        panic!("a postgres store")
    };
    let tasks: Vec<_> = (0..5)
        .map(|_| {
            let store = idemgate::store::postgres::PgStore::new(pgc).unwrap();
            tokio::spawn(async move { store.migrate().await.unwrap() })
        })
        .collect();
    let mut applied = 0;
    for t in tasks {
        applied += t.await.unwrap();
    }
    let all = idemgate::store::postgres::MIGRATIONS.len();
    assert_eq!(applied, all, "each migration is applied once");
    let n: i64 = sql(&db)
        .await
        .query_one("SELECT count(*) FROM idemgate_migrations", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n as usize, all);
}

#[tokio::test]
async fn shutdown_lets_an_in_flight_keyed_request_finish_and_store_its_answer() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(700),
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let first = in_flight(&gw.url("/pay"), &up, "a", "k", "x").await;
    let store = gw.store.clone();
    let addr = gw.addr;
    gw.shutdown().await;
    let r = first.await.unwrap();
    assert_eq!(r.status, 201, "the in-flight request was answered");
    let info = store.inspect(&scoped("a"), "k").await.unwrap().unwrap();
    assert_eq!(info.state, "completed");
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the listener is closed after shutdown"
    );
}

/// Shutdown asks every open connection to close, idle ones too: a keep-alive connection
/// between requests and one that never sent a byte are closed by the gateway, and the server
/// returns, without waiting out a grace far longer than the test's bound.
#[tokio::test]
async fn shutdown_closes_idle_connections_without_waiting_out_the_grace() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = Upstream::start().await;
    let (gw, _file) = TestGateway::on_with(Backend::Sqlite, &up, "", |y| {
        y.replace("shutdown_grace: 5s", "shutdown_grace: 300s")
    })
    .await;
    let mut used = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    used.write_all(b"GET /plain HTTP/1.1\r\nhost: gw\r\n\r\n")
        .await
        .unwrap();
    let mut status = [0u8; 12];
    used.read_exact(&mut status).await.unwrap();
    assert_eq!(&status, b"HTTP/1.1 201", "the request was answered");
    let mut silent = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    assert_eq!(up.executions(), 1);

    tokio::time::timeout(Duration::from_secs(60), gw.shutdown())
        .await
        .expect("shutdown returned: no idle connection was left waiting for the grace");
    // The served connection ends with the rest of its answer, then the gateway's FIN.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), used.read_to_end(&mut rest))
        .await
        .expect("the keep-alive connection is still open")
        .expect("the keep-alive connection ends cleanly");
    // The silent one is closed too: with a FIN once accepted, or reset by the kernel when it
    // was still in the accept queue as the listener closed.
    let mut none = Vec::new();
    match tokio::time::timeout(Duration::from_secs(10), silent.read_to_end(&mut none)).await {
        Err(_) => panic!("the silent connection is still open"),
        Ok(Ok(_)) => assert!(none.is_empty(), "{none:?}"),
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
}

/// A crashed attempt: claim (scope "a", `key`) with the fingerprint the gateway computes for
/// a POST to /pay with `body`, and never finish.
async fn crashed_claim(gw: &TestGateway, key: &str, body: &str, lease: Duration) {
    let fp = idemgate::fingerprint::fingerprint(
        &Default::default(),
        &Method::POST,
        "payments",
        "/pay",
        &http::HeaderMap::new(),
        body.as_bytes(),
        None,
    )
    .unwrap();
    let claimed = gw
        .store
        .claim(ClaimRequest {
            scope: &scoped("a"),
            key,
            route: "payments",
            fingerprint: &fp,
            lease,
            ttl: Duration::from_secs(60),
            hold_expired_leases: false,
        })
        .await
        .unwrap();
    assert!(matches!(claimed, idemgate::store::Claim::Acquired { .. }));
}

async fn lease_expired(gw: &TestGateway, key: &str) {
    let db = gw.sql().await;
    wait_until(
        "the lease expires in database time",
        Duration::from_secs(10),
        || async {
            db.query_one(
            "SELECT lease_expires_at <= now() FROM idemgate_keys WHERE scope = 'header:a' AND key = $1",
            &[&key],
        )
        .await
        .unwrap()
        .get::<_, bool>(0)
        },
    )
    .await;
}

#[tokio::test]
async fn thirty_retries_racing_for_an_expired_lease_take_it_over_once() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(300),
        ..Default::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "lease: 3s").patch("timeout: 5s", "timeout: 1s");
    let gw = TestGateway::start(&yaml, &db).await;
    crashed_claim(&gw, "race", "x", Duration::from_millis(200)).await;
    lease_expired(&gw, "race").await;
    let replies = at_once(
        &[gw.url("/pay")],
        vec![("a".to_string(), "race".to_string()); 30],
        "x",
    )
    .await;
    for r in &replies {
        assert_eq!(
            r.status, 201,
            "no stale 502 or 422 from a racing takeover: {r:?}"
        );
        assert_eq!(r.body, replies[0].body);
    }
    assert_eq!(up.executions(), 1, "one takeover");
}

#[tokio::test]
async fn another_request_under_a_key_whose_lease_expired_is_a_mismatch_not_a_takeover() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "lease: 3s").patch("timeout: 5s", "timeout: 1s");
    let gw = TestGateway::start(&yaml, &db).await;
    crashed_claim(&gw, "k", "original", Duration::from_millis(200)).await;
    lease_expired(&gw, "k").await;
    let c = client();
    let other = post(&c, &gw, "a", "k", "a different body").await;
    assert_eq!(
        (other.status, other.problem().as_str()),
        (422, "fingerprint-mismatch")
    );
    assert_eq!(up.executions(), 0);
    // The original request's retry takes it over.
    assert_eq!(post(&c, &gw, "a", "k", "original").await.status, 201);
    assert_eq!(up.executions(), 1);
}

/// A client that hangs up while its claim is still in the database must not leave the key
/// claimed with nobody to forward it: the claim runs detached, forwards, and stores.
#[tokio::test]
async fn a_client_that_hangs_up_during_its_claim_still_gets_the_key_forwarded_and_stored() {
    use tokio::io::AsyncWriteExt;
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    // Another transaction holds the key's slot in the unique index, uncommitted: our claim
    // will wait for it.
    let mut blocker = gw.sql().await;
    let tx = blocker.transaction().await.unwrap();
    tx.execute(
        "INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, lease_token,
                                    lease_expires_at, expires_at, gc_after)
         VALUES ('header:a', 'k', 'payments', '\\x00', 'in_flight', gen_random_uuid(),
                 now() + interval '1 hour', now() + interval '1 hour', now() + interval '1 hour')",
        &[],
    )
    .await
    .unwrap();
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\nx-account-id: a\r\ncontent-length: 1\r\n\r\nx",
    )
    .await
    .unwrap();
    let db = gw.sql().await;
    wait_for_a_lock_waiter(&db).await;
    drop(s); // the client hangs up while its claim is in the database
    tx.rollback().await.unwrap();
    wait_until(
        "the key is forwarded and stored anyway",
        Duration::from_secs(10),
        || async { row_state(&gw, "a", "k").await.as_deref() == Some("completed") },
    )
    .await;
    assert_eq!(up.executions(), 1);
    assert!(post(&client(), &gw, "a", "k", "x").await.replayed());
}

/// A route's own `replay_headers` list: what it names is stored and replayed byte for byte
/// (every field line, in order, `set-cookie` too since the route names it); what it does not
/// name is not replayed, though the upstream sends it, the defaults included (`etag`): the
/// list replaces them.
#[tokio::test]
async fn a_routes_replay_headers_are_replayed_byte_identical_and_nothing_else() {
    use http::HeaderValue;
    let traces = [
        HeaderValue::from_bytes(b"t=1;  q=\"a  b\" , x").unwrap(),
        HeaderValue::from_bytes(b"caf\xe9 \x80\xff").unwrap(),
    ];
    let mut extra = http::HeaderMap::new();
    for t in &traces {
        extra.append("x-trace", t.clone());
    }
    let up = Upstream::start_with(Behavior {
        headers: extra,
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(&up, "replay_headers: [Content-Type, X-Trace, Set-Cookie]")
        .await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(first.status, 201);
    let all = |r: &Reply, name: &str| -> Vec<Vec<u8>> {
        r.headers
            .get_all(name)
            .iter()
            .map(|v| v.as_bytes().to_vec())
            .collect()
    };
    let sent: Vec<Vec<u8>> = traces.iter().map(|t| t.as_bytes().to_vec()).collect();
    assert_eq!(
        all(&first, "x-trace"),
        sent,
        "the first answer carries them as sent"
    );
    for unlisted in ["etag", "x-upstream"] {
        assert!(
            first.headers.contains_key(unlisted),
            "the upstream sends {unlisted}"
        );
    }

    let retry = post(&c, &gw, "a", "k", "x").await;
    assert!(retry.replayed());
    assert_eq!(up.executions(), 1);
    assert_eq!(retry.body, first.body);
    assert_eq!(
        all(&retry, "x-trace"),
        sent,
        "both field lines, byte for byte, in order"
    );
    assert_eq!(all(&retry, "set-cookie"), [b"session=secret".to_vec()]);
    assert_eq!(retry.headers["content-type"], "application/json");
    for unlisted in ["etag", "x-upstream"] {
        assert!(
            !retry.headers.contains_key(unlisted),
            "{unlisted} is not in the route's list: {:?}",
            retry.headers
        );
    }
}

/// `n` bytes of a fixed pseudo-random sequence: every byte value, no repeating pattern a
/// dropped or reordered chunk could hide in.
fn noise(n: usize, seed: u64) -> bytes::Bytes {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            // xorshift64
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 56) as u8
        })
        .collect::<Vec<u8>>()
        .into()
}

/// Large bodies arrive intact both ways when the route's bounds allow them: a 3 MiB keyed
/// request reaches the upstream byte for byte, and its 2 MiB answer is stored and replayed
/// byte for byte.
#[tokio::test]
async fn large_bodies_reach_the_upstream_and_are_replayed_byte_identical() {
    let request = noise(3 * 1024 * 1024, 0x1dea);
    let answer = noise(2 * 1024 * 1024, 0x9a7e);
    assert_ne!(request[..answer.len()], answer[..], "two different bodies");
    let up = Upstream::start_with(Behavior {
        body: Some(answer.clone()),
        ..Default::default()
    })
    .await;
    let gw = TestGateway::with_upstream(
        &up,
        "max_request_body: 4MiB\n      max_stored_response: 4MiB",
    )
    .await;
    let c = client();
    let h = [
        ("idempotency-key", "big"),
        ("x-account-id", "a"),
        ("content-type", "application/octet-stream"),
    ];
    let first = send(&c, Method::POST, &gw.url("/pay"), &h, request.clone()).await;
    assert_eq!(first.status, 201);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].body.len(), request.len());
    assert!(
        seen[0].body == request,
        "the upstream got the request byte for byte"
    );
    assert_eq!(first.body.len(), answer.len());
    assert!(
        first.body == answer,
        "the first answer is the upstream's, whole"
    );

    let retry = send(&c, Method::POST, &gw.url("/pay"), &h, request.clone()).await;
    assert_eq!(retry.status, 201);
    assert!(retry.replayed());
    assert_eq!(retry.body.len(), answer.len());
    assert!(
        retry.body == answer,
        "the replay is the stored answer byte for byte"
    );
    assert_eq!(up.executions(), 1);
    assert_eq!(
        row_state(&gw, "a", "big").await.as_deref(),
        Some("completed")
    );
}
