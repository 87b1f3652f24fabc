//! The load harness: `cargo bench --bench load`.
//!
//! Starts a throwaway PostgreSQL (the test harness's), a minimal hyper upstream with a fixed
//! small answer, and the release `idemgate` binary as a separate process, then drives each
//! scenario over keep-alive connections at a fixed concurrency, interleaved, for several
//! rounds, and prints the medians:
//!
//! 1. straight to the upstream;
//! 2. through a route without idempotency (pass-through);
//! 3. keyed, every request a new key (scopes spread over 100 accounts);
//! 4. keyed replays of one stored key;
//! 5. a duplicate storm: STORM concurrent requests with one key against a slow upstream;
//! 6. the database limit: the bare pair of statements a new key needs (a plain `INSERT ... ON
//!    CONFLICT DO NOTHING RETURNING` claim and a completion fenced by the lease token, two
//!    autocommits) on a table with the primary key only, over as many connections as the
//!    gateway's pool: the physical limit for scenario 3, not the gateway's own statements.
//!
//! PostgreSQL runs with stock durability (fsync and synchronous_commit on).
//!
//! And the gateway's peak RSS after 1,000 concurrent keyed connections, and the memory bound
//! holding on a gateway of its own (`max_buffered_bytes: 2MiB`): 100 keyed h2 streams whose
//! replays are not read, and 50 bodies declared and not sent. Knobs (environment):
//! LOAD_CONCURRENCY (32), LOAD_SECONDS per scenario and round (3), LOAD_ROUNDS (3),
//! LOAD_STORM (1000). Numbers depend on the machine: read the ratios. The benchmark of record
//! is the shared side-by-side harness (BENCHMARKS.md); this one is a developer's tool.

#[path = "../tests/it/support/pg.rs"]
#[allow(dead_code)]
mod pg;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The upstream: `{"ok":true}` at once, or after 200 ms under `/slow`.
async fn upstream(executions: Arc<AtomicUsize>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let _ = stream.set_nodelay(true);
            let executions = Arc::clone(&executions);
            tokio::spawn(async move {
                let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                    let executions = Arc::clone(&executions);
                    async move {
                        executions.fetch_add(1, Ordering::Relaxed);
                        let slow = req.uri().path().starts_with("/slow");
                        let big = req.uri().path().starts_with("/big");
                        let _ = req.into_body().collect().await;
                        if slow {
                            tokio::time::sleep(Duration::from_millis(200)).await;
                        }
                        let body = if big {
                            Bytes::from(vec![b' '; BIG_ANSWER])
                        } else {
                            Bytes::from_static(b"{\"ok\":true}")
                        };
                        let mut r = Response::new(Full::new(body));
                        r.headers_mut()
                            .insert("content-type", "application/json".parse().unwrap());
                        Ok::<_, Infallible>(r)
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    addr
}

/// The answer under `/big`: 256 KiB.
const BIG_ANSWER: usize = 256 * 1024;

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(addr: SocketAddr) -> Option<Sender> {
    let stream = TcpStream::connect(addr).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(send)
}

/// What one scenario measured.
#[derive(Clone, Copy, Default)]
struct Stats {
    errors: u64,
    rps: f64,
    p50_us: u64,
    p99_us: u64,
}

fn stats(mut lat: Vec<u64>, errors: u64, elapsed: Duration) -> Stats {
    lat.sort_unstable();
    let pick = |q: f64| {
        lat.get(((lat.len() as f64 * q) as usize).min(lat.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    Stats {
        errors,
        rps: lat.len() as f64 / elapsed.as_secs_f64(),
        p50_us: pick(0.50),
        p99_us: pick(0.99),
    }
}

/// `concurrency` workers on their own keep-alive connections, each sending `make(i)` in a
/// loop for `secs`.
async fn drive<F>(addr: SocketAddr, concurrency: usize, secs: u64, make: F) -> Stats
where
    F: Fn(u64) -> Request<Full<Bytes>> + Send + Sync + 'static,
{
    let make = Arc::new(make);
    let seq = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (make, seq) = (Arc::clone(&make), Arc::clone(&seq));
            tokio::spawn(async move {
                let mut lat = Vec::new();
                let mut errors = 0u64;
                let mut conn = connect(addr).await;
                while Instant::now() < deadline {
                    let Some(send) = conn.as_mut() else {
                        errors += 1;
                        conn = connect(addr).await;
                        continue;
                    };
                    let req = make(seq.fetch_add(1, Ordering::Relaxed) as u64);
                    let t = Instant::now();
                    let ok = match send.send_request(req).await {
                        Ok(resp) => {
                            let good = resp.status().is_success();
                            let body = resp.into_body().collect().await.is_ok();
                            good && body
                        }
                        Err(_) => false,
                    };
                    if ok {
                        lat.push(t.elapsed().as_micros() as u64);
                    } else {
                        errors += 1;
                        conn = connect(addr).await;
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let mut lat = Vec::new();
    let mut errors = 0;
    for w in workers {
        let (l, e) = w.await.unwrap();
        lat.extend(l);
        errors += e;
    }
    stats(lat, errors, start.elapsed())
}

fn post(path: &str, key: Option<String>, account: &str) -> Request<Full<Bytes>> {
    let mut b = Request::builder()
        .method("POST")
        .uri(path)
        .header("host", "bench")
        .header("content-type", "application/json")
        .header("x-account-id", account);
    if let Some(k) = key {
        b = b.header("idempotency-key", k);
    }
    b.body(Full::new(Bytes::from_static(
        b"{\"amount\":100,\"currency\":\"EUR\"}",
    )))
    .unwrap()
}

/// The database limit: claim + completion through the pool at the same concurrency.
/// The bare pair's table: the primary key only (what any idempotency store must write).
const BARE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS bare_keys (
    scope text NOT NULL, key text NOT NULL, fingerprint bytea NOT NULL,
    state smallint NOT NULL, lease_token uuid, lease_expires_at timestamptz,
    status smallint, headers bytea, body bytea, expires_at timestamptz NOT NULL,
    PRIMARY KEY (scope, key))";

const BARE_CLAIM: &str = "INSERT INTO bare_keys
       (scope, key, fingerprint, state, lease_token, lease_expires_at, expires_at)
VALUES ($1, $2, $3, 0, gen_random_uuid(), now() + interval '30 seconds', now() + interval '24 hours')
ON CONFLICT (scope, key) DO NOTHING
RETURNING lease_token";

const BARE_COMPLETE: &str = "UPDATE bare_keys
   SET state = 1, status = 200, headers = $4, body = $5,
       lease_expires_at = NULL, expires_at = now() + interval '24 hours'
 WHERE scope = $1 AND key = $2 AND lease_token = $3";

async fn db_limit(db: String, concurrency: usize, secs: u64, round: usize) -> Stats {
    let seq = Arc::new(AtomicUsize::new(0));
    let start = Instant::now();
    let deadline = start + Duration::from_secs(secs);
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (db, seq) = (db.clone(), Arc::clone(&seq));
            tokio::spawn(async move {
                let (mut lat, mut errors) = (Vec::new(), 0u64);
                let (client, conn) = tokio_postgres::connect(&db, tokio_postgres::NoTls)
                    .await
                    .expect("db-limit connection");
                tokio::spawn(conn);
                client.batch_execute(BARE_SCHEMA).await.ok();
                let claim = client.prepare(BARE_CLAIM).await.expect("prepare claim");
                let complete = client
                    .prepare(BARE_COMPLETE)
                    .await
                    .expect("prepare completion");
                let fp = vec![7u8; 32];
                let headers = b"content-type: application/json".to_vec();
                let body = vec![b'x'; 200];
                while Instant::now() < deadline {
                    let n = seq.fetch_add(1, Ordering::Relaxed);
                    let key = format!("db-{round}-{n}");
                    let scope = format!("acct-{}", n % 100);
                    let t = Instant::now();
                    let ok = match client.query_opt(&claim, &[&scope, &key, &fp]).await {
                        Ok(Some(row)) => {
                            let token: uuid_text::Token = row.get(0);
                            client
                                .execute(&complete, &[&scope, &key, &token, &headers, &body])
                                .await
                                .is_ok_and(|n| n == 1)
                        }
                        _ => false,
                    };
                    if ok {
                        lat.push(t.elapsed().as_micros() as u64);
                    } else {
                        errors += 1;
                    }
                }
                (lat, errors)
            })
        })
        .collect();
    let (mut lat, mut errors) = (Vec::new(), 0);
    for w in workers {
        let (l, e) = w.await.unwrap();
        lat.extend(l);
        errors += e;
    }
    stats(lat, errors, start.elapsed())
}

/// A uuid carried through as PostgreSQL's own bytes (no uuid crate needed).
mod uuid_text {
    use tokio_postgres::types::{FromSql, IsNull, ToSql, Type, to_sql_checked};

    #[derive(Debug)]
    pub struct Token(Vec<u8>);

    impl<'a> FromSql<'a> for Token {
        fn from_sql(
            _: &Type,
            raw: &'a [u8],
        ) -> Result<Self, Box<dyn std::error::Error + Sync + Send>> {
            Ok(Token(raw.to_vec()))
        }
        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }
    }

    impl ToSql for Token {
        fn to_sql(
            &self,
            _: &Type,
            out: &mut bytes::BytesMut,
        ) -> Result<IsNull, Box<dyn std::error::Error + Sync + Send>> {
            out.extend_from_slice(&self.0);
            Ok(IsNull::No)
        }
        fn accepts(ty: &Type) -> bool {
            *ty == Type::UUID
        }
        to_sql_checked!();
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn rss_kib(pid: u32, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(0)
}

/// CPU seconds used so far by: the gateway, this process (load generator and upstream),
/// and the cluster's processes.
#[derive(Clone, Copy, Default)]
struct Cpu {
    gateway: f64,
    bench: f64,
    postgres: f64,
}

/// The fields of `/proc/<pid>/stat` after the parenthesised command name (state is 0, ppid
/// 1, utime 11, stime 12, cutime 13, cstime 14).
fn proc_stat(pid: &str) -> Option<Vec<u64>> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &s[s.rfind(')')? + 2..];
    Some(
        rest.split_whitespace()
            .skip(1)
            .map(|f| f.parse().unwrap_or(0))
            .collect(),
    )
}

fn cpu_of(pid: &str, tick: f64) -> f64 {
    proc_stat(pid).map_or(0.0, |f| (f[10] + f[11]) as f64 / tick)
}

/// CPU seconds of this cluster alone (other PostgreSQL servers on a shared machine are not
/// counted): the postmaster with its reaped children, and its live children.
fn cluster_cpu(postmaster: u32, tick: f64) -> f64 {
    let Some(pm) = proc_stat(&postmaster.to_string()) else {
        return 0.0;
    };
    let mut ticks = pm[10] + pm[11] + pm[12] + pm[13];
    if let Ok(dir) = std::fs::read_dir("/proc") {
        for e in dir.flatten() {
            let name = e.file_name();
            let pid = name.to_string_lossy();
            if pid.bytes().all(|b| b.is_ascii_digit())
                && let Some(f) = proc_stat(&pid)
                && f[0] == u64::from(postmaster)
            {
                ticks += f[10] + f[11];
            }
        }
    }
    ticks as f64 / tick
}

fn cpu_now(gateway_pid: u32, postmaster: u32, tick: f64) -> Cpu {
    Cpu {
        gateway: cpu_of(&gateway_pid.to_string(), tick),
        bench: cpu_of("self", tick),
        postgres: cluster_cpu(postmaster, tick),
    }
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(0);
    format!("{cores} cores ({cpu})")
}

#[tokio::main]
async fn main() {
    let concurrency = env("LOAD_CONCURRENCY", 32) as usize;
    let secs = env("LOAD_SECONDS", 3);
    let rounds = env("LOAD_ROUNDS", 3) as usize;
    let storm_n = env("LOAD_STORM", 1000) as usize;
    // For profiling: LOAD_ONLY=1 drives only scenario 1 (pass-through), etc.
    let only = env("LOAD_ONLY", 0) as usize;
    let on = |i: usize| only == 0 || only == i + 1;

    eprintln!("load: starting PostgreSQL, the upstream and idemgate...");
    let cluster = tokio::task::spawn_blocking(pg::Cluster::start_durable)
        .await
        .unwrap();
    let db = cluster.new_database().await;
    let executions = Arc::new(AtomicUsize::new(0));
    let up = upstream(Arc::clone(&executions)).await;
    let store_block = format!(
        "  postgres: {{ url: \"{db}\", pool_size: 16, acquire_timeout: 500ms, statement_timeout: 2s }}"
    );
    let yaml = format!(
        r#"listen: 127.0.0.1:0
server: {{ max_connections: 5000 }}
store:
{store_block}
upstreams:
  app: {{ url: "http://{up}", timeout: 5s }}
routes:
  - name: plain
    match: {{ path_prefix: /plain }}
    upstream: app
  - name: keyed
    match: {{ path_prefix: / }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
      wait_timeout: 30s
"#
    );
    let dir = std::env::temp_dir().join(format!("idemgate-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_idemgate"));
    let gw = idemgate::process::GatewayProcess::start_logging(exe, &dir, &yaml, "warn")
        .await
        .expect("gateway");
    let gw_addr = gw.addr;
    // LOAD_PIN=1: the gateway gets the last core to itself; the load generator, the upstream
    // and PostgreSQL share the others (the usual way to keep a load generator from stealing
    // the system under test's CPU). Without it, everything shares every core.
    let pinned = env("LOAD_PIN", 0) == 1;
    let machine = machine(); // before pinning narrows what this process sees
    if pinned {
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2);
        let last = cores - 1;
        let rest = if last == 0 {
            "0".to_string()
        } else {
            format!("0-{}", last - 1)
        };
        let pin = |pid: String, cpus: &str| {
            let ok = std::process::Command::new("taskset")
                .args(["-a", "-p", "-c", cpus, &pid])
                .output()
                .is_ok_and(|o| o.status.success());
            assert!(ok, "taskset failed for {pid}");
        };
        pin(gw.pid().unwrap().to_string(), &last.to_string());
        pin(std::process::id().to_string(), &rest);
        for e in std::fs::read_dir("/proc").unwrap().flatten() {
            let pid = e.file_name().to_string_lossy().to_string();
            if std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|c| c.trim() == "postgres")
            {
                pin(pid, &rest);
            }
        }
    }
    // The bare pair runs in a database of its own.
    let bare_db = cluster.new_database().await;

    // Prime the replayed key.
    let mut s = connect(gw_addr).await.unwrap();
    let r = s
        .send_request(post("/keyed", Some("replayed-key".into()), "acct-0"))
        .await
        .unwrap();
    assert!(r.status().is_success(), "priming failed: {}", r.status());

    let names = [
        "direct",
        "pass-through",
        "keyed, new keys",
        "keyed, replays",
        "database limit",
    ];
    let mut results: Vec<Vec<Stats>> = vec![Vec::new(); names.len()];
    // CPU microseconds per request by component, per scenario and round.
    let mut cpu_per_req: Vec<Vec<Cpu>> = vec![Vec::new(); names.len()];
    let tick: f64 = std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0);
    let gw_pid = gw.pid().expect("gateway running");
    let postmaster = cluster.postmaster_pid().expect("the cluster runs");
    let measure = |i: usize, before: Cpu, s: &Stats, secs: u64, out: &mut Vec<Vec<Cpu>>| {
        let after = cpu_now(gw_pid, postmaster, tick);
        let n = (s.rps * secs as f64).max(1.0);
        out[i].push(Cpu {
            gateway: (after.gateway - before.gateway) * 1e6 / n,
            bench: (after.bench - before.bench) * 1e6 / n,
            postgres: (after.postgres - before.postgres) * 1e6 / n,
        });
    };
    let mut storms = Vec::new();
    for round in 0..rounds {
        eprintln!("load: round {}/{rounds}", round + 1);
        if on(0) {
            let before = cpu_now(gw_pid, postmaster, tick);
            let r = drive(up, concurrency, secs, |_| post("/plain", None, "acct-0")).await;
            measure(0, before, &r, secs, &mut cpu_per_req);
            results[0].push(r);
        }
        if on(1) {
            let before = cpu_now(gw_pid, postmaster, tick);
            let r = drive(gw_addr, concurrency, secs, |_| {
                post("/plain", None, "acct-0")
            })
            .await;
            measure(1, before, &r, secs, &mut cpu_per_req);
            results[1].push(r);
        }
        if on(2) {
            let before = cpu_now(gw_pid, postmaster, tick);
            let r = drive(gw_addr, concurrency, secs, move |i| {
                post(
                    "/keyed",
                    Some(format!("new-{round}-{i}")),
                    &format!("acct-{}", i % 100),
                )
            })
            .await;
            measure(2, before, &r, secs, &mut cpu_per_req);
            results[2].push(r);
        }
        if on(3) {
            let before = cpu_now(gw_pid, postmaster, tick);
            let r = drive(gw_addr, concurrency, secs, |_| {
                post("/keyed", Some("replayed-key".into()), "acct-0")
            })
            .await;
            measure(3, before, &r, secs, &mut cpu_per_req);
            results[3].push(r);
        }
        if on(4) {
            let before = cpu_now(gw_pid, postmaster, tick);
            let r = db_limit(bare_db.clone(), concurrency, secs, round).await;
            measure(4, before, &r, secs, &mut cpu_per_req);
            results[4].push(r);
        }
        if only != 0 {
            continue;
        }

        // The storm: STORM connections, one key, a slow upstream.
        let before = executions.load(Ordering::SeqCst);
        let key = format!("storm-{round}");
        let t = Instant::now();
        let tasks: Vec<_> = (0..storm_n)
            .map(|_| {
                let key = key.clone();
                tokio::spawn(async move {
                    let mut s = connect(gw_addr).await?;
                    let r = s
                        .send_request(post("/slow", Some(key), "acct-storm"))
                        .await
                        .ok()?;
                    let ok = r.status().is_success();
                    r.into_body().collect().await.ok()?;
                    Some(ok)
                })
            })
            .collect();
        let mut ok = 0;
        for task in tasks {
            if task.await.unwrap() == Some(true) {
                ok += 1;
            }
        }
        storms.push((ok, executions.load(Ordering::SeqCst) - before, t.elapsed()));
    }

    if only != 0 {
        let s = &results[only - 1][0];
        println!(
            "{}: {:.0} requests/s, p50 {} us, p99 {} us, {} errors",
            names[only - 1],
            s.rps,
            s.p50_us,
            s.p99_us,
            s.errors
        );
        return;
    }

    // Peak RSS with 1,000 concurrent keyed connections in flight against the slow upstream.
    let pid = gw.pid().unwrap();
    let rss_before = rss_kib(pid, "VmRSS:");
    let tasks: Vec<_> = (0..1000)
        .map(|i| {
            tokio::spawn(async move {
                let mut s = connect(gw_addr).await?;
                let r = s
                    .send_request(post(
                        "/slow",
                        Some(format!("rss-{i}")),
                        &format!("acct-{}", i % 100),
                    ))
                    .await
                    .ok()?;
                r.into_body().collect().await.ok()?;
                Some(())
            })
        })
        .collect();
    let mut answered = 0;
    for t in tasks {
        if t.await.unwrap().is_some() {
            answered += 1;
        }
    }
    let peak = rss_kib(pid, "VmHWM:");

    let med = |i: usize, f: fn(&Stats) -> f64| median(results[i].iter().map(f).collect());
    println!(
        "\n## Load ({} rounds x {secs}s per scenario, concurrency {concurrency}, interleaved; medians)\n",
        rounds
    );
    println!(
        "Machine: {machine}. Gateway: release build, one process; PostgreSQL 15 (durable: fsync and synchronous_commit on). {}\n",
        if pinned {
            "Pinned: the gateway alone on the last core; load generator, upstream and PostgreSQL on the others."
        } else {
            "Shared: load generator, upstream, gateway and PostgreSQL share every core."
        }
    );
    println!(
        "| scenario | requests/s | p50 | p99 | errors | CPU µs/request: gateway | load + upstream | postgres |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (i, name) in names.iter().enumerate() {
        let errors: u64 = results[i].iter().map(|s| s.errors).sum();
        let cpu = |f: fn(&Cpu) -> f64| median(cpu_per_req[i].iter().map(f).collect());
        println!(
            "| {name} | {:.0} | {:.2} ms | {:.2} ms | {errors} | {:.0} | {:.0} | {:.0} |",
            med(i, |s| s.rps),
            med(i, |s| s.p50_us as f64) / 1000.0,
            med(i, |s| s.p99_us as f64) / 1000.0,
            cpu(|c| c.gateway),
            cpu(|c| c.bench),
            cpu(|c| c.postgres),
        );
    }
    let (rps_new, rps_db) = (med(2, |s| s.rps), med(4, |s| s.rps));
    let (rps_replay, rps_pass, rps_direct) =
        (med(3, |s| s.rps), med(1, |s| s.rps), med(0, |s| s.rps));
    println!("\n| ratio | value | target |");
    println!("|---|---:|---:|");
    println!(
        "| new keys / database limit | {:.0}% | >= 70% |",
        100.0 * rps_new / rps_db
    );
    println!(
        "| replays / pass-through | {:.0}% | >= 80% |",
        100.0 * rps_replay / rps_pass
    );
    println!(
        "| pass-through / direct | {:.0}% | >= 60% |",
        100.0 * rps_pass / rps_direct
    );
    println!(
        "\n| duplicate storm ({storm_n} concurrent, one key, upstream 200 ms) | answered 2xx | executions | time to answer all |"
    );
    println!("|---|---:|---:|---:|");
    for (i, (ok, ex, t)) in storms.iter().enumerate() {
        println!(
            "| round {} | {ok} of {storm_n} | {ex} | {} ms |",
            i + 1,
            t.as_millis()
        );
    }
    println!(
        "\nPeak RSS of the gateway: {:.1} MiB after 1,000 concurrent keyed connections ({answered} answered; {:.1} MiB before).",
        peak as f64 / 1024.0,
        rss_before as f64 / 1024.0
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
    memory_bound(&db, up).await;
}

/// The gateway's held bytes (`idemgate_buffered_bytes`), read from its admin listener.
async fn buffered(admin: SocketAddr) -> f64 {
    let mut s = connect(admin).await.expect("admin listener");
    let req = Request::builder()
        .uri("/metrics")
        .header("host", "bench")
        .body(Full::new(Bytes::new()))
        .unwrap();
    let body = s
        .send_request(req)
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&body.to_bytes()).into_owned();
    text.lines()
        .find_map(|l| l.strip_prefix("idemgate_buffered_bytes "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(f64::NAN)
}

/// The memory bound holding (`server.max_buffered_bytes: 2MiB`), on a gateway of its own:
/// 100 keyed HTTP/2 streams on one connection replaying a 256 KiB answer that the client
/// does not read, and 50 clients that each declare a 1 MiB body and send one byte while 100
/// others are served.
async fn memory_bound(db: &str, up: SocketAddr) {
    let yaml = format!(
        r#"listen: 127.0.0.1:0
server: {{ max_buffered_bytes: 2MiB, body_read_timeout: 30s }}
admin: {{ listen: 127.0.0.1:0 }}
store:
  postgres: {{ url: "{db}", pool_size: 16, acquire_timeout: 500ms, statement_timeout: 2s }}
upstreams:
  app: {{ url: "http://{up}", timeout: 5s }}
routes:
  - name: keyed
    match: {{ path_prefix: / }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
"#
    );
    let dir = std::env::temp_dir().join(format!("idemgate-bound-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let exe = std::path::Path::new(env!("CARGO_BIN_EXE_idemgate"));
    let gw = idemgate::process::GatewayProcess::start_logging(exe, &dir, &yaml, "warn")
        .await
        .expect("gateway");
    let (addr, admin) = (gw.addr, gw.admin.expect("admin listener"));
    let pid = gw.pid().unwrap();
    // The answer, stored once.
    let mut s = connect(addr).await.unwrap();
    let first = s
        .send_request(post("/big", Some("big".into()), "acct"))
        .await
        .unwrap();
    first.into_body().collect().await.unwrap();
    let rss_before = rss_kib(pid, "VmRSS:");

    // 100 streams on one h2 connection, answers left unread.
    let stream = TcpStream::connect(addr).await.unwrap();
    let (h2, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    let heads: Vec<_> = (0..100)
        .map(|_| {
            let mut h2 = h2.clone();
            tokio::spawn(async move {
                h2.send_request(post("/big", Some("big".into()), "acct"))
                    .await
            })
        })
        .collect();
    let mut held_answers = Vec::new();
    let (mut ok, mut refused) = (0, 0);
    for h in heads {
        match h.await.unwrap() {
            Ok(r) if r.status() == 503 => refused += 1,
            Ok(r) => {
                ok += 1;
                held_answers.push(r);
            }
            Err(_) => {}
        }
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gauge_h2 = buffered(admin).await;
    let rss_h2 = rss_kib(pid, "VmRSS:");
    drop(held_answers);
    drop(h2);

    // 50 clients declare 1 MiB each and send one byte; 100 others are served meanwhile.
    let mut stalled = Vec::new();
    for i in 0..50 {
        let mut s = TcpStream::connect(addr).await.unwrap();
        let head = format!(
            "POST /stall HTTP/1.1\r\nhost: bench\r\nidempotency-key: stall-{i}\r\n\
             x-account-id: acct\r\ncontent-type: application/json\r\n\
             content-length: 1048576\r\n\r\n{{"
        );
        tokio::io::AsyncWriteExt::write_all(&mut s, head.as_bytes())
            .await
            .unwrap();
        stalled.push(s);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let gauge_stalled = buffered(admin).await;
    let mut served = 0;
    let mut statuses = std::collections::BTreeMap::new();
    for i in 0..100 {
        let mut s = connect(addr).await.unwrap();
        let r = s
            .send_request(post("/new", Some(format!("new-{i}")), "acct"))
            .await
            .unwrap();
        *statuses.entry(r.status().as_u16()).or_insert(0) += 1;
        if r.status().is_success() {
            served += 1;
        }
        r.into_body().collect().await.unwrap();
    }
    eprintln!("load: the 100 keyed requests beside the stalled bodies: {statuses:?}");
    let peak = rss_kib(pid, "VmHWM:");
    drop(stalled);
    println!("\n## The memory bound (`max_buffered_bytes: 2MiB`)\n");
    println!("| case | answered | refused 503 | held (gauge) | gateway RSS |");
    println!("|---|---:|---:|---:|---:|");
    println!(
        "| 100 h2 streams replaying a 256 KiB answer, unread | {ok} | {refused} | {:.2} MiB | {:.1} MiB (from {:.1}) |",
        gauge_h2 / 1048576.0,
        rss_h2 as f64 / 1024.0,
        rss_before as f64 / 1024.0
    );
    println!(
        "| 50 clients declaring 1 MiB and sending 1 byte, then 100 keyed requests | {served} of 100 | {} | {:.0} bytes | peak {:.1} MiB |",
        100 - served,
        gauge_stalled,
        peak as f64 / 1024.0
    );
    drop(gw);
    let _ = std::fs::remove_dir_all(&dir);
}
