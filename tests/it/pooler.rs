//! Behind PgBouncer in transaction mode (`pooler: transaction`), a new key's claim and
//! completion go through the PL/pgSQL functions of migrations/0006, whose plans the pooler's
//! server sessions keep; directly, through the prepared statements themselves. Shown by
//! taking the functions away: only the pooled gateway stops being able to claim.

use crate::support::*;

async fn drop_the_functions(db: &str) {
    sql(db)
        .await
        .batch_execute("DROP FUNCTION idemgate_claim_new, idemgate_finish")
        .await
        .unwrap();
}

#[tokio::test]
async fn through_pgbouncer_new_keys_are_claimed_by_the_functions() {
    let up = Upstream::start().await;
    let (yaml, db) = fresh_config(Backend::Pgbouncer, &up.url(), "").await;
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    for i in 0..3 {
        assert_eq!(post(&c, &gw, "a", &format!("k{i}"), "x").await.status, 201);
    }
    assert_eq!(
        row_state(&gw, "a", "k0").await.as_deref(),
        Some("completed")
    );
    drop_the_functions(&db).await;
    let r = post(&c, &gw, "a", "new", "x").await;
    assert_eq!(r.status, 503, "{:?}", r.body);
    assert_eq!(up.executions(), 3, "nothing unclaimed was forwarded");
    assert_eq!(row_state(&gw, "a", "new").await, None);
    gw.shutdown().await;
}

#[tokio::test]
async fn directly_new_keys_use_the_prepared_statements_not_the_functions() {
    let up = Upstream::start().await;
    let (yaml, db) = fresh_config(Backend::Postgres, &up.url(), "").await;
    let gw = TestGateway::start(&yaml, &db).await;
    drop_the_functions(&db).await;
    let c = client();
    for i in 0..3 {
        assert_eq!(post(&c, &gw, "a", &format!("k{i}"), "x").await.status, 201);
    }
    assert!(post(&c, &gw, "a", "k0", "x").await.replayed());
    assert_eq!(up.executions(), 3);
    gw.shutdown().await;
}
