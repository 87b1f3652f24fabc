//! Plain and keyed forwards to an `http://` HTTP/1.1 upstream over the gateway's own
//! connection pool (`forward/h1.rs`): connections are reused, one the upstream closed is never
//! used (a new one is made, the request runs once), one whose response body was not read to its
//! end is never reused, nor one answered before its request body was all sent, and
//! `Connection: close` is honoured, and with more serving threads than the pool has lists
//! each thread still forwards over its own connections. The upstream is a raw TCP server
//! that counts the connections it accepted and the requests it answered, and keeps the `Host`
//! (and `X-Client`) each request named.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use http::Method;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// How the raw upstream ends each exchange.
#[derive(Clone, Copy, PartialEq)]
enum Ending {
    /// Keep the connection open.
    KeepAlive,
    /// Close the socket 100 ms after the response, without saying so (as an upstream whose
    /// keep-alive timeout fires does): by then the gateway holds the connection idle.
    SilentClose,
    /// Say `Connection: close`, then close.
    ConnectionClose,
    /// A 1 MiB body written slowly, then keep the connection open.
    SlowBigBody,
    /// Answer once the request head is read, before its body; then read (and discard) until
    /// the gateway closes the connection.
    EarlyAnswer,
}

struct RawUpstream {
    addr: std::net::SocketAddr,
    connections: Arc<AtomicUsize>,
    answered: Arc<AtomicUsize>,
    closed: Arc<AtomicUsize>,
    /// The `Host` header of each request answered.
    hosts: Arc<std::sync::Mutex<Vec<String>>>,
    /// Each request answered: the number of the connection it came on (from 0, in the order
    /// they were accepted) and its `X-Client` header (empty without one).
    served: Arc<std::sync::Mutex<Vec<(usize, String)>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl RawUpstream {
    async fn start(ending: Ending) -> RawUpstream {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(AtomicUsize::new(0));
        let closed = Arc::new(AtomicUsize::new(0));
        let hosts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let served = Arc::new(std::sync::Mutex::new(Vec::new()));
        let (conns, ans, cl) = (connections.clone(), answered.clone(), closed.clone());
        let (seen, by_conn) = (hosts.clone(), served.clone());
        let task = tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                let number = conns.fetch_add(1, Ordering::SeqCst);
                let (ans, cl, seen) = (ans.clone(), cl.clone(), seen.clone());
                let by_conn = by_conn.clone();
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let end = loop {
                            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                                break i + 4;
                            }
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => {
                                    cl.fetch_add(1, Ordering::SeqCst);
                                    return;
                                }
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let length: usize = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        while ending != Ending::EarlyAnswer && buf.len() < end + length {
                            match conn.read(&mut chunk).await {
                                Ok(0) | Err(_) => return,
                                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                            }
                        }
                        buf.drain(..(end + length).min(buf.len()));
                        if let Some(host) = head.lines().find_map(|l| l.strip_prefix("host:")) {
                            seen.lock().unwrap().push(host.trim().to_string());
                        }
                        let client = head.lines().find_map(|l| l.strip_prefix("x-client:"));
                        let client = client.unwrap_or_default().trim().to_string();
                        by_conn.lock().unwrap().push((number, client));
                        let n = ans.fetch_add(1, Ordering::SeqCst) + 1;
                        let body = format!("{{\"execution\":{n}}}");
                        let wrote = match ending {
                            Ending::SlowBigBody => {
                                let size = 1 << 20;
                                let head =
                                    format!("HTTP/1.1 200 OK\r\ncontent-length: {size}\r\n\r\n");
                                let mut ok = conn.write_all(head.as_bytes()).await.is_ok();
                                let piece = vec![b'x'; 16 * 1024];
                                for _ in 0..size / piece.len() {
                                    if !ok {
                                        break;
                                    }
                                    ok = conn.write_all(&piece).await.is_ok();
                                    tokio::time::sleep(Duration::from_millis(5)).await;
                                }
                                ok
                            }
                            _ => {
                                let close = if ending == Ending::ConnectionClose {
                                    "connection: close\r\n"
                                } else {
                                    ""
                                };
                                let resp = format!(
                                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n{close}content-length: {}\r\n\r\n{body}",
                                    body.len()
                                );
                                conn.write_all(resp.as_bytes()).await.is_ok()
                            }
                        };
                        if wrote && ending == Ending::EarlyAnswer {
                            while let Ok(1..) = conn.read(&mut chunk).await {}
                        }
                        if wrote && ending == Ending::SilentClose {
                            // A keep-alive timeout of 100 ms.
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                        if !wrote
                            || matches!(
                                ending,
                                Ending::SilentClose | Ending::ConnectionClose | Ending::EarlyAnswer
                            )
                        {
                            drop(conn);
                            cl.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                });
            }
        });
        RawUpstream {
            addr,
            connections,
            answered,
            closed,
            hosts,
            served,
            _task: task,
        }
    }

    fn hosts(&self) -> Vec<String> {
        self.hosts.lock().unwrap().clone()
    }

    /// For each connection that carried requests, the `X-Client` values they had.
    fn clients_by_connection(&self) -> std::collections::BTreeMap<usize, BTreeSet<String>> {
        let mut by = std::collections::BTreeMap::<usize, BTreeSet<String>>::new();
        for (number, client) in self.served.lock().unwrap().iter() {
            by.entry(*number).or_default().insert(client.clone());
        }
        by
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }

    fn answered(&self) -> usize {
        self.answered.load(Ordering::SeqCst)
    }

    fn closed(&self) -> usize {
        self.closed.load(Ordering::SeqCst)
    }
}

/// The configuration of a gateway whose only route is a plain catch-all to `up`.
fn plain_yaml(up: &RawUpstream, db: &str) -> String {
    format!(
        r#"{head}upstreams:
  app: {{ url: "http://{addr}", connect_timeout: 500ms, timeout: 5s }}
routes:
  - name: rest
    match: {{ path_prefix: / }}
    upstream: app
"#,
        head = config_head(&pg_store_block(db)),
        addr = up.addr
    )
}

/// A gateway whose only route is a plain catch-all to `up`.
async fn plain_gateway(up: &RawUpstream) -> TestGateway {
    let db = pg::fresh_database().await;
    TestGateway::start(&plain_yaml(up, &db), &db).await
}

/// A gateway whose only route is keyed: `POST /pay`, key from `Idempotency-Key`.
async fn keyed_gateway(up: &RawUpstream) -> TestGateway {
    let db = pg::fresh_database().await;
    let yaml = format!(
        r#"{head}upstreams:
  app: {{ url: "http://{addr}", connect_timeout: 500ms, timeout: 5s }}
routes:
  - name: pay
    match: {{ path: /pay, methods: [POST] }}
    upstream: app
    idempotency:
      key: [ {{ header: Idempotency-Key }} ]
      scope: {{ fixed: shop }}
      required: true
"#,
        head = config_head(&pg_store_block(&db)),
        addr = up.addr
    );
    TestGateway::start(&yaml, &db).await
}

/// A client connection of its own to `gw` that has sent `request` (bytes as they go on the
/// wire) and read until `enough` says what came back is enough; the connection stays open.
async fn raw_request(
    gw: &TestGateway,
    request: &[u8],
    enough: impl Fn(&[u8]) -> bool,
) -> (tokio::net::TcpStream, Vec<u8>) {
    let mut raw = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    raw.write_all(request).await.unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    while !enough(&got) {
        let n = raw.read(&mut chunk).await.unwrap();
        assert!(
            n > 0,
            "the gateway answered: {}",
            String::from_utf8_lossy(&got)
        );
        got.extend_from_slice(&chunk[..n]);
    }
    (raw, got)
}

async fn pay(c: &TestClient, gw: &TestGateway, key: &str) -> Reply {
    send(
        c,
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", key),
            ("content-type", "application/json"),
        ],
        r#"{"amount":100}"#,
    )
    .await
}

async fn get(c: &TestClient, gw: &TestGateway, path: &str) -> Reply {
    send(c, Method::GET, &gw.url(path), &[], String::new()).await
}

#[tokio::test]
async fn plain_forwards_reuse_one_upstream_connection() {
    let up = RawUpstream::start(Ending::KeepAlive).await;
    let gw = plain_gateway(&up).await;
    let c = client();
    for i in 1..=20 {
        let r = get(&c, &gw, "/orders").await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.json()["execution"], i);
    }
    assert_eq!(up.answered(), 20);
    assert_eq!(up.connections(), 1, "one connection, reused");
}

#[tokio::test]
async fn a_connection_the_upstream_closed_is_never_used_the_request_runs_once_on_a_new_one() {
    let up = RawUpstream::start(Ending::SilentClose).await;
    let gw = plain_gateway(&up).await;
    let c = client();
    for i in 1..=10 {
        let r = get(&c, &gw, "/orders").await;
        assert_eq!(
            r.status, 200,
            "never a 502 for a connection closed while idle: {r:?}"
        );
        assert_eq!(r.json()["execution"], i);
        // The upstream has closed the connection the gateway holds idle.
        wait_until("the upstream closed it", Duration::from_secs(5), || async {
            up.closed() == i
        })
        .await;
    }
    assert_eq!(up.answered(), 10, "each request ran once");
    assert_eq!(up.connections(), 10, "a new connection each time");
}

#[tokio::test]
async fn connection_close_from_the_upstream_is_honoured() {
    let up = RawUpstream::start(Ending::ConnectionClose).await;
    let gw = plain_gateway(&up).await;
    let c = client();
    for i in 1..=5 {
        let r = get(&c, &gw, "/orders").await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.json()["execution"], i);
        assert!(
            !r.headers.contains_key("connection"),
            "hop-by-hop: not passed to the client"
        );
    }
    assert_eq!((up.answered(), up.connections()), (5, 5));
}

#[tokio::test]
async fn a_connection_whose_body_was_not_read_to_its_end_is_never_reused() {
    let up = RawUpstream::start(Ending::SlowBigBody).await;
    let gw = plain_gateway(&up).await;
    // A client that reads the head and a little of the body, then hangs up.
    let (raw, got) = raw_request(&gw, b"GET /big HTTP/1.1\r\nhost: x\r\n\r\n", |got| {
        got.windows(4).any(|w| w == b"\r\n\r\n") && got.len() >= 20_000
    })
    .await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    drop(raw);
    // The half-read connection is closed by the gateway, not kept for the next request.
    wait_until(
        "the gateway closed the half-read upstream connection",
        Duration::from_secs(10),
        || async { up.closed() == 1 },
    )
    .await;
    let c = client();
    let r = get(&c, &gw, "/next").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body.len(), 1 << 20, "the whole body");
    assert_eq!((up.answered(), up.connections()), (2, 2));
}

#[tokio::test]
async fn a_connection_answered_before_its_request_body_was_all_sent_is_never_reused() {
    let up = RawUpstream::start(Ending::EarlyAnswer).await;
    let gw = plain_gateway(&up).await;
    // A client that announces 1 MiB, sends 64 KiB of it and waits; the upstream answers
    // before it has the rest.
    let mut request =
        b"POST /upload HTTP/1.1\r\nhost: x\r\ncontent-length: 1048576\r\n\r\n".to_vec();
    request.extend_from_slice(&[b'x'; 64 * 1024]);
    let (mut raw, got) =
        raw_request(&gw, &request, |got| got.ends_with(b"{\"execution\":1}")).await;
    assert!(
        got.starts_with(b"HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&got)
    );
    // The rest of the body has nowhere to go: the gateway closes the client's connection.
    // Parked in the pool half-written, the upstream connection would hold it open, the upload
    // waiting on a connection nobody polls, until the pool's reaper came by (30 s).
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        let mut chunk = [0u8; 4096];
        while let Ok(1..) = raw.read(&mut chunk).await {}
    })
    .await;
    assert!(
        closed.is_ok(),
        "the client's connection was left waiting after its answer"
    );
    wait_until(
        "the gateway closed the half-written upstream connection",
        Duration::from_secs(10),
        || async { up.closed() == 1 },
    )
    .await;
    let r = get(&client(), &gw, "/next").await;
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.json()["execution"], 2);
    assert_eq!(
        (up.answered(), up.connections()),
        (2, 2),
        "a new connection"
    );
}

#[tokio::test]
async fn keyed_forwards_reuse_one_upstream_connection_and_name_the_upstreams_host() {
    let up = RawUpstream::start(Ending::KeepAlive).await;
    let gw = keyed_gateway(&up).await;
    let c = client();
    for i in 1..=10 {
        let key = format!("k-{i}");
        let r = pay(&c, &gw, &key).await;
        assert_eq!(r.status, 200, "{r:?}");
        assert_eq!(r.json()["execution"], i);
        let again = pay(&c, &gw, &key).await;
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.json()["execution"], i, "the stored answer");
    }
    assert_eq!(up.answered(), 10, "each key ran once");
    assert_eq!(up.connections(), 1, "one connection, reused");
    let want = up.addr.to_string();
    assert_eq!(up.hosts(), vec![want; 10], "Host names the upstream");
}

#[tokio::test]
async fn a_keyed_forward_never_uses_a_connection_the_upstream_closed_and_runs_once() {
    let up = RawUpstream::start(Ending::SilentClose).await;
    let gw = keyed_gateway(&up).await;
    let c = client();
    for i in 1..=5 {
        let key = format!("k-{i}");
        let r = pay(&c, &gw, &key).await;
        assert_eq!(
            r.status, 200,
            "never a 502 or an unknown outcome for a connection closed while idle: {r:?}"
        );
        assert_eq!(r.json()["execution"], i);
        wait_until("the upstream closed it", Duration::from_secs(5), || async {
            up.closed() == i
        })
        .await;
        let again = pay(&c, &gw, &key).await;
        assert!(again.replayed(), "{again:?}");
    }
    assert_eq!(up.answered(), 5, "each key ran once");
    assert_eq!(up.connections(), 5, "a new connection each time");
}

/// One request on a client connection of its own that stays open: `GET /threads` with
/// `X-Client: client`; the status, once the whole answer (its `content-length`) is read.
async fn on_connection(conn: &mut tokio::net::TcpStream, client: usize) -> u16 {
    let request = format!("GET /threads HTTP/1.1\r\nhost: gw\r\nx-client: {client}\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let length: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .map_or(0, |v| v.trim().parse().unwrap());
            if got.len() >= end + 4 + length {
                return head[9..12].parse().unwrap();
            }
        }
        let n = tokio::time::timeout(Duration::from_secs(10), conn.read(&mut chunk))
            .await
            .expect("an answer within 10 s")
            .unwrap();
        assert!(n > 0, "client {client}: the gateway closed the connection");
        got.extend_from_slice(&chunk[..n]);
    }
}

/// The pool keeps its idle connections in a fixed number of lists (`shard::SHARDS`, 8);
/// with more serving threads than that, threads share a list, and each must still take only
/// the connections its own runtime opened (another's socket waits for readiness on another
/// thread). The release binary with 12 serving threads; 12 client connections held open,
/// each opened once the one before was answered, so the gateway seats one on each thread
/// (it hands a new connection to the thread serving the fewest); then 30 rounds of one
/// request on each, all at once. Every upstream connection must have carried the requests
/// of one client connection only, that is of one thread.
#[tokio::test]
async fn past_eight_serving_threads_each_thread_forwards_over_its_own_upstream_connections() {
    const THREADS: usize = 12;
    let up = RawUpstream::start(Ending::KeepAlive).await;
    let db = pg::fresh_database().await;
    let yaml = plain_yaml(&up, &db);
    let server = "header_read_timeout: 2s }";
    assert!(yaml.contains(server), "{yaml}");
    let yaml = yaml.replace(
        server,
        &format!("header_read_timeout: 2s, worker_threads: {THREADS} }}"),
    );
    let gw = GatewayProcess::start(&yaml).await;
    let mut conns = Vec::new();
    for client in 0..THREADS {
        let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        assert_eq!(on_connection(&mut conn, client).await, 200);
        conns.push(conn);
    }
    let all = Arc::new(tokio::sync::Barrier::new(THREADS));
    let mut tasks = Vec::new();
    for (client, mut conn) in conns.into_iter().enumerate() {
        let all = Arc::clone(&all);
        tasks.push(tokio::spawn(async move {
            for round in 0..30 {
                all.wait().await;
                let status = on_connection(&mut conn, client).await;
                assert_eq!(status, 200, "client {client}, round {round}");
            }
            conn
        }));
    }
    let mut conns = Vec::new();
    for task in tasks {
        conns.push(task.await.unwrap());
    }
    assert_eq!(up.answered(), THREADS * 31);
    let by = up.clients_by_connection();
    let shared: Vec<_> = by.iter().filter(|(_, clients)| clients.len() > 1).collect();
    assert!(
        shared.is_empty(),
        "upstream connections that carried the requests of several client connections \
         (several threads): {shared:?} (of {} connections)",
        by.len()
    );
    // The clients were seated one per thread: each kept to connections of its own, and
    // every one of them was answered over some.
    let clients: BTreeSet<String> = by.values().flatten().cloned().collect();
    assert_eq!(clients.len(), THREADS, "{by:?}");
}
