//! Every row of the status table in docs/contract.md §3, as a client sees it, with the
//! upstream's execution count and the key's state where they matter.

use http::Method;

use crate::support::*;

#[tokio::test]
async fn no_route_is_404() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "  - name: rest\n    match: { path_prefix: / }\n    upstream: app\n",
        "",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let r = send(&client(), Method::GET, &gw.url("/nowhere"), &[], "").await;
    assert_eq!(r.status, 404);
    assert_eq!(r.problem(), "no-route");
    let v = r.json();
    assert_eq!(v["status"], 404);
    assert!(v["title"].is_string() && v["detail"].is_string());
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_missing_key_on_a_required_route_is_400() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "required: true").await;
    let r = send(
        &client(),
        Method::POST,
        &gw.url("/pay"),
        &[("x-account-id", "a")],
        "x",
    )
    .await;
    assert_eq!(r.status, 400);
    assert_eq!(r.problem(), "key-missing");
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn invalid_keys_are_400() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    let long = "k".repeat(256);
    for key in ["has space", long.as_str(), "\"unterminated", "\"\""] {
        let r = post(&c, &gw, "a", key, "x").await;
        assert_eq!(r.status, 400, "key {key:?}");
        assert_eq!(r.problem(), "key-invalid", "key {key:?}");
    }
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_missing_scope_is_400_or_401_for_authorization() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    let r = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[("idempotency-key", "k")],
        "x",
    )
    .await;
    assert_eq!((r.status, r.problem().as_str()), (400, "scope-missing"));

    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "scope: { header: X-Account-Id }",
        "scope: { authorization: true }",
    );
    let gw2 = TestGateway::start(&yaml, &db).await;
    let r = send(
        &c,
        Method::POST,
        &gw2.url("/pay"),
        &[("idempotency-key", "k")],
        "x",
    )
    .await;
    assert_eq!((r.status, r.problem().as_str()), (401, "scope-missing"));
    assert_eq!(up.executions(), 0);
}

/// A scope read from the body (`scope: { json: /account_id }`): a JSON body without the
/// member (absent, null, empty, or only nested deeper) is 400 `scope-missing`, even with an
/// `X-Account-Id` header; a body that is not JSON is 400 `body-not-json`. Neither is
/// forwarded or claims anything; a body with the member is.
#[tokio::test]
async fn a_json_scope_missing_from_the_body_or_a_body_not_json_is_400_and_claims_nothing() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "scope: { header: X-Account-Id }",
        "scope: { json: /account_id }",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let h = [
        ("idempotency-key", "k"),
        ("x-account-id", "acct_1"),
        ("content-type", "application/json"),
    ];
    for (body, slug) in [
        (r#"{"amount":5}"#, "scope-missing"),
        (r#"{"account_id":null,"amount":5}"#, "scope-missing"),
        (r#"{"account_id":"","amount":5}"#, "scope-missing"),
        (
            r#"{"account":{"account_id":"acct_1"},"amount":5}"#,
            "scope-missing",
        ),
        ("account_id=acct_1&amount=5", "body-not-json"),
    ] {
        let r = send(&c, Method::POST, &gw.url("/pay"), &h, body).await;
        assert_eq!((r.status, r.problem().as_str()), (400, slug), "{body}");
    }
    assert_eq!(up.executions(), 0, "nothing forwarded");
    let db = gw.sql().await;
    let rows = async || -> i64 {
        db.query_one("SELECT count(*) FROM idemgate_keys", &[])
            .await
            .unwrap()
            .get(0)
    };
    assert_eq!(rows().await, 0, "nothing claimed");
    let ok = r#"{"account_id":"acct_1","amount":5}"#;
    let r = send(&c, Method::POST, &gw.url("/pay"), &h, ok).await;
    assert_eq!(r.status, 201);
    assert_eq!(up.executions(), 1);
    assert_eq!(rows().await, 1);
    let info = gw.store.inspect("json:acct_1", "k").await.unwrap();
    assert_eq!(info.map(|i| i.state).as_deref(), Some("completed"));
}

#[tokio::test]
async fn a_json_pointer_on_a_non_json_body_is_400() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "key: [ { json: /event_id } ]");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let r = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[("x-account-id", "a")],
        "not json",
    )
    .await;
    assert_eq!((r.status, r.problem().as_str()), (400, "body-not-json"));
    let deep = format!("{}{}", "[".repeat(200), "]".repeat(200));
    let r = send(
        &c,
        Method::POST,
        &gw.url("/pay"),
        &[("x-account-id", "a")],
        deep,
    )
    .await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (400, "body-not-json"),
        "nesting past serde_json's limit is refused, not a stack overflow"
    );
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_body_over_the_limit_is_413_and_nothing_is_stored() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "max_request_body: 1KiB").await;
    let r = post(&client(), &gw, "a", "big", &"x".repeat(2000)).await;
    assert_eq!((r.status, r.problem().as_str()), (413, "body-too-large"));
    assert_eq!(up.executions(), 0);
    assert_eq!(row_state(&gw, "a", "big").await, None);
}

#[tokio::test]
async fn an_unreachable_upstream_is_502_and_releases_the_key() {
    // A port with nothing listening: connection refused.
    let (refusing, port) = refused_port();
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &format!("http://127.0.0.1:{port}"), "");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(
        (r.status, r.problem().as_str()),
        (502, "upstream-unavailable")
    );
    assert_eq!(
        row_state(&gw, "a", "k").await,
        None,
        "released: nothing was sent"
    );
    // The upstream comes up: the retry is forwarded.
    let listener = refusing.listen(1024).unwrap();
    let up = Upstream::serve(listener, Behavior::default());
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201);
    assert_eq!(up.executions(), 1);
}
