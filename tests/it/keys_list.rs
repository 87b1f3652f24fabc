//! Listing keys (`idemgate keys list`, `GET /v1/keys` without `key`; docs/operations.md,
//! "Listing held keys"): every filter on every store, paging that misses and repeats no key
//! whatever the filter matches, a page that reads a bounded number of rows (keyset on the
//! primary key, the plan checked on PostgreSQL), invalid parameters named, the release
//! binary's table and JSON, and the embedded store through the admin API while `serve` runs.

use std::collections::BTreeSet;
use std::process::Command;
use std::time::Duration;

use http::Method;
use idemgate::store::{Claim, ClaimRequest};

use crate::support::*;

backend_tests!(postgres: Postgres, sqlite: Sqlite, pgbouncer: Pgbouncer, partitioned: Partitioned; [
    every_filter_lists_exactly_the_keys_it_names,
    paging_misses_and_repeats_no_key_whatever_the_filter_matches,
    an_invalid_parameter_is_400_naming_it,
]);

/// A second keyed route (`refunds`), for the route filter.
fn with_refunds(yaml: String) -> String {
    yaml.patch(
        "  - name: rest\n",
        "  - name: refunds\n    match: { path_prefix: /refund }\n    upstream: app\n    idempotency:\n      scope: { header: X-Account-Id }\n  - name: rest\n",
    )
}

/// One page of `GET /v1/keys?{query}`.
async fn page(gw: &TestGateway, query: &str) -> Reply {
    admin_request(gw, Method::GET, &format!("/v1/keys?{query}"), None).await
}

/// `(scope, key)` of each key of a page's JSON.
fn pairs(body: &serde_json::Value) -> Vec<(String, String)> {
    body["keys"]
        .as_array()
        .unwrap_or_else(|| panic!("no keys array: {body}"))
        .iter()
        .map(|k| {
            (
                k["scope"].as_str().unwrap().to_string(),
                k["key"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The keys of one page that must be the last: 200, and `next_cursor` null.
async fn only_page(gw: &TestGateway, query: &str) -> Vec<(String, String)> {
    let r = page(gw, query).await;
    assert_eq!(r.status, 200, "{query}: {r:?}");
    let body = r.json();
    assert!(body["next_cursor"].is_null(), "{query}: {body}");
    pairs(&body)
}

fn pair(scope: &str, key: &str) -> (String, String) {
    (scope.to_string(), key.to_string())
}

/// Claims `(scope, key)` for the `payments` route through the store, leased for a minute:
/// a key in flight that no request will finish during the test.
async fn claim_in_flight(gw: &TestGateway, scope: &str, key: &str) {
    let fp = idemgate::fingerprint::sha256(key.as_bytes());
    let claimed = gw
        .store
        .claim(ClaimRequest {
            scope,
            key,
            route: "payments",
            fingerprint: &fp,
            lease: Duration::from_secs(60),
            ttl: Duration::from_secs(3600),
            hold_expired_leases: true,
        })
        .await
        .unwrap();
    assert!(matches!(claimed, Claim::Acquired { .. }), "{claimed:?}");
}

/// Moves a key's `created_at` two hours back, in whichever store the gateway has.
async fn backdate(gw: &TestGateway, backend: Backend, key: &str) {
    if backend == Backend::Sqlite {
        // The gateway holds its instance lock, not SQLite's: a second connection may write.
        let conn = rusqlite::Connection::open(&gw.db).unwrap();
        conn.busy_timeout(Duration::from_secs(5)).unwrap();
        let n = conn
            .execute(
                "UPDATE idemgate_keys SET created_at = created_at - 7200000 WHERE key = ?1",
                [key],
            )
            .unwrap();
        assert_eq!(n, 1);
    } else {
        let n = gw
            .sql()
            .await
            .execute(
                "UPDATE idemgate_keys SET created_at = created_at - interval '2 hours' WHERE key = $1",
                &[&key],
            )
            .await
            .unwrap();
        assert_eq!(n, 1);
    }
}

async fn every_filter_lists_exactly_the_keys_it_names(b: Backend) {
    // The first execution is held at the upstream's gate past the route's timeout: its
    // outcome is unknown and the route holds such keys.
    let (up, _gate) = Upstream::start_gated().await;
    let (gw, _db) =
        TestGateway::on_with(b, &up, "lease: 5s\n      on_unknown_outcome: hold", |y| {
            with_refunds(y.patch("timeout: 5s", "timeout: 500ms"))
        })
        .await;
    let c = client();
    let r = post(&c, &gw, "a", "held", "x").await;
    assert_eq!((r.status, r.problem().as_str()), (504, "upstream-timeout"));
    up.set(Behavior::default());
    assert_eq!(post(&c, &gw, "a", "k1", "x").await.status, 201);
    assert_eq!(post(&c, &gw, "b", "k2", "x").await.status, 201);
    let refund = post_to(&c, &gw.url("/refund"), "a", "r1", "x").await;
    assert_eq!(refund.status, 201);
    claim_in_flight(&gw, "header:c", "busy").await;

    let (held, k1, r1, k2, busy) = (
        pair("header:a", "held"),
        pair("header:a", "k1"),
        pair("header:a", "r1"),
        pair("header:b", "k2"),
        pair("header:c", "busy"),
    );
    let everything = vec![
        held.clone(),
        k1.clone(),
        r1.clone(),
        k2.clone(),
        busy.clone(),
    ];
    assert_eq!(only_page(&gw, "").await, everything);
    assert_eq!(only_page(&gw, "state=unknown").await, vec![held.clone()]);
    assert_eq!(only_page(&gw, "state=in_flight").await, vec![busy.clone()]);
    assert_eq!(
        only_page(&gw, "state=completed").await,
        vec![k1.clone(), r1.clone(), k2.clone()]
    );
    assert_eq!(only_page(&gw, "state=not_replayable").await, vec![]);
    assert_eq!(only_page(&gw, "route=refunds").await, vec![r1.clone()]);
    assert_eq!(
        only_page(&gw, "route=payments").await,
        vec![held.clone(), k1.clone(), k2.clone(), busy.clone()]
    );
    assert_eq!(
        only_page(&gw, "scope=a").await,
        vec![held.clone(), k1.clone(), r1.clone()]
    );
    assert_eq!(
        only_page(&gw, "scope=a&route=payments").await,
        vec![held.clone(), k1.clone()]
    );
    assert_eq!(only_page(&gw, "scope=header%3Ab").await, vec![k2.clone()]);
    assert_eq!(
        only_page(&gw, "scope=a&state=completed&route=refunds").await,
        vec![r1.clone()]
    );
    assert_eq!(only_page(&gw, "scope=nobody").await, vec![]);
    assert_eq!(only_page(&gw, "older_than=1h").await, vec![]);
    backdate(&gw, b, "held").await;
    assert_eq!(only_page(&gw, "older_than=1h").await, vec![held.clone()]);
    assert_eq!(
        only_page(&gw, "older_than=1h&state=unknown&scope=a").await,
        vec![held.clone()]
    );
    assert_eq!(
        only_page(&gw, "older_than=1h&state=completed").await,
        vec![]
    );

    // Each key as `keys show` prints it: the same JSON.
    let listed = page(&gw, "state=unknown").await.json();
    let shown = page(&gw, "scope=a&key=held").await.json();
    assert_eq!(listed["keys"][0], shown, "{listed}");
    assert_eq!(shown["state"], "unknown");
    assert_eq!(shown["route"], "payments");
    let busy_json = page(&gw, "state=in_flight").await.json();
    assert_eq!(busy_json["keys"][0]["state"], "in_flight");
    assert!(
        busy_json["keys"][0]["lease_expires_at"].is_string(),
        "{busy_json}"
    );
    assert_eq!(up.executions(), 4);
}

/// Every page of `query` with `limit`, following `next_cursor` until it is null: the keys in
/// order, and how many pages held none.
async fn all_pages(gw: &TestGateway, query: &str, limit: usize) -> (Vec<(String, String)>, usize) {
    let mut keys = Vec::new();
    let mut empty_pages = 0;
    let mut cursor: Option<String> = None;
    for _ in 0..1000 {
        let q = match &cursor {
            Some(c) => format!("{query}&limit={limit}&cursor={c}"),
            None => format!("{query}&limit={limit}"),
        };
        let r = page(gw, &q).await;
        assert_eq!(r.status, 200, "{q}: {r:?}");
        let body = r.json();
        let got = pairs(&body);
        assert!(got.len() <= limit, "{q}: {} keys", got.len());
        if got.is_empty() {
            empty_pages += 1;
        }
        keys.extend(got);
        match body["next_cursor"].as_str() {
            Some(c) => cursor = Some(c.to_string()),
            None => return (keys, empty_pages),
        }
    }
    panic!("{query}: the listing did not end within 1000 pages");
}

async fn paging_misses_and_repeats_no_key_whatever_the_filter_matches(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    let mut requests = Vec::new();
    for account in ["a", "b", "c"] {
        for i in 0..45 {
            requests.push((account.to_string(), format!("k{i:03}")));
        }
    }
    let urls = vec![gw.url("/pay")];
    for chunk in requests.chunks(15) {
        for reply in at_once(&urls, chunk.to_vec(), "x").await {
            assert_eq!(reply.status, 201, "{reply:?}");
        }
    }
    // Three keys in flight, far apart in the walk.
    for (scope, key) in [
        ("header:a", "k010x"),
        ("header:b", "k030x"),
        ("header:c", "k044x"),
    ] {
        claim_in_flight(&gw, scope, key).await;
    }
    let everything = only_page(&gw, "limit=1000").await;
    assert_eq!(everything.len(), 138);
    let mut sorted = everything.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(sorted.len(), 138, "no key twice");

    // Unfiltered, 7 at a time: the same keys in the same order.
    let (paged, empty) = all_pages(&gw, "", 7).await;
    assert_eq!(paged, everything);
    assert_eq!(empty, 0);

    // A filter that matches 3 of 138 rows, 2 keys a page: each page reads at most 20 rows,
    // so most pages hold no key, and the cursor still moves on to the end.
    let (in_flight, empty) = all_pages(&gw, "state=in_flight", 2).await;
    assert_eq!(
        in_flight,
        vec![
            pair("header:a", "k010x"),
            pair("header:b", "k030x"),
            pair("header:c", "k044x"),
        ]
    );
    assert!(
        empty >= 4,
        "{empty} empty pages: a page reads at most 20 rows of 138"
    );

    // One scope, 4 at a time.
    let (b_keys, _) = all_pages(&gw, "scope=b", 4).await;
    let expected: Vec<_> = everything
        .iter()
        .filter(|(s, _)| s == "header:b")
        .cloned()
        .collect();
    assert_eq!(b_keys.len(), 46);
    assert_eq!(b_keys, expected);
    let set: BTreeSet<_> = b_keys.iter().collect();
    assert_eq!(set.len(), 46);

    // A cursor names its scope: one of scope b's listing is refused in scope a's.
    let first = page(&gw, "scope=b&limit=4").await.json();
    let cursor = first["next_cursor"].as_str().unwrap().to_string();
    let other = page(&gw, &format!("scope=a&cursor={cursor}")).await;
    assert_eq!(
        (other.status, other.problem().as_str()),
        (400, "invalid-parameter")
    );
    assert!(other.problem_detail().contains("'cursor'"), "{other:?}");
}

async fn an_invalid_parameter_is_400_naming_it(b: Backend) {
    let up = Upstream::start().await;
    let (gw, _db) = TestGateway::on(b, &up, "").await;
    assert_eq!(post(&client(), &gw, "a", "k", "x").await.status, 201);
    for (query, param) in [
        ("cursor=zz", "cursor"),
        ("cursor=7b7d", "cursor"), // the hex of `{}`
        ("cursor=", "cursor"),
        ("state=held", "state"),
        ("limit=0", "limit"),
        ("limit=1001", "limit"),
        ("limit=ten", "limit"),
        ("older_than=10", "older_than"),
        ("older_than=-1m", "older_than"),
        ("route=nope", "route"),
        ("route=rest&scope=a", "route"), // a route without keys
    ] {
        let r = page(&gw, query).await;
        assert_eq!(r.status, 400, "{query}: {r:?}");
        assert_eq!(r.problem(), "invalid-parameter", "{query}");
        assert!(
            r.problem_detail().contains(&format!("'{param}'")),
            "{query}: {}",
            r.problem_detail()
        );
    }
    // The limit's bounds themselves are fine.
    assert_eq!(page(&gw, "limit=1000").await.status, 200);
    assert_eq!(page(&gw, "limit=1").await.status, 200);
}

/// The listing statement on a table of 25,000 rows after ANALYZE (200 scopes of 100 keys, one
/// of 5,000), with the parameters of a first page, a later page, a page of one scope and a
/// filtered page: the plan reads the keys table through the primary key's index only, never
/// sequentially. Where the walk may be long (the whole table, the large scope) it is the
/// ordered index scan that `LIMIT` stops; in a scope of 100 keys the planner may read the
/// rest of the scope through a bitmap of the same index, as many rows as the scope holds
/// after the cursor.
#[tokio::test]
async fn the_listing_walks_the_primary_key_and_never_scans_the_table() {
    use tokio_postgres::types::{ToSql, Type};
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let db = gw.sql().await;
    db.execute(
        "INSERT INTO idemgate_keys (scope, key, route, fingerprint, state, status, headers, body, expires_at, gc_after)
         SELECT 'header:acct_' || (g % 200), md5(g::text), 'payments', '\\x00'::bytea,
                CASE WHEN g % 97 = 0 THEN 'unknown' ELSE 'completed' END,
                201, ''::bytea, 'b'::bytea, now() + interval '1 hour', now() + interval '1 hour'
           FROM generate_series(1, 20000) g
         UNION ALL
         SELECT 'header:big', md5('big' || g), 'payments', '\\x00'::bytea, 'completed',
                201, ''::bytea, 'b'::bytea, now() + interval '1 hour', now() + interval '1 hour'
           FROM generate_series(1, 5000) g",
        &[],
    )
    .await
    .unwrap();
    db.execute("ANALYZE idemgate_keys", &[]).await.unwrap();
    let mid: (String, String) = {
        let r = db
            .query_one(
                "SELECT scope, key FROM idemgate_keys ORDER BY scope, key OFFSET 9000 LIMIT 1",
                &[],
            )
            .await
            .unwrap();
        (r.get(0), r.get(1))
    };
    let none: Option<&str> = None;
    let no_age: Option<i64> = None;
    let (unknown, payments, hour) = (Some("unknown"), Some("payments"), Some(3_600_000_i64));
    let (scope, key) = (Some(mid.0.as_str()), Some(mid.1.as_str()));
    let (big, big_key) = (Some("header:big"), Some("8"));
    let (l50, e500, l1000, e10000) = (50_i64, 500_i64, 1000_i64, 10_000_i64);
    type Params<'a> = [&'a (dyn ToSql + Sync); 8];
    // (what, after, one scope, the ordered index scan required, the parameters)
    let cases: Vec<(&str, bool, bool, bool, Params)> = vec![
        (
            "first page",
            false,
            false,
            true,
            [&none, &none, &none, &none, &none, &no_age, &l50, &e500],
        ),
        (
            "later page",
            true,
            false,
            true,
            [&scope, &key, &none, &none, &none, &no_age, &l50, &e500],
        ),
        (
            "filtered",
            true,
            false,
            true,
            [
                &scope, &key, &none, &unknown, &payments, &hour, &l1000, &e10000,
            ],
        ),
        (
            "large scope",
            true,
            true,
            true,
            [&big, &big_key, &big, &none, &none, &no_age, &l50, &e500],
        ),
        (
            "first page of a large scope",
            false,
            true,
            true,
            [&none, &none, &big, &unknown, &none, &no_age, &l50, &e500],
        ),
        (
            "small scope",
            true,
            true,
            false,
            [&scope, &key, &scope, &none, &none, &no_age, &l50, &e500],
        ),
        (
            "first page of a small scope",
            false,
            true,
            false,
            [&none, &none, &scope, &unknown, &none, &no_age, &l50, &e500],
        ),
    ];
    for (what, after, scoped, ordered, params) in cases {
        let sql = format!(
            "EXPLAIN (FORMAT JSON) {}",
            idemgate::store::postgres::list_sql(after, scoped)
        );
        let typed: Vec<(&(dyn ToSql + Sync), Type)> = params
            .iter()
            .copied()
            .zip(idemgate::store::postgres::LIST_TYPES.iter().cloned())
            .collect();
        let text: JsonText = db.query_typed(&sql, &typed).await.unwrap()[0].get(0);
        let plan: serde_json::Value = serde_json::from_str(&text.0).unwrap();
        let mut nodes = Vec::new();
        collect_nodes(&plan, &mut nodes);
        let on_keys: Vec<&serde_json::Value> = nodes
            .iter()
            .copied()
            .filter(|n| n["Relation Name"] == "idemgate_keys")
            .collect();
        assert!(
            !on_keys.is_empty(),
            "{what}: no scan of the keys table in {plan}"
        );
        for n in &on_keys {
            let index = match n["Node Type"].as_str() {
                Some("Index Scan") => &n["Index Name"],
                Some("Bitmap Heap Scan") if !ordered => &n["Plans"][0]["Index Name"],
                _ => panic!("{what}: {n} in {plan}"),
            };
            assert_eq!(index, "idemgate_keys_pkey", "{what}: {plan}");
        }
        assert!(
            !nodes.iter().any(|n| n["Node Type"] == "Seq Scan"),
            "{what}: {plan}"
        );
    }

    // What a page reads, counted by the server: a first page of 50 with a filter that
    // matches one row in 97 reads 500 rows of the 25,000 (10 per key of its limit), finds
    // the few that match among them, and leaves the rest of the table unread.
    let sql = format!(
        "EXPLAIN (ANALYZE, FORMAT JSON) {}",
        idemgate::store::postgres::list_sql(false, false)
    );
    let params: Params = [&none, &none, &none, &unknown, &none, &no_age, &l50, &e500];
    let typed: Vec<(&(dyn ToSql + Sync), Type)> = params
        .iter()
        .copied()
        .zip(idemgate::store::postgres::LIST_TYPES.iter().cloned())
        .collect();
    let text: JsonText = db.query_typed(&sql, &typed).await.unwrap()[0].get(0);
    let plan: serde_json::Value = serde_json::from_str(&text.0).unwrap();
    let mut nodes = Vec::new();
    collect_nodes(&plan, &mut nodes);
    let rows = |n: &serde_json::Value, field: &str| n[field].as_f64().unwrap_or(-1.0);
    let read: Vec<f64> = nodes
        .iter()
        .filter(|n| n["Relation Name"] == "idemgate_keys")
        .map(|n| rows(n, "Actual Rows") * rows(n, "Actual Loops"))
        .collect();
    assert_eq!(read, vec![500.0], "rows read from the keys table: {plan}");
    // The page's rows: the matches, and the last row read when it is not one (the cursor).
    let expected: i64 = db
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'unknown')
                    + CASE WHEN (array_agg(state ORDER BY scope, key))[500] = 'unknown'
                           THEN 0 ELSE 1 END
               FROM (SELECT scope, key, state FROM idemgate_keys ORDER BY scope, key LIMIT 500) w",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        rows(&plan[0]["Plan"], "Actual Rows"),
        expected as f64,
        "{plan}"
    );
}

/// A `json` value as its text.
struct JsonText(String);

impl<'a> tokio_postgres::types::FromSql<'a> for JsonText {
    fn from_sql(
        _: &tokio_postgres::types::Type,
        raw: &'a [u8],
    ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
        Ok(JsonText(String::from_utf8(raw.to_vec())?))
    }

    fn accepts(ty: &tokio_postgres::types::Type) -> bool {
        *ty == tokio_postgres::types::Type::JSON
    }
}

/// Every plan node of an `EXPLAIN (FORMAT JSON)` output.
fn collect_nodes<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Value>) {
    match v {
        serde_json::Value::Array(items) => items.iter().for_each(|i| collect_nodes(i, out)),
        serde_json::Value::Object(map) => {
            if map.contains_key("Node Type") {
                out.push(v);
            }
            for (_, child) in map {
                collect_nodes(child, out);
            }
        }
        _ => {}
    }
}

/// Runs the release binary with `args`; (exit code, stdout, stderr).
async fn idemgate(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(crate::support::bin::idemgate())
            .args(&args)
            .output()
            .unwrap();
        (
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    })
    .await
    .unwrap()
}

fn args(config: &std::path::Path, rest: &[&str]) -> Vec<String> {
    let mut v: Vec<String> = ["keys", "list", "--config"].map(String::from).to_vec();
    v.push(config.display().to_string());
    v.extend(rest.iter().map(|s| s.to_string()));
    v
}

/// `idemgate keys list` on the release binary, on PostgreSQL directly and through PgBouncer:
/// the table, `--json` with the same per-key JSON as `keys show`, paging by `--cursor`, and
/// invalid flags named with exit 1.
#[tokio::test]
async fn keys_list_prints_a_table_and_json_from_the_command_line() {
    for backend in [Backend::Postgres, Backend::Pgbouncer] {
        let (up, _gate) = Upstream::start_gated().await;
        let (yaml, db) = fresh_config(
            backend,
            &up.url(),
            "lease: 5s\n      on_unknown_outcome: hold",
        )
        .await;
        let yaml = yaml.patch("timeout: 5s", "timeout: 500ms");
        let gw = TestGateway::start(&yaml, &db).await;
        let c = client();
        let r = post(&c, &gw, "acct 1", "held-1", "x").await;
        assert_eq!(r.status, 504, "{backend:?}");
        up.set(Behavior::default());
        for k in ["k1", "k2", "k3"] {
            assert_eq!(post(&c, &gw, "acct 2", k, "x").await.status, 201);
        }
        let config = std::env::temp_dir().join(format!(
            "idemgate-keys-list-{}-{}.yaml",
            std::process::id(),
            gw.addr.port()
        ));
        std::fs::write(&config, &yaml).unwrap();

        let (code, out, err) = idemgate(args(&config, &["--state", "unknown"])).await;
        assert_eq!(code, 0, "{backend:?}: {err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 3, "{backend:?}: {out}");
        for column in [
            "KEY ID",
            "SCOPE",
            "KEY",
            "ROUTE",
            "STATE",
            "AGE",
            "LEASE LEFT",
        ] {
            assert!(lines[0].contains(column), "{out}");
        }
        let cells: Vec<&str> = lines[1].split("  ").filter(|c| !c.is_empty()).collect();
        assert_eq!(cells.len(), 7, "{out}");
        assert_eq!(cells[0].trim().len(), 32, "the key id: {out}");
        assert_eq!(
            cells[1..5].iter().map(|c| c.trim()).collect::<Vec<_>>(),
            ["header:acct 1", "held-1", "payments", "unknown"],
            "{out}"
        );
        assert_eq!(cells[6].trim(), "-", "no lease on a held key: {out}");
        assert_eq!(lines[2], "1 key(s); end of the listing");

        let (code, out, err) = idemgate(args(&config, &["--state", "unknown", "--json"])).await;
        assert_eq!(code, 0, "{err}");
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        let shown = admin_request(&gw, Method::GET, "/v1/keys?scope=acct%201&key=held-1", None)
            .await
            .json();
        assert_eq!(v["keys"].as_array().unwrap().len(), 1, "{v}");
        assert_eq!(v["keys"][0], shown);
        assert!(v["next_cursor"].is_null());

        // Two pages of two, then the end.
        let (code, out, _) = idemgate(args(&config, &["--limit", "2", "--json"])).await;
        assert_eq!(code, 0);
        let first: serde_json::Value = serde_json::from_str(&out).unwrap();
        let cursor = first["next_cursor"].as_str().unwrap().to_string();
        let (code, out, _) = idemgate(args(
            &config,
            &["--limit", "2", "--json", "--cursor", &cursor],
        ))
        .await;
        assert_eq!(code, 0);
        let second: serde_json::Value = serde_json::from_str(&out).unwrap();
        let mut all = pairs(&first);
        all.extend(pairs(&second));
        assert_eq!(
            all,
            vec![
                pair("header:acct 1", "held-1"),
                pair("header:acct 2", "k1"),
                pair("header:acct 2", "k2"),
                pair("header:acct 2", "k3"),
            ]
        );
        assert!(second["next_cursor"].is_null(), "{second}");
        let (code, out, _) =
            idemgate(args(&config, &["--scope", "acct 2", "--older-than", "1h"])).await;
        assert_eq!(code, 0);
        assert!(out.ends_with("0 key(s); end of the listing\n"), "{out}");

        for (flags, named) in [
            (vec!["--cursor", "not-a-cursor"], "invalid --cursor"),
            (vec!["--state", "stuck"], "invalid --state"),
            (vec!["--limit", "5000"], "invalid --limit"),
            (vec!["--older-than", "soon"], "invalid --older-than"),
        ] {
            let (code, out, err) = idemgate(args(&config, &flags)).await;
            assert_eq!(code, 1, "{flags:?}: {out}{err}");
            assert!(err.contains(named), "{flags:?}: {err}");
            assert!(out.is_empty(), "{flags:?}: {out}");
        }
        let _ = std::fs::remove_file(config);
    }
}

/// The embedded store while a release-binary `serve` holds its file: `keys list` is refused
/// with the admin endpoint to use, and `GET /v1/keys` on the admin listener lists the keys.
#[tokio::test]
async fn the_embedded_store_lists_through_the_admin_api_while_serve_runs() {
    let file = TempDb::new();
    let up = Upstream::start().await;
    let yaml = format!(
        "{}admin: {{ listen: 127.0.0.1:0 }}\n",
        config_yaml_store(&sqlite_store_block(&file.0), &up.url(), "")
    );
    let gw = crate::support::process::GatewayProcess::start(&yaml).await;
    let c = client();
    for k in ["k1", "k2", "k3"] {
        assert_eq!(post_to(&c, &gw.url("/pay"), "a", k, "x").await.status, 201);
    }
    let admin = gw.admin.expect("the gateway announced its admin listener");
    let get = |query: &str| {
        let url = format!("http://{admin}/v1/keys?{query}");
        let c = c.clone();
        async move { send(&c, Method::GET, &url, &[], "").await }
    };
    let first = get("limit=2").await;
    assert_eq!(first.status, 200, "{first:?}");
    let first = first.json();
    let cursor = first["next_cursor"].as_str().unwrap().to_string();
    let second = get(&format!("limit=2&cursor={cursor}")).await.json();
    let mut all = pairs(&first);
    all.extend(pairs(&second));
    assert_eq!(
        all,
        vec![
            pair("header:a", "k1"),
            pair("header:a", "k2"),
            pair("header:a", "k3")
        ]
    );
    assert!(second["next_cursor"].is_null());
    let bad = get("cursor=00").await;
    assert_eq!(
        (bad.status, bad.problem().as_str()),
        (400, "invalid-parameter")
    );

    let (code, _, err) = idemgate(args(&gw.config, &["--state", "unknown"])).await;
    assert_eq!(code, 1, "{err}");
    assert!(
        err.contains("another idemgate instance is using") && err.contains("GET /v1/keys"),
        "{err}"
    );
}
