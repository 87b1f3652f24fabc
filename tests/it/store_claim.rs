//! The claim statement itself, under the READ COMMITTED races it must survive.

use std::time::Duration;

use idemgate::store::{Claim, ClaimRequest};

use crate::support::*;

fn req<'a>(key: &'a str, fp: &'a [u8; 32], lease: Duration) -> ClaimRequest<'a> {
    ClaimRequest {
        scope: "s",
        key,
        route: "r",
        fingerprint: fp,
        lease,
        ttl: Duration::from_secs(60),
        hold_expired_leases: false,
    }
}

/// A claim whose snapshot predates a concurrent takeover must not act on the old version
/// of the row (here: an expired lease, which would read as "held" or be taken over twice).
#[tokio::test]
async fn a_claim_blocked_behind_a_takeover_sees_the_new_row_not_its_snapshot() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let fp = [7u8; 32];
    let first = gw
        .store
        .claim(req("k", &fp, Duration::from_millis(100)))
        .await
        .unwrap();
    assert!(matches!(first, Claim::Acquired { .. }));
    let db = gw.sql().await;
    wait_until("the lease expires", Duration::from_secs(10), || async {
        db.query_one("SELECT lease_expires_at <= now() FROM idemgate_keys", &[])
            .await
            .unwrap()
            .get::<_, bool>(0)
    })
    .await;

    // Another instance takes the row over, and has not committed yet.
    let mut other = sql(&gw.db).await;
    let tx = other.transaction().await.unwrap();
    tx.execute(
        "UPDATE idemgate_keys SET lease_token = gen_random_uuid(),
                lease_expires_at = now() + interval '1 hour', attempts = attempts + 1",
        &[],
    )
    .await
    .unwrap();

    // Our claim starts now (its snapshot sees the expired lease) and blocks on the row lock.
    let store = gw.store.clone();
    let ours = tokio::spawn(async move {
        let fp = [7u8; 32];
        store.claim(req("k", &fp, Duration::from_secs(5))).await
    });
    wait_for_a_lock_waiter(&db).await;
    tx.commit().await.unwrap();

    match ours.await.unwrap().unwrap() {
        Claim::InFlight { lease_remaining } => {
            assert!(
                lease_remaining > Duration::from_secs(60),
                "the new lease: {lease_remaining:?}"
            )
        }
        other => panic!("acted on a stale snapshot: {other:?}"),
    }
}
