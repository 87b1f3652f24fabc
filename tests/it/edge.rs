//! The edge, on the release binary: no spelling of a keyed request reaches the upstream
//! unkeyed (methods in another case, lenient path readings, `CONNECT`, HTTP/1.1 without
//! `Host`, `Upgrade: h2c`), and the memory bound counts what is held (bodies reserved as
//! they arrive, answers held until written, waiters and replays without an upstream slot).
//! docs/guarantees.md has a row for each.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// A keyed `webhooks` route above a plain catch-all, on Postgres, with `extra` server lines.
fn config(db: &str, upstream: &str, server: &str, idem: &str, up: &str) -> String {
    format!(
        r#"
listen: 127.0.0.1:0
server: {{ shutdown_grace: 5s, header_read_timeout: 2s{server} }}
store:
{store}
upstreams:
  app: {{ url: "{upstream}", connect_timeout: 200ms, timeout: 5s{up} }}
routes:
  - name: webhooks
    match: {{ path_prefix: /webhooks/ }}
    upstream: app
    idempotency:
      scope: {{ header: X-Account-Id }}
      {idem}
  - name: rest
    match: {{ path_prefix: / }}
    upstream: app
"#,
        store = pg_store_block(db)
    )
}

async fn gateway(up: &Upstream, server: &str, idem: &str, upstream: &str) -> GatewayProcess {
    let db = pg::fresh_database().await;
    GatewayProcess::start(&config(&db, &up.url(), server, idem, upstream)).await
}

/// Sends raw bytes on a new connection and reads the answer until the gateway closes it
/// (every request here says `connection: close`, or is refused with a close).
async fn raw(gw: &GatewayProcess, request: &[u8]) -> (u16, String) {
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(request).await.unwrap();
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut out))
        .await
        .expect("the gateway answered and closed within 10 s")
        .unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {text:?}"));
    (status, text)
}

/// A keyed request line and head for `path` with `method`, on a connection that closes.
fn keyed(method: &str, path: &str, key: &str) -> Vec<u8> {
    format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nx-account-id: a\r\n\
         content-type: application/json\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{{}}"
    )
    .into_bytes()
}

#[tokio::test]
async fn a_standard_method_in_another_case_is_400_and_connect_is_405() {
    let up = Upstream::start().await;
    let gw = gateway(&up, "", "", "").await;
    assert_eq!(raw(&gw, &keyed("POST", "/webhooks/pay", "k1")).await.0, 201);
    for method in ["post", "Post", "pOST"] {
        let (status, text) = raw(&gw, &keyed(method, "/webhooks/pay", "k1")).await;
        assert_eq!(status, 400, "{method}: {text}");
        assert!(
            text.contains("urn:idemgate:problem:method-invalid"),
            "{text}"
        );
    }
    let (status, text) = raw(
        &gw,
        b"CONNECT example.com:443 HTTP/1.1\r\nhost: example.com:443\r\n\r\n",
    )
    .await;
    assert_eq!(status, 405, "{text}");
    assert!(text.contains("method-not-allowed"), "{text}");
    // A method that is no standard one in any case is the upstream's to judge.
    let (status, _) = raw(
        &gw,
        b"PURGE /cache HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 201);
    assert_eq!(up.executions(), 2, "one keyed POST and the PURGE");
}

#[tokio::test]
async fn options_asterisk_is_forwarded_in_asterisk_form() {
    let up = Upstream::start().await;
    let gw = gateway(&up, "", "", "").await;
    let (status, text) = raw(
        &gw,
        b"OPTIONS * HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 201, "{text}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].method, "OPTIONS");
    assert_eq!(seen[0].uri, "*");
}

#[tokio::test]
async fn a_path_that_reads_as_the_keyed_route_to_a_lenient_backend_is_400() {
    let up = Upstream::start().await;
    let gw = gateway(&up, "", "", "").await;
    assert_eq!(
        raw(&gw, &keyed("POST", "/webhooks/payments", "k")).await.0,
        201
    );
    for path in [
        "/webhooks%2Fpayments",
        "/webhooks%2fpayments",
        "/webhooks%5Cpayments",
        "/webhooks\\payments",
        "/webhooks;v=1/payments",
        "/WEBHOOKS/payments",
        "/Webhooks/payments",
        "/x/..%2Fwebhooks%2Fpayments",
    ] {
        let (status, text) = raw(&gw, &keyed("POST", path, "k")).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("urn:idemgate:problem:path-invalid"), "{text}");
        assert!(text.contains("'webhooks'"), "names the route: {text}");
    }
    assert_eq!(up.executions(), 1, "no spelling was forwarded");
    // A path resembling no keyed route passes as it is: an encoded slash inside an id.
    let (status, _) = raw(&gw, &keyed("POST", "/files/a%2Fb", "k")).await;
    assert_eq!(status, 201);
    let (status, _) = raw(&gw, &keyed("GET", "/Webhooks/payments", "k")).await;
    assert_eq!(
        status, 201,
        "GET is not keyed on the route: no spelling around a key"
    );
    let seen = up.seen();
    assert_eq!(seen.len(), 3);
    assert_eq!(seen[1].uri, "/files/a%2Fb");
}

#[tokio::test]
async fn http11_without_host_is_400_and_a_clients_forwarded_host_never_passes_alone() {
    let up = Upstream::start().await;
    let gw = gateway(&up, "", "", "").await;
    let (status, text) = raw(&gw, b"GET /a HTTP/1.1\r\nconnection: close\r\n\r\n").await;
    assert_eq!(status, 400, "{text}");
    assert!(text.contains("host-missing"), "{text}");
    assert_eq!(up.executions(), 0);
    // HTTP/1.0 may omit Host: then no X-Forwarded-Host reaches the upstream, not even the
    // client's own.
    let (status, _) = raw(
        &gw,
        b"GET /a HTTP/1.0\r\nx-forwarded-host: evil.example\r\n\r\n",
    )
    .await;
    assert_eq!(status, 201);
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    assert!(
        seen[0].headers.get("x-forwarded-host").is_none(),
        "{:?}",
        seen[0].headers
    );
}

#[tokio::test]
async fn an_h2c_upgrade_is_never_tunnelled_nor_its_settings_forwarded() {
    let up = Upstream::start().await;
    let gw = gateway(&up, "", "", "").await;
    let (status, text) = raw(
        &gw,
        b"GET /a HTTP/1.1\r\nhost: x\r\nconnection: Upgrade, HTTP2-Settings, close\r\n\
          upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQAAP__\r\n\r\n",
    )
    .await;
    assert_eq!(status, 201, "an ordinary answer, no 101: {text}");
    let seen = up.seen();
    assert_eq!(seen.len(), 1);
    for name in ["upgrade", "http2-settings"] {
        assert!(
            seen[0].headers.get(name).is_none(),
            "{name}: {:?}",
            seen[0].headers
        );
    }
}

/// The gauge of held bytes on a live gateway.
async fn buffered(gw: &GatewayProcess) -> f64 {
    let text = reqwest_metrics(gw).await;
    metric(&text, "idemgate_buffered_bytes ")
}

async fn reqwest_metrics(gw: &GatewayProcess) -> String {
    let admin = gw.admin.expect("the config has an admin listener");
    let reply = send(
        &client(),
        http::Method::GET,
        &format!("http://{admin}/metrics"),
        &[],
        "",
    )
    .await;
    String::from_utf8_lossy(&reply.body).to_string()
}

const ADMIN: &str = "\nadmin: { listen: \"127.0.0.1:0\" }\n";

/// A gateway with an admin listener, `server` and `idem` lines added, in front of an upstream
/// whose every answer is `size` bytes of `byte` (returned, to compare).
async fn big_answers(
    byte: u8,
    size: usize,
    server: &str,
    idem: &str,
) -> (bytes::Bytes, Upstream, GatewayProcess) {
    let big = bytes::Bytes::from(vec![byte; size]);
    let up = Upstream::start_with(Behavior {
        body: Some(big.clone()),
        ..Behavior::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let gw = GatewayProcess::start(&(config(&db, &up.url(), server, idem, "") + ADMIN)).await;
    (big, up, gw)
}

#[tokio::test]
async fn declared_but_unsent_bodies_hold_nothing_and_refuse_no_one() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config(
        &db,
        &up.url(),
        ", max_buffered_bytes: 2MiB, body_read_timeout: 30s",
        "",
        "",
    ) + ADMIN;
    let gw = GatewayProcess::start(&yaml).await;
    // Two clients each declare a 1 MiB body and send one byte of it.
    let mut stalled = Vec::new();
    for key in ["s1", "s2"] {
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        s.write_all(
            format!(
                "POST /webhooks/pay HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\n\
                 x-account-id: a\r\ncontent-type: application/json\r\n\
                 content-length: 1048576\r\n\r\n{{"
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        stalled.push(s);
    }
    // Once both are being read, the bound still admits everyone else.
    // Each holds the one byte it sent, no more.
    wait_until(
        "both stalled bodies are being read",
        Duration::from_secs(10),
        || async { buffered(&gw).await >= 2.0 },
    )
    .await;
    assert_eq!(buffered(&gw).await, 2.0, "a byte sent holds a byte");
    let c = client();
    for key in ["a", "b", "c"] {
        let reply = post_to(&c, &gw.url("/webhooks/pay"), "a", key, "{}").await;
        assert_eq!(reply.status, 201, "{key}: {}", reply.problem());
    }
    // A declared length over the route's limit is still refused at once.
    let (status, _) = raw(
        &gw,
        b"POST /webhooks/pay HTTP/1.1\r\nhost: x\r\nidempotency-key: big\r\nx-account-id: a\r\n\
          content-length: 2000000\r\n\r\n",
    )
    .await;
    assert_eq!(status, 413);
    assert_eq!(up.executions(), 3);
    drop(stalled);
}

#[tokio::test]
async fn waiters_and_replays_take_no_upstream_slot() {
    let up = Upstream::start_with(Behavior {
        delay: Duration::from_millis(800),
        ..Behavior::default()
    })
    .await;
    let db = pg::fresh_database().await;
    let yaml = config(
        &db,
        &up.url(),
        "",
        "wait_timeout: 10s",
        ", max_in_flight: 3",
    );
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let url = gw.url("/webhooks/pay");
    let tasks: Vec<_> = (0..6)
        .map(|_| {
            let (c, url) = (c.clone(), url.clone());
            tokio::spawn(async move { post_to(&c, &url, "a", "same", "{}").await })
        })
        .collect();
    let mut replies = Vec::new();
    for t in tasks {
        replies.push(t.await.unwrap());
    }
    for r in &replies {
        assert!(
            (200..300).contains(&r.status),
            "every duplicate gets the one answer: {} {}",
            r.status,
            r.problem()
        );
    }
    assert_eq!(up.executions(), 1);
    // Three slow forwards of other keys fill the upstream's slots; a replay still answers.
    let busy: Vec<_> = (0..3)
        .map(|i| {
            let c = c.clone();
            let url = url.clone();
            tokio::spawn(async move { post_to(&c, &url, "a", &format!("busy{i}"), "{}").await })
        })
        .collect();
    wait_until(
        "three forwards in flight",
        Duration::from_secs(10),
        || async { up.executions() == 4 },
    )
    .await;
    let replay = post_to(&c, &url, "a", "same", "{}").await;
    assert!(replay.replayed(), "{} {}", replay.status, replay.problem());
    // A fourth new key is refused: the slots bound forwards.
    let refused = post_to(&c, &url, "a", "fourth", "{}").await;
    assert_eq!(refused.status, 503, "{}", refused.problem());
    assert!(refused.problem().contains("overloaded"));
    for b in busy {
        assert_eq!(b.await.unwrap().status, 201);
    }
    // The refused key was released, not held: its retry is forwarded.
    let retried = post_to(&c, &url, "a", "fourth", "{}").await;
    assert_eq!(retried.status, 201, "{}", retried.problem());
    assert_eq!(up.executions(), 5);
}

#[tokio::test]
async fn an_answer_is_counted_until_it_is_written() {
    // A 16 MiB answer: far more than a connection's socket buffers and write queue take.
    let (big, up, gw) = big_answers(
        b'x',
        16 * 1024 * 1024,
        ", max_buffered_bytes: 24MiB",
        "max_stored_response: 16MiB",
    )
    .await;
    let c = client();
    let url = gw.url("/webhooks/pay");
    let first = post_to(&c, &url, "a", "big", "{}").await;
    assert_eq!(first.status, 201);
    assert_eq!(first.body.len(), big.len());
    // A client that asks for the replay and does not read it holds it.
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(&keyed("POST", "/webhooks/pay", "big"))
        .await
        .unwrap();
    wait_until(
        "the unread replay is counted",
        Duration::from_secs(10),
        || async { buffered(&gw).await >= 8.0 * 1024.0 * 1024.0 },
    )
    .await;
    // A second replay would pass the bound: refused, nothing held for it.
    let refused = post_to(&c, &url, "a", "big", "{}").await;
    assert_eq!(refused.status, 503, "{}", refused.problem());
    assert!(refused.problem().contains("overloaded"));
    // Read the first one whole: its bytes are given back, and replays answer again.
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut out))
        .await
        .expect("the held replay is written")
        .unwrap();
    assert!(out.len() > big.len());
    wait_until(
        "the written replay is given back",
        Duration::from_secs(10),
        || async { buffered(&gw).await == 0.0 },
    )
    .await;
    let again = post_to(&c, &url, "a", "big", "{}").await;
    assert!(again.replayed());
    assert_eq!(again.body.len(), big.len());
    assert_eq!(up.executions(), 1);
}

/// An h2c connection with prior knowledge to the gateway (hyper's client; it keeps to the
/// stream limit the gateway's SETTINGS announce, queueing the streams past it).
async fn h2_connection(
    gw: &GatewayProcess,
) -> hyper::client::conn::http2::SendRequest<http_body_util::Full<bytes::Bytes>> {
    let stream = TcpStream::connect(gw.addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(
        hyper_util::rt::TokioExecutor::new(),
        hyper_util::rt::TokioIo::new(stream),
    )
    .await
    .unwrap();
    tokio::spawn(conn);
    sender
}

/// A keyed h2 request for `key` on the `webhooks` route.
fn h2_keyed(gw: &GatewayProcess, key: &str) -> http::Request<http_body_util::Full<bytes::Bytes>> {
    http::Request::builder()
        .method(http::Method::POST)
        .uri(gw.url("/webhooks/pay"))
        .header("idempotency-key", key)
        .header("x-account-id", "a")
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(b"{}")))
        .unwrap()
}

/// `server.h2_max_concurrent_streams` bounds the requests one h2 connection has open at once;
/// another connection is not held back by it.
#[tokio::test]
async fn one_h2_connection_has_at_most_its_stream_limit_open() {
    let gate = Gate::new();
    let up = Upstream::start_with(Behavior {
        gate: Some(gate.clone()),
        ..Behavior::default()
    })
    .await;
    let gw = gateway(&up, ", h2_max_concurrent_streams: 2", "", "").await;
    let sender = h2_connection(&gw).await;
    let on_one: Vec<_> = (0..3)
        .map(|i| {
            let mut sender = sender.clone();
            let req = h2_keyed(&gw, &format!("s{i}"));
            tokio::spawn(async move { sender.send_request(req).await })
        })
        .collect();
    gate.wait_arrived(2).await;
    // A request on a connection of its own arrives while the first connection's third waits.
    let mut other = h2_connection(&gw).await;
    let req = h2_keyed(&gw, "other");
    let alone = tokio::spawn(async move { other.send_request(req).await });
    wait_until(
        "the other connection's request arrives",
        Duration::from_secs(10),
        || async {
            up.seen().iter().any(|s| {
                s.headers
                    .get("idempotency-key")
                    .is_some_and(|k| k == "other")
            })
        },
    )
    .await;
    // Sent after the first connection's three, it arrived; the third of those did not.
    assert_eq!(
        gate.arrived(),
        3,
        "the third stream of the first connection waits"
    );
    gate.open();
    // A stream past the limit either waited at the client (which had the gateway's SETTINGS)
    // or was refused by the gateway unprocessed (REFUSED_STREAM: the client sent it before
    // the SETTINGS arrived); either way, never executed beyond the limit.
    let mut answered = 0;
    for answer in on_one.into_iter().chain([alone]) {
        match answer.await.unwrap() {
            Ok(answer) => {
                assert_eq!(answer.status(), 201);
                answered += 1;
            }
            Err(e) => assert!(format!("{e:?}").contains("REFUSED_STREAM"), "{e:?}"),
        }
    }
    assert!(answered >= 3, "all but a refused one answered");
    assert_eq!(up.executions(), answered);
}

/// The memory bound counts answers waiting on h2 streams the client does not read, as on
/// HTTP/1.1: past it a replay is refused, and the bytes come back once the streams are read.
#[tokio::test]
async fn unread_h2_replays_are_counted_until_they_are_written() {
    use http_body_util::BodyExt as _;
    let (big, up, gw) = big_answers(
        b'z',
        8 * 1024 * 1024,
        ", max_buffered_bytes: 20MiB",
        "max_stored_response: 8MiB",
    )
    .await;
    let mut sender = h2_connection(&gw).await;
    let first = sender.send_request(h2_keyed(&gw, "big")).await.unwrap();
    assert_eq!(first.status(), 201);
    assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), big);
    // Two replays on one connection, their bodies left unread (h2 flow control holds them
    // in the gateway): both counted.
    let mut unread = Vec::new();
    for _ in 0..2 {
        let replay = sender.send_request(h2_keyed(&gw, "big")).await.unwrap();
        assert_eq!(replay.status(), 201);
        assert_eq!(replay.headers()["idempotent-replayed"], "true");
        unread.push(replay);
    }
    wait_until(
        "the unread replays are counted",
        Duration::from_secs(10),
        || async { buffered(&gw).await >= 14.0 * 1024.0 * 1024.0 },
    )
    .await;
    // A third would pass the bound: refused, nothing executed.
    let refused = sender.send_request(h2_keyed(&gw, "big")).await.unwrap();
    assert_eq!(refused.status(), 503);
    // Read: the bytes come back, and replays answer again.
    for replay in unread {
        assert_eq!(replay.into_body().collect().await.unwrap().to_bytes(), big);
    }
    wait_until(
        "the read replays are given back",
        Duration::from_secs(10),
        || async { buffered(&gw).await == 0.0 },
    )
    .await;
    let again = sender.send_request(h2_keyed(&gw, "big")).await.unwrap();
    assert_eq!(again.status(), 201);
    assert_eq!(up.executions(), 1);
}

/// A first answer too large to store is passed on as it streams; what the gateway read of it
/// before it knew (the store limit's worth) waits in memory for a slow client, and is
/// counted until the answer is written.
#[tokio::test]
async fn an_answer_too_large_to_store_is_counted_until_it_is_written() {
    let (big, up, gw) = big_answers(b'y', 16 * 1024 * 1024, "", "max_stored_response: 1MiB").await;
    // A client that sends a new key and does not read the answer.
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(&keyed("POST", "/webhooks/pay", "too-big"))
        .await
        .unwrap();
    // The answer has started (its status line is here): it is passed on, and what it holds
    // stays counted while the rest waits for the client (16 MiB: more than the sockets take).
    let mut status = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), slow.read_exact(&mut status))
        .await
        .expect("the answer starts")
        .unwrap();
    assert_eq!(&status, b"HTTP/1.1 201");
    let held = buffered(&gw).await;
    assert!(held > 1024.0 * 1024.0, "the head is counted: {held}");
    let mut out = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut out))
        .await
        .expect("the answer is written")
        .unwrap();
    assert!(out.len() > big.len());
    wait_until(
        "the written answer is given back",
        Duration::from_secs(10),
        || async { buffered(&gw).await == 0.0 },
    )
    .await;
    assert_eq!(up.executions(), 1);
}

/// An HTTP/1.1 upstream whose keep-alive timeout is 1 s, like gunicorn's 2 s or Node.js's
/// 5 s but shorter, with the race at its close made certain: a request that arrives on a
/// connection idle for 1 s or more is read and the connection closed without an answer (as
/// when the server's timer fires as the request is written). Counts the requests answered
/// and those dropped.
async fn closing_upstream() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
    std::sync::Arc<std::sync::atomic::AtomicUsize>,
) {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (answered, dropped) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let counts = (Arc::clone(&answered), Arc::clone(&dropped));
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let (answered, dropped) = (Arc::clone(&counts.0), Arc::clone(&counts.1));
            tokio::spawn(async move {
                let mut idle_since = tokio::time::Instant::now();
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                loop {
                    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
                        match s.read(&mut chunk).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => buf.extend_from_slice(&chunk[..n]),
                        }
                    }
                    buf.clear();
                    if idle_since.elapsed() >= Duration::from_secs(1) {
                        dropped.fetch_add(1, Ordering::SeqCst);
                        return;
                    }
                    let n = answered.fetch_add(1, Ordering::SeqCst) + 1;
                    let body = format!("{{\"n\":{n}}}");
                    let head = format!(
                        "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\n\
                         content-length: {}\r\n\r\n{body}",
                        body.len()
                    );
                    if s.write_all(head.as_bytes()).await.is_err() {
                        return;
                    }
                    idle_since = tokio::time::Instant::now();
                }
            });
        }
    });
    (addr, answered, dropped)
}

#[tokio::test]
async fn an_upstream_that_closes_idle_connections_after_a_second_loses_no_request() {
    use std::sync::atomic::Ordering;
    let (addr, answered, dropped) = closing_upstream().await;
    let db = pg::fresh_database().await;
    // The default idle_timeout, a single serving thread (one pool list to reuse from).
    let yaml = config(
        &db,
        &format!("http://{addr}"),
        ", worker_threads: 1",
        "on_unknown_outcome: hold",
        "",
    );
    let gw = GatewayProcess::start(&yaml).await;
    let c = client();
    let url = gw.url("/webhooks/pay");
    for i in 0..4 {
        let reply = post_to(&c, &url, "a", &format!("k{i}"), "{}").await;
        assert_eq!(reply.status, 201, "request {i}: {}", reply.problem());
        // Idle past the upstream's keep-alive: the pooled connection must not be reused.
        tokio::time::sleep(Duration::from_millis(1200)).await;
    }
    assert_eq!(answered.load(Ordering::SeqCst), 4);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        0,
        "a request written on a closing connection"
    );
}

#[tokio::test]
async fn a_stderr_nobody_reads_never_stalls_a_request() {
    // Every request fails at the upstream (a refused port): a WARN access line each, which
    // is written out at once. stderr is a pipe that is never read: it fills after a few
    // hundred lines, and whoever writes to it then blocks.
    let (_refusing, port) = refused_port();
    let db = pg::fresh_database().await;
    let listen = idemgate::process::free_port().unwrap();
    let yaml = config(
        &db,
        &format!("http://127.0.0.1:{port}"),
        ", worker_threads: 1",
        "",
        "",
    )
    .replace(
        "listen: 127.0.0.1:0",
        &format!("listen: 127.0.0.1:{listen}"),
    );
    let dir = std::env::temp_dir().join(format!("idemgate-stderr-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("gateway.yaml");
    std::fs::write(&config, yaml).unwrap();
    let mut child = tokio::process::Command::new(crate::support::bin::idemgate())
        .args(["serve", "--config"])
        .arg(&config)
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let _unread = child.stderr.take();
    let addr = format!("127.0.0.1:{listen}");
    wait_until("the gateway listens", Duration::from_secs(30), || async {
        TcpStream::connect(&addr).await.is_ok()
    })
    .await;
    let c = client();
    let url = format!("http://{addr}/other");
    // About 2,000 lines of a few hundred bytes: far past a pipe's 64 KiB.
    for i in 0..2000 {
        let reply = tokio::time::timeout(
            Duration::from_secs(5),
            try_send(&c, http::Method::GET, &url, &[], ""),
        )
        .await
        .unwrap_or_else(|_| panic!("request {i} stalled behind the log"))
        .unwrap();
        assert_eq!(reply.status, 502, "request {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A body of 4 MiB nested as deep as the gateway reads (128), many times over.
fn deep_body() -> String {
    let one = format!("{}{}", "[".repeat(127), "]".repeat(127));
    let mut body = String::from("[");
    while body.len() < 4 * 1024 * 1024 - one.len() - 2 {
        body.push_str(&one);
        body.push(',');
    }
    body.push_str(&one);
    body.push(']');
    body
}

#[tokio::test]
async fn a_large_body_of_a_bad_shape_holds_no_serving_thread() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config(
        &db,
        &up.url(),
        ", worker_threads: 1, max_buffered_bytes: 64MiB",
        "max_request_body: 8MiB\n      fingerprint: { json_canonical: true }",
        "",
    ) + ADMIN;
    let gw = GatewayProcess::start(&yaml).await;
    let body = deep_body();
    let c = client();
    let url = gw.url("/webhooks/pay");
    // Four such bodies, read whole by the gateway before any is keyed.
    let big: Vec<_> = (0..4)
        .map(|i| {
            let (c, url, body) = (c.clone(), url.clone(), body.clone());
            tokio::spawn(async move { post_to(&c, &url, "a", &format!("deep{i}"), &body).await })
        })
        .collect();
    let held = 4.0 * body.len() as f64;
    wait_until(
        "the four bodies are read",
        Duration::from_secs(30),
        || async { buffered(&gw).await >= held },
    )
    .await;
    // The one serving thread answers plain requests while they are keyed...
    for i in 0..5 {
        let reply = send(&c, http::Method::GET, &gw.url("/status"), &[], "").await;
        assert_eq!(reply.status, 201, "plain request {i}");
    }
    // ...before the keying of four 4 MiB bodies could have ended on it.
    assert!(
        big.iter().any(|t| !t.is_finished()),
        "the plain requests waited for the bodies"
    );
    for t in big {
        assert_eq!(t.await.unwrap().status, 201);
    }
}
