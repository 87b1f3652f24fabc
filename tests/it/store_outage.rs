//! Store trouble: nothing keyed is forwarded (unless `pass_through`), and every request is
//! answered within `acquire_timeout` + `statement_timeout` + a margin (docs/contract.md §7,
//! guarantee 5).
//! The elapsed-time checks below are hang checks against the configured bounds (an unbounded
//! pool waits forever), not speed claims.

use std::time::{Duration, Instant};

use crate::support::pg::Cluster;
use crate::support::pgbouncer::Bouncer;
use crate::support::*;

/// acquire 500ms + statement 1s (the test config) + a generous margin for a loaded machine.
const BOUND: Duration = Duration::from_millis(500 + 1000 + 2500);

// Each runs on PostgreSQL directly and through PgBouncer in transaction mode (contract §8.4),
// where the pooler stays up while PostgreSQL is down: clients connect, and their statements
// wait in the pooler or fail there, never past the gateway's own bounds.
backend_tests!(
    postgres: Postgres, pgbouncer: Pgbouncer;
    [
        pool_exhaustion_answers_503_within_its_bound,
        postgres_stopped_answers_503_within_its_bound_and_recovers_by_itself,
        pass_through_forwards_without_idempotency_and_says_so,
        a_postgres_crash_under_load_forwards_nothing_unclaimed_and_recovers,
    ]
);

/// A private cluster (the test stops it), with a private PgBouncer in front of it for
/// `Backend::Pgbouncer`, and a gateway config with `idem` on its fresh database.
async fn private(
    b: Backend,
    up: &Upstream,
    idem: &str,
) -> (Cluster, Option<Bouncer>, String, String) {
    let pooled = b == Backend::Pgbouncer;
    let (cluster, bouncer) = tokio::task::spawn_blocking(move || {
        let cluster = Cluster::start();
        let bouncer = pooled.then(|| Bouncer::start(&cluster));
        (cluster, bouncer)
    })
    .await
    .expect("starting a private cluster");
    let db = cluster.new_database().await;
    let yaml = match &bouncer {
        None => config_yaml(&db, &up.url(), idem),
        Some(bouncer) => config_yaml_pgbouncer(&bouncer.url_for(&db), &db, &up.url(), idem),
    };
    (cluster, bouncer, yaml, db)
}

async fn pool_exhaustion_answers_503_within_its_bound(b: Backend) {
    let up = Upstream::start().await;
    let (yaml, db) = fresh_config(b, &up.url(), "").await;
    let yaml = yaml.patch("pool_size: 8", "pool_size: 1");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "warm", "x").await.status, 201);
    let held = gw
        .pg()
        .pool()
        .get()
        .await
        .expect("the only pooled connection");
    let started = Instant::now();
    let r = post(&c, &gw, "a", "k", "x").await;
    let elapsed = started.elapsed();
    assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
    assert_eq!(r.headers["retry-after"], "1");
    assert!(
        elapsed < BOUND,
        "answered after {elapsed:?}, past the bound"
    );
    assert_eq!(up.executions(), 1, "nothing keyed was forwarded");
    drop(held);
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
}

async fn postgres_stopped_answers_503_within_its_bound_and_recovers_by_itself(b: Backend) {
    let up = Upstream::start().await;
    let (cluster, _bouncer, yaml, db) = private(b, &up, "").await;
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    assert_eq!(post(&c, &gw, "a", "before", "x").await.status, 201);

    let cluster = cluster.crashed().await;
    for i in 0..3 {
        let started = Instant::now();
        let r = post(&c, &gw, "a", &format!("during-{i}"), "x").await;
        let elapsed = started.elapsed();
        assert_eq!((r.status, r.problem().as_str()), (503, "store-unavailable"));
        assert!(
            elapsed < BOUND,
            "answered after {elapsed:?}, past the bound"
        );
    }
    assert_eq!(
        up.executions(),
        1,
        "nothing keyed was forwarded during the outage"
    );

    let _cluster = cluster.restarted().await;
    // No restart of the gateway: dead pooled connections are not handed out forever.
    wait_until(
        "keyed traffic recovers",
        Duration::from_secs(20),
        || async { post(&c, &gw, "a", "after", "x").await.status == 201 },
    )
    .await;
    assert!(
        post(&c, &gw, "a", "before", "x").await.replayed(),
        "stored rows survived"
    );
    assert_eq!(up.executions(), 2);
}

async fn pass_through_forwards_without_idempotency_and_says_so(b: Backend) {
    let up = Upstream::start().await;
    let (cluster, _bouncer, yaml, db) = private(b, &up, "on_store_error: pass_through").await;
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let normal = post(&c, &gw, "a", "k0", "x").await;
    assert!(!normal.headers.contains_key("idempotency-status"));
    let _cluster = cluster.crashed().await;
    let r = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(r.status, 201);
    assert_eq!(r.headers["idempotency-status"], "bypassed");
    assert_eq!(up.executions(), 2);
}

/// A 503 for a request that was forwarded, whose answer could not be stored.
fn not_recorded(r: &Reply) -> bool {
    r.json()["detail"]
        .as_str()
        .unwrap()
        .contains("could not be recorded")
}

async fn a_postgres_crash_under_load_forwards_nothing_unclaimed_and_recovers(b: Backend) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    let up = Upstream::start().await;
    let (cluster, _bouncer, yaml, db) = private(b, &up, "").await;
    let gw = Arc::new(TestGateway::start(&yaml, &db).await);
    let stop = Arc::new(AtomicBool::new(false));
    // Requests the load saw refused (503 before anything was forwarded), as they come.
    let refusals = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (gw, stop, c) = (Arc::clone(&gw), Arc::clone(&stop), client());
            let refusals = Arc::clone(&refusals);
            tokio::spawn(async move {
                let mut seen = Vec::new();
                // Bounded: stops when told, or after 2,000 requests.
                for i in 0..2000 {
                    if stop.load(Ordering::SeqCst) {
                        break;
                    }
                    let started = Instant::now();
                    let r = post(&c, &gw, "load", &format!("w{w}-{i}"), "x").await;
                    if r.status == 503 && !not_recorded(&r) {
                        refusals.fetch_add(1, Ordering::SeqCst);
                    }
                    seen.push((r, started.elapsed()));
                }
                seen
            })
        })
        .collect();
    wait_until("traffic flows", Duration::from_secs(10), || async {
        up.executions() > 20
    })
    .await;
    let cluster = cluster.crashed().await;
    let during = up.executions();
    // Let the outage last a while under load.
    let c = client();
    for i in 0..5 {
        let r = post(&c, &gw, "probe", &format!("p{i}"), "x").await;
        assert_eq!(r.status, 503);
    }
    // The load's requests move together (their claims and completions share statements), so
    // they may all be past their claims when the crash comes: the outage lasts until the
    // load has seen it too.
    wait_until(
        "the load sees the outage",
        Duration::from_secs(10),
        || async { refusals.load(Ordering::SeqCst) > 0 },
    )
    .await;
    // While the store is down nothing new is claimed, so nothing new is forwarded: beyond
    // what was executing at the crash, at most one request per load worker (one it had
    // claimed just before the crash), and none of the probes.
    let before_restart = up.executions();
    assert!(
        before_restart <= during + 8,
        "{} executions during the outage for 8 workers",
        before_restart - during
    );
    let _cluster = cluster.restarted().await;
    let probes = std::sync::atomic::AtomicUsize::new(0);
    let probes_refused = std::sync::atomic::AtomicUsize::new(0);
    wait_until(
        "traffic recovers without a restart",
        Duration::from_secs(20),
        || async {
            let n = probes.fetch_add(1, Ordering::SeqCst);
            let r = post(&c, &gw, "probe", &format!("after-{n}"), "x").await;
            if r.status != 201 {
                // A probe not answered is refused before anything is forwarded.
                assert_eq!(
                    (r.status, r.problem().as_str()),
                    (503, "store-unavailable"),
                    "{r:?}"
                );
                assert!(!not_recorded(&r), "a probe was forwarded unrecorded: {r:?}");
                probes_refused.fetch_add(1, Ordering::SeqCst);
            }
            r.status == 201
        },
    )
    .await;
    stop.store(true, Ordering::SeqCst);

    // The load saw the outage: the wait above ended on its first refusal.
    let (mut ok, mut refused, mut unrecorded) = (0, 0, 0);
    for w in workers {
        for (r, elapsed) in w.await.unwrap() {
            match r.status {
                201 => ok += 1,
                503 => {
                    assert!(elapsed < BOUND, "a 503 after {elapsed:?}, past the bound");
                    if not_recorded(&r) {
                        unrecorded += 1; // forwarded before the crash, not stored after it
                    } else {
                        refused += 1;
                    }
                }
                other => panic!("unexpected status {other}: {r:?}"),
            }
        }
    }
    // The probes: of all those sent during and after the outage, only the one answered 201
    // reached the upstream.
    // (The load's keys are `w{worker}-{i}`; the probes' `p{i}` and `after-{n}`.)
    let probe_keys: Vec<String> = up
        .seen()
        .iter()
        .map(|s| s.headers["idempotency-key"].to_str().unwrap().to_string())
        .filter(|k| !k.starts_with('w'))
        .collect();
    let last = probes.load(Ordering::SeqCst) - 1;
    assert_eq!(
        probe_keys,
        [format!("after-{last}")],
        "{} probes refused after the restart",
        probes_refused.load(Ordering::SeqCst)
    );
    let probes_ok = probe_keys.len();
    // Every execution is a stored answer or a request forwarded before the crash whose answer
    // could not be recorded: no request refused with 503 store-unavailable was forwarded.
    assert_eq!(
        up.executions(),
        ok + unrecorded + probes_ok,
        "{ok} stored + {unrecorded} unrecorded + {probes_ok} probe; {refused} refused"
    );
}

/// A pooler in transaction mode with `pooler` left out: the first connection learns what
/// `url` is (PgBouncer refuses the session's startup options), and keyed requests are
/// answered and replayed through it as with `pooler: transaction`. Configured as a direct
/// session (`pooler: none`), the same pooler is refused with the reason naming the field.
#[tokio::test]
async fn a_pooler_left_unnamed_is_detected_and_one_named_wrongly_is_refused_naming_the_field() {
    let up = Upstream::start().await;
    let (direct, pooled) = crate::support::pgbouncer::fresh_database().await;
    let block = format!(
        "  postgres: {{ url: \"{pooled}\", listen_url: \"{direct}\", pool_size: 8, acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    );
    let yaml = config_yaml_store(&block, &up.url(), "");
    assert!(!yaml.contains("pooler:"), "the kind is left to the gateway");
    let gw = TestGateway::start(&yaml, &direct).await;
    let c = client();
    let first = post(&c, &gw, "a", "k", "x").await;
    assert_eq!(first.status, 201, "{first:?}");
    for i in 0..20 {
        assert_eq!(post(&c, &gw, "a", &format!("k{i}"), "x").await.status, 201);
    }
    let retry = post(&c, &gw, "a", "k", "x").await;
    assert!(retry.replayed(), "{retry:?}");
    assert_eq!(up.executions(), 21);

    let yaml = config_yaml_store(
        &block.replace("listen_url", "pooler: none, listen_url"),
        &up.url(),
        "",
    );
    let config = idemgate::config::Config::from_yaml(&yaml).expect("config");
    let idemgate::config::StoreConfig::Postgres(pg) = &config.store else {
        panic!("a postgres store");
    };
    let store = idemgate::store::postgres::PgStore::new(pg).expect("store");
    use idemgate::store::Store;
    let why = match store.inspect("a", "k").await {
        Err(idemgate::store::StoreError::Connect(why)) => why,
        other => panic!("expected the pooler to refuse the session, got {other:?}"),
    };
    assert!(why.contains("unsupported startup parameter"), "{why}");
    assert!(why.contains("store.postgres.pooler: transaction"), "{why}");
}
