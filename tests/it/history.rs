//! A recorded history of the real binary under a generated schedule of faults, checked at
//! the end (Jepsen-style; issue 15).
//!
//! Two `idemgate serve` processes share one database on a private PostgreSQL cluster, in
//! front of a naive upstream that executes every request it gets and answers
//! `{"event":"e7","execution":3}`. Senders deliver events (one key each), retrying on any
//! answer that is not a 2xx and on any failed connection, alternating instances, until each
//! event has a 2xx. Every attempt is recorded: event, instance, start, end, and the status
//! with its body (or the error). Meanwhile a schedule generated from a seed injects faults:
//!
//! - lane 1, one fault at a time: SIGKILL of instance 0 or 1 (restarted after a pause), or
//!   PostgreSQL stopped (`pg_ctl -m immediate`) and started after a pause;
//! - lane 2, windows in which the upstream misbehaves: it resets the connection before it
//!   executes (nothing done), executes and then resets (outcome unknown), or executes and
//!   stalls past the gateway's upstream timeout (outcome unknown, a 504).
//!
//! After the faults end, every event gets one more request on each instance (a replay), and
//! the history is checked:
//!
//! 1. no event lost: every event got a 2xx;
//! 2. every 2xx names real work: the execution it names was performed by the upstream, for
//!    that event;
//! 3. all 2xx answers of one event (replays included) name the same execution, and every
//!    replay is a 2xx (guarantee 2);
//! 4. every double is counted: for each event, `executions - 1 <= takeovers + unknown`,
//!    where `takeovers` counts the gateways' "took over an expired lease" log lines for that
//!    key (both processes append to one log across restarts, so a SIGKILL loses none; the
//!    metric `idemgate_leases_total{event="taken_over"}` would die with the process), and
//!    `unknown` counts the history's 502 and 504 answers for that event.
//!
//! The accounting of 4, from the code: a claim of an existing row whose lease has expired
//! is a takeover (`CLAIM_SQL` in the Postgres store bumps `attempts`, and the gateway logs
//! and counts it before it forwards). But `attempts` is not a count over the whole run: an
//! unknown outcome under `reforward` (an upstream timeout, or a connection broken after the
//! request was sent) *releases* the key, which deletes the row (`RELEASE_SQL`), so the next
//! claim starts again at `attempts = 1` and executes again without any takeover. That is
//! the second counted exception of the guarantees' model (docs/guarantees.md): the possible
//! double is counted only as the 504 `upstream-timeout` / 502 `upstream-failed` its
//! attempt answered. A connect failure is released too, but nothing was sent, so it
//! executes nothing. An answer that cannot be recorded (the store down) leaves the key in
//! flight until its lease ends: the next execution is then a takeover.
//!
//! The first counted exception (an attempt whose lease was taken over while it worked
//! answers its client with its own execution, counted `lost`) cannot happen here: the lease
//! (3s) outlives the upstream timeout (1s) plus the store's record bound (1.5s), and a
//! completion is never written past its lease. Check 3 is therefore strict; its message
//! says whether a `lease lost` line was logged for the key.
//!
//! A failing check panics with the seed, the schedule and the history of the events
//! involved. The seed fixes the schedule, not the interleaving (faults fire on the wall
//! clock, beside real processes), so a failing seed may need a few runs to fail again. CI
//! runs a short fixed set of seeds; the soak and a single seed are:
//!
//! ```text
//! HISTORY_SEEDS=100 cargo test --test it history -- --nocapture   # seeds 1..=100
//! HISTORY_SEED=42 cargo test --test it history -- --nocapture     # seed 42 only
//! ```

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::time::Instant;

use crate::support::history::{Rng, drop_database, seeds};
use crate::support::process::GatewayProcess;
use crate::support::*;

/// Seeds CI runs.
const CI_SEEDS: &[u64] = &[1, 2, 3];
/// How long faults are injected, per seed.
const RUN_MS: u64 = 6000;
const SENDERS: usize = 4;
const EVENTS_PER_SENDER: usize = 8;
/// After this, an event without a 2xx is lost.
const GIVE_UP: Duration = Duration::from_secs(45);
const ACCOUNT: &str = "acct";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UpstreamMode {
    Normal,
    /// Resets the connection before executing: nothing done.
    ResetBefore,
    /// Executes, then resets the connection: done, outcome unknown to the gateway.
    ResetAfter,
    /// Executes, then answers only after the gateway's upstream timeout.
    Stall,
}

#[derive(Debug, Clone, Copy)]
enum Fault {
    /// SIGKILL an instance, restart it after `down_ms`.
    Kill { instance: usize, down_ms: u64 },
    /// Stop PostgreSQL at once, start it after `down_ms`.
    StopPostgres { down_ms: u64 },
    /// The upstream misbehaves for `for_ms`.
    Upstream { mode: UpstreamMode, for_ms: u64 },
}

#[derive(Debug)]
struct Schedule {
    /// Lane 1 (instances and the database), one at a time, and lane 2 (the upstream).
    lanes: [Vec<(u64, Fault)>; 2],
}

impl Schedule {
    fn generate(seed: u64) -> Schedule {
        let mut rng = Rng(seed);
        let mut lane1 = Vec::new();
        let mut t = rng.range(200, 800);
        while t < RUN_MS {
            let down_ms = rng.range(200, 1200);
            let fault = match rng.range(0, 3) {
                0 | 1 => Fault::Kill {
                    instance: rng.range(0, 2) as usize,
                    down_ms,
                },
                _ => Fault::StopPostgres { down_ms },
            };
            lane1.push((t, fault));
            t += down_ms + rng.range(300, 1500);
        }
        let mut lane2 = Vec::new();
        let mut t = rng.range(0, 600);
        while t < RUN_MS {
            let for_ms = rng.range(200, 1000);
            let mode = match rng.range(0, 3) {
                0 => UpstreamMode::ResetBefore,
                1 => UpstreamMode::ResetAfter,
                _ => UpstreamMode::Stall,
            };
            lane2.push((t, Fault::Upstream { mode, for_ms }));
            t += for_ms + rng.range(200, 1200);
        }
        Schedule {
            lanes: [lane1, lane2],
        }
    }

    fn describe(&self) -> String {
        let mut all: Vec<_> = self.lanes.iter().flatten().collect();
        all.sort_by_key(|(t, _)| *t);
        all.iter()
            .map(|(t, f)| format!("  at {t:>5} ms: {f:?}\n"))
            .collect()
    }
}

/// The naive upstream: executes everything it is sent, numbering executions, and records
/// which event each execution was for.
struct NaiveUpstream {
    addr: SocketAddr,
    /// `executions[n - 1]` is the event of execution `n`.
    executions: Arc<Mutex<Vec<String>>>,
    mode: Arc<Mutex<UpstreamMode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for NaiveUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl NaiveUpstream {
    async fn start() -> NaiveUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let executions = Arc::new(Mutex::new(Vec::new()));
        let mode = Arc::new(Mutex::new(UpstreamMode::Normal));
        let (ex, md) = (Arc::clone(&executions), Arc::clone(&mode));
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let (ex, md) = (Arc::clone(&ex), Arc::clone(&md));
                tokio::spawn(async move {
                    let svc = service_fn(move |req| {
                        let (ex, md) = (Arc::clone(&ex), Arc::clone(&md));
                        async move { execute(&ex, &md, req).await }
                    });
                    let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        NaiveUpstream {
            addr,
            executions,
            mode,
            task,
        }
    }

    fn set(&self, mode: UpstreamMode) {
        *self.mode.lock().unwrap() = mode;
    }
}

/// An error from the service closes the connection without an answer (a reset, as far as
/// the gateway can tell).
async fn execute(
    executions: &Mutex<Vec<String>>,
    mode: &Mutex<UpstreamMode>,
    req: Request<Incoming>,
) -> Result<Response<Full<Bytes>>, std::io::Error> {
    let reset = || std::io::Error::other("reset");
    let body = req.into_body().collect().await.map_err(|_| reset())?;
    let event = serde_json::from_slice::<serde_json::Value>(&body.to_bytes())
        .ok()
        .and_then(|v| v["event"].as_str().map(str::to_string))
        .unwrap_or_default();
    let mode = *mode.lock().unwrap();
    if mode == UpstreamMode::ResetBefore {
        return Err(reset());
    }
    let n = {
        let mut ex = executions.lock().unwrap();
        ex.push(event.clone());
        ex.len()
    };
    match mode {
        UpstreamMode::ResetAfter => return Err(reset()),
        UpstreamMode::Stall => tokio::time::sleep(Duration::from_millis(1500)).await,
        _ => tokio::time::sleep(Duration::from_millis(200)).await,
    }
    Ok(Response::builder()
        .status(201)
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(format!(
            "{{\"event\":\"{event}\",\"execution\":{n}}}"
        ))))
        .unwrap())
}

/// One request of the history.
#[derive(Debug, Clone)]
struct Op {
    event: String,
    instance: usize,
    start_ms: u64,
    end_ms: u64,
    /// Status and body, or why there was none.
    result: Result<(u16, String), String>,
    /// Sent after the faults ended, to an event that already had its 2xx.
    replay: bool,
}

impl Op {
    fn ok(&self) -> bool {
        matches!(self.result, Ok((s, _)) if (200..300).contains(&s))
    }

    /// The execution a 2xx names.
    fn execution(&self) -> Option<(String, usize)> {
        let Ok((_, body)) = &self.result else {
            return None;
        };
        let v: serde_json::Value = serde_json::from_str(body).ok()?;
        Some((
            v["event"].as_str()?.to_string(),
            v["execution"].as_u64()? as usize,
        ))
    }

    fn line(&self) -> String {
        let what = match &self.result {
            Ok((s, b)) => format!("{s} {b}"),
            Err(e) => format!("error: {e}"),
        };
        format!(
            "  {:>4} {:>5}..{:>5} ms  instance {}{}  {what}",
            self.event,
            self.start_ms,
            self.end_ms,
            self.instance,
            if self.replay { " (replay)" } else { "" }
        )
    }
}

async fn attempt(c: &TestClient, url: &str, event: &str, instance: usize, t0: Instant) -> Op {
    let start_ms = t0.elapsed().as_millis() as u64;
    let sent = tokio::time::timeout(
        Duration::from_secs(10),
        try_send(
            c,
            Method::POST,
            url,
            &[
                ("idempotency-key", event),
                ("x-account-id", ACCOUNT),
                ("content-type", "application/json"),
            ],
            format!("{{\"event\":\"{event}\"}}"),
        ),
    )
    .await
    .unwrap_or_else(|_| Err("no answer within 10 s".into()));
    Op {
        event: event.to_string(),
        instance,
        start_ms,
        end_ms: t0.elapsed().as_millis() as u64,
        result: sent.map(|r| (r.status, String::from_utf8_lossy(&r.body).into_owned())),
        replay: false,
    }
}

/// Delivers its events, each retried until a 2xx (or [`GIVE_UP`]).
async fn sender(id: usize, urls: [String; 2], t0: Instant, history: Arc<Mutex<Vec<Op>>>) {
    let c = client();
    let spacing = RUN_MS / EVENTS_PER_SENDER as u64;
    for j in 0..EVENTS_PER_SENDER {
        let event = format!("e{}", j * SENDERS + id);
        let due = t0 + Duration::from_millis(j as u64 * spacing + id as u64 * spacing / 4);
        tokio::time::sleep_until(due).await;
        let mut k = 0usize;
        loop {
            let instance = (id + k) % 2;
            let op = attempt(&c, &urls[instance], &event, instance, t0).await;
            let ok = op.ok();
            history.lock().unwrap().push(op);
            if ok || t0.elapsed() > GIVE_UP {
                break;
            }
            k += 1;
            tokio::time::sleep(Duration::from_millis(50 + 50 * k.min(5) as u64)).await;
        }
    }
}

/// Runs one lane of the schedule; lane 1 owns the gateways and the cluster.
async fn run_lane1(
    lane: Vec<(u64, Fault)>,
    t0: Instant,
    mut gws: [GatewayProcess; 2],
    mut cluster: pg::Cluster,
) -> ([GatewayProcess; 2], pg::Cluster) {
    for (at, fault) in lane {
        tokio::time::sleep_until(t0 + Duration::from_millis(at)).await;
        match fault {
            Fault::Kill { instance, down_ms } => {
                gws[instance].kill();
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
                gws[instance].restart().await;
            }
            Fault::StopPostgres { down_ms } => {
                cluster = cluster.crashed().await;
                tokio::time::sleep(Duration::from_millis(down_ms)).await;
                cluster = cluster.restarted().await;
            }
            Fault::Upstream { .. } => unreachable!("lane 2"),
        }
    }
    (gws, cluster)
}

async fn run_lane2(lane: Vec<(u64, Fault)>, t0: Instant, up: &NaiveUpstream) {
    for (at, fault) in lane {
        tokio::time::sleep_until(t0 + Duration::from_millis(at)).await;
        let Fault::Upstream { mode, for_ms } = fault else {
            unreachable!("lane 1")
        };
        up.set(mode);
        tokio::time::sleep(Duration::from_millis(for_ms)).await;
        up.set(UpstreamMode::Normal);
    }
}

/// What one seed did, for the report.
struct Summary {
    requests: usize,
    executions: usize,
    doubles: usize,
    takeovers: usize,
    unknown: usize,
    took: Duration,
}

/// Runs one seed on `cluster` (stopped and started by the schedule, returned running).
async fn run_seed(seed: u64, cluster: pg::Cluster) -> (pg::Cluster, Result<Summary, String>) {
    let begun = Instant::now();
    let schedule = Schedule::generate(seed);
    let db = cluster.new_database().await;
    let up = Arc::new(NaiveUpstream::start().await);
    let yaml = config_yaml(
        &db,
        &format!("http://{}", up.addr),
        "lease: 3s\n      wait_timeout: 500ms",
    )
    .patch("timeout: 5s", "timeout: 1s");
    let gws = [
        GatewayProcess::start(&yaml).await,
        GatewayProcess::start(&yaml).await,
    ];
    let urls = [gws[0].url("/pay"), gws[1].url("/pay")];
    let history = Arc::new(Mutex::new(Vec::new()));
    let t0 = Instant::now();
    let [lane1, lane2] = Schedule::generate(seed).lanes;
    let faults = tokio::spawn(run_lane1(lane1, t0, gws, cluster));
    let upstream_faults = {
        let up = Arc::clone(&up);
        tokio::spawn(async move { run_lane2(lane2, t0, &up).await })
    };
    let senders: Vec<_> = (0..SENDERS)
        .map(|id| tokio::spawn(sender(id, urls.clone(), t0, Arc::clone(&history))))
        .collect();
    for s in senders {
        s.await.unwrap();
    }
    upstream_faults.await.unwrap();
    let (gws, cluster) = faults.await.unwrap();

    // Every event once more on each instance: the replays must name the same execution.
    let c = client();
    let events: Vec<String> = (0..SENDERS * EVENTS_PER_SENDER)
        .map(|i| format!("e{i}"))
        .collect();
    for event in &events {
        for (instance, url) in urls.iter().enumerate() {
            let mut op = attempt(&c, url, event, instance, t0).await;
            op.replay = true;
            history.lock().unwrap().push(op);
        }
    }

    let history = history.lock().unwrap().clone();
    let executions = up.executions.lock().unwrap().clone();
    let logs: String = gws.iter().map(|g| g.log_text()).collect();
    let scopes: Vec<(String, String)> = sql(&db)
        .await
        .query("SELECT scope, key FROM idemgate_keys", &[])
        .await
        .map(|rows| rows.iter().map(|r| (r.get(0), r.get(1))).collect())
        .unwrap_or_default();
    drop(gws);
    drop_database(&db).await;
    let result = check(&events, &history, &executions, &logs, &scopes).map(|mut s| {
        s.took = begun.elapsed();
        s
    });
    let result = result.map_err(|(violations, involved)| {
        let mut msg = format!(
            "seed {seed}: the history breaks the guarantees (reproduce: HISTORY_SEED={seed} \
             cargo test --test it history -- --nocapture)\n\nviolations:\n"
        );
        for v in &violations {
            let _ = writeln!(msg, "  {v}");
        }
        let _ = write!(msg, "\nschedule:\n{}", schedule.describe());
        let _ = writeln!(msg, "\nhistory of the events involved:");
        for op in history.iter().filter(|op| involved.contains(&op.event)) {
            let _ = writeln!(msg, "{}", op.line());
        }
        let _ = writeln!(msg, "\nexecutions of the events involved:");
        for (i, e) in executions.iter().enumerate() {
            if involved.contains(e) {
                let _ = writeln!(msg, "  execution {} for {e}", i + 1);
            }
        }
        msg
    });
    (cluster, result)
}

/// The four checks; on failure, the violations and the events involved.
fn check(
    events: &[String],
    history: &[Op],
    executions: &[String],
    logs: &str,
    scopes: &[(String, String)],
) -> Result<Summary, (Vec<String>, Vec<String>)> {
    let mut violations = Vec::new();
    let mut involved = Vec::new();
    let mut per_event: BTreeMap<&str, Vec<&Op>> = BTreeMap::new();
    for op in history {
        per_event.entry(&op.event).or_default().push(op);
    }
    let mut executed: HashMap<&str, usize> = HashMap::new();
    for e in executions {
        *executed.entry(e).or_default() += 1;
    }
    let log_count = |event: &str, what: &str| -> usize {
        let Some((scope, key)) = scopes.iter().find(|(_, k)| k == event) else {
            return 0;
        };
        let id = idemgate::key::KeyId::of(scope, key).to_string();
        logs.lines()
            .filter(|l| l.contains(what) && l.contains(&id))
            .count()
    };
    let (mut doubles, mut takeovers_total, mut unknown_total) = (0, 0, 0);
    for event in events {
        let ops = per_event.get(event.as_str()).cloned().unwrap_or_default();
        let oks: Vec<&&Op> = ops.iter().filter(|op| op.ok()).collect();
        let mut bad = false;
        // 1. no event lost.
        let delivered = ops.iter().any(|op| !op.replay && op.ok());
        if !delivered {
            violations.push(format!(
                "{event}: lost, no 2xx in {} attempts",
                ops.iter().filter(|op| !op.replay).count()
            ));
            bad = true;
        }
        // 2. every 2xx names real work.
        let mut named = Vec::new();
        for op in &oks {
            match op.execution() {
                Some((e, n))
                    if e == *event
                        && n.checked_sub(1).and_then(|i| executions.get(i)) == Some(event) =>
                {
                    named.push(n)
                }
                _ => {
                    violations.push(format!(
                        "{event}: a 2xx names no execution of this event: {}",
                        op.line().trim()
                    ));
                    bad = true;
                }
            }
        }
        // 3. one execution per event across its 2xx answers, and a retry after completion
        // gets it (guarantee 2).
        if delivered {
            for op in ops.iter().filter(|op| op.replay && !op.ok()) {
                violations.push(format!(
                    "{event}: a retry after completion got no 2xx: {}",
                    op.line().trim()
                ));
                bad = true;
            }
        }
        named.sort_unstable();
        named.dedup();
        if named.len() > 1 {
            violations.push(format!(
                "{event}: 2xx answers name different executions {named:?} \
                 ({} `lease lost` lines logged for the key)",
                log_count(event, "lease lost")
            ));
            bad = true;
        }
        // 4. every double counted.
        let n = executed.get(event.as_str()).copied().unwrap_or(0);
        let takeovers = log_count(event, "took over an expired lease");
        let unknown = ops
            .iter()
            .filter(|op| matches!(op.result, Ok((502 | 504, _))))
            .count();
        doubles += n.saturating_sub(1);
        takeovers_total += takeovers;
        unknown_total += unknown;
        if n.saturating_sub(1) > takeovers + unknown {
            violations.push(format!(
                "{event}: {n} executions, but only {takeovers} takeovers and {unknown} \
                 unknown outcomes (502/504) counted"
            ));
            bad = true;
        }
        if bad {
            involved.push(event.clone());
        }
    }
    if violations.is_empty() {
        Ok(Summary {
            requests: history.len(),
            executions: executions.len(),
            doubles,
            takeovers: takeovers_total,
            unknown: unknown_total,
            took: Duration::ZERO,
        })
    } else {
        Err((violations, involved))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_history_under_generated_faults_loses_nothing_and_counts_every_double() {
    let mut cluster = pg::Cluster::start_async().await;
    let mut failures = Vec::new();
    let (mut takeovers, mut unknown, mut doubles) = (0, 0, 0);
    let seeds = seeds(CI_SEEDS);
    for &seed in &seeds {
        let (c, result) = run_seed(seed, cluster).await;
        cluster = c;
        match result {
            Ok(s) => {
                takeovers += s.takeovers;
                unknown += s.unknown;
                doubles += s.doubles;
                println!(
                    "seed {seed}: ok in {:.1}s: {} requests, {} executions, {} doubles \
                 ({} takeovers, {} unknown outcomes counted)",
                    s.took.as_secs_f64(),
                    s.requests,
                    s.executions,
                    s.doubles,
                    s.takeovers,
                    s.unknown
                )
            }
            Err(msg) => {
                println!("{msg}");
                failures.push(msg);
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
    if seeds == CI_SEEDS {
        assert!(
            takeovers > 0 && unknown > 0 && doubles > 0,
            "the fixed seeds no longer reach a takeover, an unknown outcome and a double \
             ({takeovers}, {unknown}, {doubles}): the checks would hold vacuously"
        );
    }
}
