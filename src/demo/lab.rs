//! The lab of docs/lab.md, as code: a deliberately naive "legacy ledger" upstream, and the lab's
//! checks, run against any base URL (the ledger itself, or idemgate in front of it).
//!
//! The ledger is `ledger.rs` (re-exported here): the backend of the lab's first variant.
//!
//! The checks ([`run_checks`]) are the lab's "What this asks of idemgate", each reporting
//! pass / fail / not applicable and what happened in numbers. They need a [`Harness`] that
//! can, for a gateway, crash and restart it and take its store away; for the ledger alone
//! those checks are not applicable.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;

use super::process::GatewayProcess;
use crate::store::BoxFuture;

pub use super::ledger::{AMOUNT, Ledger, Row, WEBHOOK_PATH};

/// The gateway config of the lab: webhooks keyed by the domain key `/payment_id`, scoped by
/// `/account_id`, fingerprinted as canonical JSON without the delivery's own `/event_id` and
/// `/source` (so a reconciliation call for the same payment is the same request), and
/// serialized per account because the ledger reads, then writes.
///
/// `lease` must exceed the upstream timeout (2s) + `serialize_wait` + the store's record bound.
pub fn gateway_config(
    listen: &str,
    store: &str,
    ledger_url: &str,
    lease: &str,
    serialize_wait: &str,
) -> String {
    format!(
        r#"listen: {listen}
server: {{ shutdown_grace: 5s }}
store:
{store}
upstreams:
  ledger: {{ url: "{ledger_url}", connect_timeout: 1s, timeout: 2s }}
routes:
  - name: payment-webhooks
    match: {{ path: {WEBHOOK_PATH}, methods: [POST] }}
    upstream: ledger
    idempotency:
      key: [ {{ json: /payment_id }} ]
      scope: {{ json: /account_id }}
      required: true
      fingerprint: {{ json_canonical: true, json_ignore: [/event_id, /source] }}
      lease: {lease}
      wait_timeout: 10s
      serialize: {{ max_in_flight: 1, wait_timeout: {serialize_wait} }}
  - name: everything-else
    match: {{ path_prefix: / }}
    upstream: ledger
"#
    )
}

/// What a check needs from the thing under test beyond its URL.
pub trait Harness: Send + Sync {
    /// Where deliveries go.
    fn base_url(&self) -> String;
    /// Whether there is a gateway (crash and store checks apply).
    fn is_gateway(&self) -> bool;
    /// Kills the gateway at once (SIGKILL), then starts it again.
    fn kill(&self) -> BoxFuture<'_, Result<(), String>>;
    fn restart(&self) -> BoxFuture<'_, Result<(), String>>;
    /// A base URL of a gateway whose store is unreachable (or the same gateway after its
    /// store was taken away), and a way to bring it back.
    fn store_down(&self) -> BoxFuture<'_, Result<String, String>>;
    fn store_up(&self) -> BoxFuture<'_, Result<(), String>>;
    /// How long a crashed attempt's key stays in flight.
    fn lease(&self) -> Duration;
}

/// The lab's Postgres store block: `url` directly, or through a pooler in transaction mode
/// with the wake-up listener on the direct session `listen_url`; bounds short enough for the
/// checks' leases.
pub fn postgres_store(url: &str, listen_url: Option<&str>) -> String {
    let pooler = listen_url
        .map(|direct| format!("pooler: transaction, listen_url: \"{direct}\", "))
        .unwrap_or_default();
    format!(
        "  postgres: {{ url: \"{url}\", {pooler}acquire_timeout: 500ms, connect_timeout: 1s, statement_timeout: 1s }}"
    )
}

/// How a [`GatewayUnderTest`]'s store is taken away and brought back, which depends on who
/// runs it: the demo starts a second gateway whose store does not answer; the tests stop
/// their own PostgreSQL under the same gateway.
pub trait StoreSwitch: Send + Sync {
    /// Takes the store away: `Some(url)` of another gateway to use meanwhile, or `None` when
    /// the gateway under test itself lost its store.
    fn down(&self) -> BoxFuture<'_, Result<Option<String>, String>>;
    fn up(&self) -> BoxFuture<'_, Result<(), String>>;
}

/// A gateway child process with its store switch: the [`Harness`] of `idemgate demo` and of
/// the lab's integration tests.
pub struct GatewayUnderTest<S> {
    process: tokio::sync::Mutex<GatewayProcess>,
    url: String,
    lease: Duration,
    store: S,
}

impl<S: StoreSwitch> GatewayUnderTest<S> {
    /// `lease` is the route's (how long a crashed attempt's key stays in flight).
    pub fn new(process: GatewayProcess, lease: Duration, store: S) -> GatewayUnderTest<S> {
        GatewayUnderTest {
            url: process.url(""),
            process: tokio::sync::Mutex::new(process),
            lease,
            store,
        }
    }

    pub fn store(&self) -> &S {
        &self.store
    }

    /// The process's log so far.
    pub async fn log_text(&self) -> String {
        self.process.lock().await.log_text()
    }
}

impl<S: StoreSwitch> Harness for GatewayUnderTest<S> {
    fn base_url(&self) -> String {
        self.url.clone()
    }
    fn is_gateway(&self) -> bool {
        true
    }
    fn kill(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async {
            self.process.lock().await.kill();
            Ok(())
        })
    }
    fn restart(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { self.process.lock().await.restart().await })
    }
    fn store_down(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async { Ok(self.store.down().await?.unwrap_or_else(|| self.url.clone())) })
    }
    fn store_up(&self) -> BoxFuture<'_, Result<(), String>> {
        self.store.up()
    }
    fn lease(&self) -> Duration {
        self.lease
    }
}

/// The ledger alone: no gateway, no store.
pub struct Direct(pub String);

impl Harness for Direct {
    fn base_url(&self) -> String {
        self.0.clone()
    }
    fn is_gateway(&self) -> bool {
        false
    }
    fn kill(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Err("no gateway".into()) })
    }
    fn restart(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Err("no gateway".into()) })
    }
    fn store_down(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async { Err("no store".into()) })
    }
    fn store_up(&self) -> BoxFuture<'_, Result<(), String>> {
        Box::pin(async { Err("no store".into()) })
    }
    fn lease(&self) -> Duration {
        Duration::ZERO
    }
}

/// The outcome of one check.
#[derive(Debug, Clone)]
pub struct CheckResult {
    pub name: &'static str,
    /// `None`: not applicable here (no gateway to crash, no store to lose).
    pub passed: Option<bool>,
    /// What happened, in numbers.
    pub detail: String,
}

/// What a client saw.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: u16,
    pub body: Bytes,
    pub replayed: bool,
}

impl Answer {
    pub fn is_2xx(&self) -> bool {
        (200..300).contains(&self.status)
    }
}

/// A small HTTP client for the checks.
#[derive(Clone)]
pub struct LabClient {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for LabClient {
    fn default() -> Self {
        LabClient {
            client: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(64)
                .build(HttpConnector::new()),
        }
    }
}

impl LabClient {
    /// Delivers one webhook; `Err` when no answer came (connection failed or 30 s passed).
    pub async fn deliver(&self, base: &str, body: &serde_json::Value) -> Result<Answer, String> {
        let req = Request::builder()
            .method(Method::POST)
            .uri(format!("{base}{WEBHOOK_PATH}"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body.to_string())))
            .map_err(|e| e.to_string())?;
        let resp = tokio::time::timeout(Duration::from_secs(30), self.client.request(req))
            .await
            .map_err(|_| "no answer within 30 s".to_string())?
            .map_err(|e| format!("no answer: {e}"))?;
        let status = resp.status().as_u16();
        let replayed = resp
            .headers()
            .get(&crate::replay::REPLAYED)
            .is_some_and(|v| v == "true");
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("body cut: {e}"))?
            .to_bytes();
        Ok(Answer {
            status,
            body,
            replayed,
        })
    }
}

/// A webhook body.
pub fn event(event_id: &str, payment_id: &str, account_id: &str, amount: i64) -> serde_json::Value {
    serde_json::json!({
        "event_id": event_id,
        "payment_id": payment_id,
        "account_id": account_id,
        "amount": amount,
    })
}

fn verdict(name: &'static str, passed: bool, detail: String) -> CheckResult {
    CheckResult {
        name,
        passed: Some(passed),
        detail,
    }
}

fn not_applicable(name: &'static str, why: &str) -> CheckResult {
    CheckResult {
        name,
        passed: None,
        detail: why.to_string(),
    }
}

fn count_2xx(answers: &[Result<Answer, String>]) -> usize {
    answers
        .iter()
        .filter(|a| a.as_ref().is_ok_and(Answer::is_2xx))
        .count()
}

async fn storm(
    c: &LabClient,
    base: &str,
    bodies: Vec<serde_json::Value>,
) -> Vec<Result<Answer, String>> {
    let tasks: Vec<_> = bodies
        .into_iter()
        .map(|b| {
            let (c, base) = (c.clone(), base.to_string());
            tokio::spawn(async move { c.deliver(&base, &b).await })
        })
        .collect();
    let mut out = Vec::with_capacity(tasks.len());
    for t in tasks {
        out.push(t.await.unwrap_or_else(|e| Err(e.to_string())));
    }
    out
}

/// The checks of docs/lab.md, in its order. `run` makes ids unique per run; `progress` is told
/// each check's name before it starts.
pub async fn run_checks(
    h: &dyn Harness,
    ledger: &Ledger,
    run: &str,
    progress: &(dyn Fn(&str) + Send + Sync),
) -> Vec<CheckResult> {
    let c = LabClient::default();
    let base = h.base_url();
    let id = |what: &str| format!("{run}-{what}");
    let mut out = Vec::new();

    // 1. One delivery.
    let name = "one delivery";
    progress(name);
    let (acct, pay) = (id("acct-1"), id("pay-1"));
    let first = c
        .deliver(&base, &event(&id("evt-1"), &pay, &acct, AMOUNT))
        .await;
    let (rows, balance) = ledger.account(&acct);
    out.push(verdict(
        name,
        first.as_ref().is_ok_and(Answer::is_2xx) && rows == 1 && balance == AMOUNT,
        format!(
            "{}, {rows} row, balance {balance}",
            first
                .as_ref()
                .map_or("no answer".into(), |a| a.status.to_string())
        ),
    ));

    // 2. A redelivery of the same event.
    let name = "a redelivery";
    progress(name);
    let again = c
        .deliver(&base, &event(&id("evt-1"), &pay, &acct, AMOUNT))
        .await;
    let (rows, _) = ledger.account(&acct);
    let same =
        matches!((&first, &again), (Ok(a), Ok(b)) if a.status == b.status && a.body == b.body);
    out.push(verdict(
        name,
        same && rows == 1,
        format!(
            "{} answer, {rows} row{}",
            if same { "same" } else { "different" },
            if rows == 1 { "" } else { "s" }
        ),
    ));

    // 3. Thirty concurrent deliveries of one event.
    let name = "30 concurrent deliveries";
    progress(name);
    let (acct, pay) = (id("acct-3"), id("pay-3"));
    let answers = storm(
        &c,
        &base,
        (0..30)
            .map(|_| event(&id("evt-3"), &pay, &acct, AMOUNT))
            .collect(),
    )
    .await;
    let ok = count_2xx(&answers);
    let identical = answers
        .iter()
        .filter_map(|a| a.as_ref().ok())
        .all(|a| answers[0].as_ref().is_ok_and(|f| f.body == a.body));
    let rows = ledger.rows_for_payment(&pay);
    out.push(verdict(
        name,
        ok == 30 && identical && rows == 1,
        format!(
            "{ok} of 30 answered 2xx{}, {rows} row{}",
            if identical { " (identical)" } else { "" },
            if rows == 1 { "" } else { "s" }
        ),
    ));

    // 4. Thirty different events for one account at once.
    let name = "30 events, one account";
    progress(name);
    let acct = id("acct-4");
    let bodies = (0..30)
        .map(|i| {
            event(
                &id(&format!("evt-4-{i}")),
                &id(&format!("pay-4-{i}")),
                &acct,
                AMOUNT,
            )
        })
        .collect();
    let answers = storm(&c, &base, bodies).await;
    let ok = count_2xx(&answers);
    let (rows, balance) = ledger.account(&acct);
    out.push(verdict(
        name,
        ok == 30 && rows == 30 && balance == 30 * AMOUNT,
        format!(
            "{ok} of 30 answered 2xx, {rows} rows, balance {balance} of {}",
            30 * AMOUNT
        ),
    ));

    // 5. A redelivery with a different body under the same key.
    let name = "same key, different body";
    progress(name);
    let (acct, pay) = (id("acct-5"), id("pay-5"));
    let _ = c
        .deliver(&base, &event(&id("evt-5"), &pay, &acct, AMOUNT))
        .await;
    let changed = c
        .deliver(&base, &event(&id("evt-5"), &pay, &acct, AMOUNT * 9))
        .await;
    let (rows, balance) = ledger.account(&acct);
    let refused = changed
        .as_ref()
        .is_ok_and(|a| (400..500).contains(&a.status));
    out.push(verdict(
        name,
        refused && rows == 1 && balance == AMOUNT,
        format!(
            "{}, {rows} row{}, balance {balance}",
            changed
                .as_ref()
                .map_or("no answer".into(), |a| a.status.to_string()),
            if rows == 1 { "" } else { "s" }
        ),
    ));

    // 6. The gateway killed between forwarding and storing.
    let name = "gateway killed mid-request";
    progress(name);
    if h.is_gateway() {
        out.push(crash_check(h, ledger, &c, &id("acct-6"), &id("pay-6"), &id("evt-6")).await);
    } else {
        out.push(not_applicable(name, "no gateway to kill"));
    }

    // 7. The store unreachable.
    let name = "store unreachable";
    progress(name);
    if h.is_gateway() {
        out.push(store_check(h, ledger, &c, &id("acct-7"), &id("pay-7")).await);
    } else {
        out.push(not_applicable(name, "no store"));
    }

    // 8. A domain key: the webhook and a reconciliation job close the same payment.
    let name = "webhook + reconciliation";
    progress(name);
    let (acct, pay) = (id("acct-8"), id("pay-8"));
    let hook = c
        .deliver(&base, &event(&id("evt-8"), &pay, &acct, AMOUNT))
        .await;
    let mut recon = event(&id("recon-8"), &pay, &acct, AMOUNT);
    recon["source"] = "reconciliation".into();
    let job = c.deliver(&base, &recon).await;
    let rows = ledger.rows_for_payment(&pay);
    let show = |a: &Result<Answer, String>| match a {
        Ok(a) if a.replayed => format!("{} (replayed)", a.status),
        Ok(a) => a.status.to_string(),
        Err(_) => "no answer".to_string(),
    };
    out.push(verdict(
        name,
        hook.as_ref().is_ok_and(Answer::is_2xx)
            && job.as_ref().is_ok_and(Answer::is_2xx)
            && rows == 1,
        format!(
            "webhook {}, reconciliation {}, {rows} row{}",
            show(&hook),
            show(&job),
            if rows == 1 { "" } else { "s" }
        ),
    ));
    out
}

async fn crash_check(
    h: &dyn Harness,
    ledger: &Ledger,
    c: &LabClient,
    acct: &str,
    pay: &str,
    evt: &str,
) -> CheckResult {
    let name = "gateway killed mid-request";
    let body = event(evt, pay, acct, AMOUNT);
    ledger.set_work(Duration::from_millis(500));
    let before = ledger.received();
    let (c2, base, b2) = (c.clone(), h.base_url(), body.clone());
    let first = tokio::spawn(async move { c2.deliver(&base, &b2).await });
    let deadline = Instant::now() + Duration::from_secs(10);
    while ledger.received() == before && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    if let Err(e) = h.kill().await {
        ledger.set_work(Duration::from_millis(10));
        return verdict(name, false, format!("could not kill the gateway: {e}"));
    }
    let first = first.await.unwrap_or_else(|e| Err(e.to_string()));
    ledger.set_work(Duration::from_millis(10));
    if let Err(e) = h.restart().await {
        return verdict(name, false, format!("could not restart the gateway: {e}"));
    }
    // The sender redelivers until it gets a 2xx. No 2xx may arrive before the ledger has the
    // row; the event must end up executed (never lost).
    let mut premature = false;
    let mut tries = 0;
    let until = Instant::now() + h.lease() + Duration::from_secs(15);
    let mut done = None;
    while Instant::now() < until {
        tries += 1;
        match c.deliver(&h.base_url(), &body).await {
            Ok(a) if a.is_2xx() => {
                premature = ledger.rows_for_payment(pay) == 0;
                done = Some(a);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(200)).await,
        }
    }
    let rows = ledger.rows_for_payment(pay);
    let no_false_2xx = first.as_ref().is_ok_and(|a| !a.is_2xx()) || first.is_err();
    let redeliveries = if tries == 1 {
        "1 redelivery (it waited out the lease)".to_string()
    } else {
        format!("{tries} redeliveries")
    };
    let double = if rows > 1 {
        ", forwarded again after the lease: a counted double, never a loss"
    } else {
        ""
    };
    verdict(
        name,
        no_false_2xx && done.is_some() && !premature && rows >= 1,
        format!(
            "no answer from the killed gateway; {redeliveries} until a 2xx; {rows} row{}{double}",
            if rows == 1 { "" } else { "s" }
        ),
    )
}

async fn store_check(
    h: &dyn Harness,
    ledger: &Ledger,
    c: &LabClient,
    acct: &str,
    pay: &str,
) -> CheckResult {
    let name = "store unreachable";
    let base = match h.store_down().await {
        Ok(base) => base,
        Err(e) => return verdict(name, false, format!("could not take the store away: {e}")),
    };
    let before = ledger.received();
    let started = Instant::now();
    let answer = c
        .deliver(&base, &event(&format!("{pay}-evt"), pay, acct, AMOUNT))
        .await;
    let elapsed = started.elapsed();
    let forwarded = ledger.received() - before;
    let restored = h.store_up().await;
    let status = answer.as_ref().map_or(0, |a| a.status);
    verdict(
        name,
        status == 503 && forwarded == 0 && restored.is_ok(),
        format!(
            "{status} in {} ms, {forwarded} forwarded",
            elapsed.as_millis()
        ),
    )
}
