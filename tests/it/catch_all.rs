//! A catch-all that is a real reverse proxy: what a legacy service already serves passes
//! through a plain route. A WebSocket is tunnelled (a real client and server) and holds its
//! upstream slot while open; a keyed request never opens a tunnel; gRPC over h2c passes its
//! body and trailers (and HTTP/1.1 trailers pass when announced); an https upstream is
//! spoken to in h2 by ALPN; `preserve_host` sends the client's host; `Forwarded` names the
//! hop.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use futures_util::{SinkExt, StreamExt};
use http::{HeaderMap, Method, Request, Response, Version};
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::Frame;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::tungstenite::handshake::server::{
    Request as WsRequest, Response as WsResponse,
};

use crate::support::certs::TestPki;
use crate::support::*;

/// A WebSocket server that greets each client, then echoes every text and binary message;
/// it records each handshake's path and headers.
struct WsEcho {
    addr: SocketAddr,
    handshakes: Arc<Mutex<Vec<(String, HeaderMap)>>>,
}

impl WsEcho {
    async fn start() -> WsEcho {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let handshakes = Arc::new(Mutex::new(Vec::new()));
        let seen = Arc::clone(&handshakes);
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let seen = Arc::clone(&seen);
                tokio::spawn(async move {
                    #[allow(clippy::result_large_err)] // the callback's type is tungstenite's
                    let record = move |req: &WsRequest, resp: WsResponse| {
                        let path = req.uri().path().to_string();
                        seen.lock().unwrap().push((path, req.headers().clone()));
                        Ok(resp)
                    };
                    let Ok(mut ws) = tokio_tungstenite::accept_hdr_async(stream, record).await
                    else {
                        return;
                    };
                    if ws.send(Message::text("welcome")).await.is_err() {
                        return;
                    }
                    while let Some(Ok(msg)) = ws.next().await {
                        if (msg.is_text() || msg.is_binary()) && ws.send(msg).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        WsEcho { addr, handshakes }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

/// The next text or binary message, within 10 s.
async fn next_message<S>(ws: &mut S) -> Message
where
    S: futures_util::Stream<Item = Result<Message, tokio_tungstenite::tungstenite::Error>> + Unpin,
{
    tokio::time::timeout(Duration::from_secs(10), ws.next())
        .await
        .expect("a message within 10 s")
        .expect("the stream is open")
        .expect("a message")
}

#[tokio::test]
async fn a_websocket_on_a_plain_route_is_tunnelled_both_ways_and_holds_its_upstream_slot() {
    let ws_up = WsEcho::start().await;
    let db = pg::fresh_database().await;
    // One slot: while the websocket is open, nothing else may be forwarded to the upstream.
    let yaml = config_yaml(&db, &ws_up.url(), "")
        .patch("timeout: 5s }", "timeout: 5s, max_in_flight: 1 }");
    let gw = TestGateway::start(&yaml, &db).await;

    let (mut ws, resp) = tokio_tungstenite::connect_async(format!("ws://{}/chat", gw.addr))
        .await
        .expect("the websocket handshake through the gateway");
    assert_eq!(resp.status(), 101);
    assert_eq!(next_message(&mut ws).await, Message::text("welcome"));
    ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(next_message(&mut ws).await, Message::text("hello"));
    ws.send(Message::binary(vec![0u8, 1, 2, 255]))
        .await
        .unwrap();
    assert_eq!(
        next_message(&mut ws).await,
        Message::binary(vec![0u8, 1, 2, 255])
    );

    let c = client();
    let busy = send(&c, Method::GET, &gw.url("/other"), &[], "").await;
    assert_eq!(
        (busy.status, busy.problem().as_str()),
        (503, "overloaded"),
        "an open tunnel holds the upstream's only slot"
    );

    {
        let handshakes = ws_up.handshakes.lock().unwrap();
        let (path, headers) = &handshakes[0];
        assert_eq!(path, "/chat");
        assert_eq!(headers["upgrade"], "websocket");
        assert_eq!(headers["x-forwarded-for"], "127.0.0.1");
        assert_eq!(
            headers["forwarded"],
            format!("for=127.0.0.1;proto=http;host=\"{}\"", gw.addr).as_str()
        );
    }

    ws.close(None).await.unwrap();
    while ws.next().await.is_some() {}
    drop(ws);
    wait_until(
        "the closed tunnel gives its slot back",
        Duration::from_secs(10),
        || async {
            // The echo server is no HTTP server: any answer but 503 means it was forwarded.
            send(&c, Method::GET, &gw.url("/other"), &[], "")
                .await
                .status
                != 503
        },
    )
    .await;

    // A GET on a keyed route is not keyed (idempotency.methods is POST, PATCH): a tunnel too.
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/pay/socket", gw.addr))
        .await
        .expect("a websocket on a keyed route's unkeyed method");
    assert_eq!(next_message(&mut ws).await, Message::text("welcome"));
    ws.send(Message::text("again")).await.unwrap();
    assert_eq!(next_message(&mut ws).await, Message::text("again"));
}

#[tokio::test]
async fn an_open_tunnel_keeps_its_connections_slot_of_max_connections() {
    let ws_up = WsEcho::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &ws_up.url(), "").patch(
        "server: { shutdown_grace: 5s,",
        "server: { max_connections: 1, shutdown_grace: 5s,",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let (mut ws, _) = tokio_tungstenite::connect_async(format!("ws://{}/chat", gw.addr))
        .await
        .unwrap();
    assert_eq!(next_message(&mut ws).await, Message::text("welcome"));
    // hyper has handed the connection over to the tunnel, which still counts as one.
    let mut other = TcpStream::connect(gw.addr).await.unwrap();
    other
        .write_all(b"GET /other HTTP/1.1\r\nhost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 4096];
    let early = tokio::time::timeout(Duration::from_millis(500), other.read(&mut buf)).await;
    assert!(
        early.is_err(),
        "a new connection waits while the tunnel is open"
    );
    ws.send(Message::text("still here")).await.unwrap();
    assert_eq!(next_message(&mut ws).await, Message::text("still here"));
    ws.close(None).await.unwrap();
    while ws.next().await.is_some() {}
    drop(ws);
    let n = tokio::time::timeout(Duration::from_secs(10), other.read(&mut buf))
        .await
        .expect("served once the tunnel has closed")
        .unwrap();
    assert!(buf[..n].starts_with(b"HTTP/1.1 "), "{:?}", &buf[..n]);
}

#[tokio::test]
async fn a_keyed_request_that_asks_to_upgrade_is_handled_as_keyed_without_the_upgrade() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let c = client();
    let headers = [
        ("idempotency-key", "k1"),
        ("x-account-id", "a"),
        ("connection", "upgrade"),
        ("upgrade", "websocket"),
        ("sec-websocket-version", "13"),
        ("sec-websocket-key", "dGhlIHNhbXBsZSBub25jZQ=="),
    ];
    let first = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!(first.status, 201, "{first:?}");
    let seen = &up.seen()[0];
    assert!(
        !seen.headers.contains_key("upgrade") && !seen.headers.contains_key("connection"),
        "the upgrade is not passed on: {:?}",
        seen.headers
    );
    assert_eq!(seen.headers["idempotency-key"], "k1");
    let retry = send(&c, Method::POST, &gw.url("/pay"), &headers, "x").await;
    assert_eq!((retry.status, &retry.body), (201, &first.body));
    assert!(retry.replayed());
    assert_eq!(up.executions(), 1);
    assert_eq!(
        row_state(&gw, "a", "k1").await.as_deref(),
        Some("completed")
    );
}

/// One request as an h2 upstream saw it.
#[derive(Clone, Debug)]
struct H2Seen {
    version: Version,
    uri: String,
    headers: HeaderMap,
    body: Bytes,
}

/// A gRPC-like server speaking h2c only (or HTTP/1.1 only): it answers each call with its
/// request body, framed as `application/grpc`, streamed, then `grpc-status`/`grpc-message`
/// trailers (announced in a `Trailer` header, as HTTP/1.1 needs).
/// How [`grpc_like_upstream`] speaks.
enum Speaks {
    Http1,
    H2c,
    /// TLS with this config; HTTP/2 when ALPN picked `h2`, else HTTP/1.1.
    Tls(Arc<rustls::ServerConfig>),
}

async fn grpc_like_upstream(speaks: Speaks) -> (SocketAddr, Arc<Mutex<Vec<H2Seen>>>) {
    let tls = match &speaks {
        Speaks::Tls(config) => Some(tokio_rustls::TlsAcceptor::from(Arc::clone(config))),
        _ => None,
    };
    let h2c = matches!(speaks, Speaks::H2c);
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let record = Arc::clone(&seen);
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                continue;
            };
            let record = Arc::clone(&record);
            let svc = service_fn(move |req: Request<hyper::body::Incoming>| {
                let record = Arc::clone(&record);
                async move {
                    let (parts, body) = req.into_parts();
                    let body = body.collect().await.unwrap().to_bytes();
                    record.lock().unwrap().push(H2Seen {
                        version: parts.version,
                        uri: parts.uri.to_string(),
                        headers: parts.headers,
                        body: body.clone(),
                    });
                    let mut trailers = HeaderMap::new();
                    trailers.insert("grpc-status", "0".parse().unwrap());
                    trailers.insert("grpc-message", "echoed".parse().unwrap());
                    let frames: Vec<Result<Frame<Bytes>, Infallible>> =
                        vec![Ok(Frame::data(body)), Ok(Frame::trailers(trailers))];
                    let body = StreamBody::new(futures_util::stream::iter(frames));
                    Ok::<_, Infallible>(
                        Response::builder()
                            .header("content-type", "application/grpc")
                            .header("trailer", "grpc-status, grpc-message")
                            .body(body)
                            .unwrap(),
                    )
                }
            });
            if let Some(tls) = &tls {
                let tls = tls.clone();
                tokio::spawn(async move {
                    let Ok(stream) = tls.accept(stream).await else {
                        return;
                    };
                    let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                    let io = TokioIo::new(stream);
                    if h2 {
                        let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, svc)
                            .await;
                    } else {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, svc)
                            .await;
                    }
                });
                continue;
            }
            let io = TokioIo::new(stream);
            if h2c {
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(io, svc),
                );
            } else {
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(io, svc));
            }
        }
    });
    (addr, seen)
}

#[tokio::test]
async fn grpc_over_h2c_on_a_plain_route_passes_body_and_trailers_and_preserves_the_host() {
    let (up, seen) = grpc_like_upstream(Speaks::H2c).await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &format!("http://{up}"), "").patch(
        "timeout: 5s }",
        "timeout: 5s, http2: true, preserve_host: true }",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let message = grpc_call_through(&gw).await;

    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.version, Version::HTTP_2, "h2c to the upstream");
    assert_eq!(seen.body, message);
    assert_eq!(
        seen.uri, "http://grpc.example:8443/echo.Echo/Say",
        "preserve_host: the client's authority is the :authority sent on"
    );
    assert_eq!(
        seen.headers["te"], "trailers",
        "TE: trailers is kept for gRPC"
    );
    assert_eq!(seen.headers["x-forwarded-host"], "grpc.example:8443");
    assert_eq!(
        seen.headers["forwarded"],
        "for=127.0.0.1;proto=http;host=\"grpc.example:8443\""
    );
}

/// The same call to an `https` upstream with `http2: true`: h2 chosen by ALPN, and the
/// trailers come back over it.
#[tokio::test]
async fn grpc_over_https_with_alpn_h2_passes_body_and_trailers() {
    let pki = TestPki::new();
    let (up, seen) = grpc_like_upstream(Speaks::Tls(pki.server_config())).await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &format!("https://localhost:{}", up.port()), "").patch(
        "timeout: 5s }",
        &format!(
            "timeout: 5s, http2: true, tls: {{ ca: \"{}\" }} }}",
            pki.ca.display()
        ),
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let message = grpc_call_through(&gw).await;
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.version, Version::HTTP_2, "h2 by ALPN to the upstream");
    assert_eq!(seen.body, message);
    assert_eq!(seen.headers["te"], "trailers");
}

/// A gRPC-shaped call (h2c with prior knowledge, `TE: trailers`, a 5-byte message) through
/// the gateway's plain route; asserts the answer, its body and its trailers, and returns the
/// message sent.
async fn grpc_call_through(gw: &TestGateway) -> Bytes {
    let stream = TcpStream::connect(gw.addr).await.unwrap();
    let (mut sender, conn) =
        hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
            .await
            .unwrap();
    tokio::spawn(conn);
    // A gRPC message: uncompressed, 5 bytes long.
    let message = Bytes::from_static(b"\x00\x00\x00\x00\x05hello");
    let req = Request::builder()
        .method(Method::POST)
        .uri("http://grpc.example:8443/echo.Echo/Say")
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(Full::new(message.clone()))
        .unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(10), sender.send_request(req))
        .await
        .expect("an answer within 10 s")
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.version(), Version::HTTP_2);
    assert_eq!(resp.headers()["content-type"], "application/grpc");
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected
        .trailers()
        .cloned()
        .expect("trailers reach the client");
    assert_eq!(collected.to_bytes(), message);
    assert_eq!(trailers["grpc-status"], "0");
    assert_eq!(trailers["grpc-message"], "echoed");
    message
}

#[tokio::test]
async fn an_http1_client_that_accepts_trailers_gets_those_an_http1_upstream_announces() {
    let (up, seen) = grpc_like_upstream(Speaks::Http1).await;
    let db = pg::fresh_database().await;
    let gw = TestGateway::start(&config_yaml(&db, &format!("http://{up}"), ""), &db).await;
    let req = Request::builder()
        .method(Method::POST)
        .uri(gw.url("/echo.Echo/Say"))
        .header("te", "trailers")
        .body(Full::new(Bytes::from_static(b"hello")))
        .unwrap();
    let resp = client().request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["trailer"], "grpc-status, grpc-message");
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected
        .trailers()
        .cloned()
        .expect("trailers reach the client");
    assert_eq!(collected.to_bytes(), "hello");
    assert_eq!(trailers["grpc-status"], "0");
    let seen = seen.lock().unwrap()[0].clone();
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(seen.headers["te"], "trailers");
}

#[tokio::test]
async fn preserve_host_sends_the_clients_host_and_forwarded_is_appended_to() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "")
        .patch("timeout: 5s }", "timeout: 5s, preserve_host: true }");
    let gw = TestGateway::start(&yaml, &db).await;
    let c = client();
    let r = send(
        &c,
        Method::GET,
        &gw.url("/shop"),
        &[
            ("host", "shop.example:8080"),
            ("forwarded", "for=192.0.2.60;proto=https"),
            ("forwarded", "for=\"[2001:db8::1]\""),
        ],
        "",
    )
    .await;
    assert_eq!(r.status, 201);
    let seen = &up.seen()[0];
    assert_eq!(seen.version, Version::HTTP_11);
    assert_eq!(seen.headers["host"], "shop.example:8080");
    assert_eq!(seen.headers.get_all("forwarded").iter().count(), 1);
    assert_eq!(
        seen.headers["forwarded"],
        "for=192.0.2.60;proto=https, for=\"[2001:db8::1]\", for=127.0.0.1;proto=http;host=\"shop.example:8080\""
    );

    // By default the upstream's own authority is sent.
    let up2 = Upstream::start().await;
    let gw2 = TestGateway::with_upstream(&up2, "").await;
    let r = send(
        &c,
        Method::GET,
        &gw2.url("/shop"),
        &[("host", "shop.example")],
        "",
    )
    .await;
    assert_eq!(r.status, 201);
    let seen = &up2.seen()[0];
    assert_eq!(seen.headers["host"], up2.addr.to_string().as_str());
    assert_eq!(seen.headers["x-forwarded-host"], "shop.example");
    assert_eq!(
        seen.headers["forwarded"],
        "for=127.0.0.1;proto=http;host=shop.example"
    );
}

#[tokio::test]
async fn an_https_upstream_with_http2_is_spoken_to_in_h2_by_alpn_and_in_http1_without() {
    let pki = TestPki::new();
    let up = Upstream::start_tls(pki.server_config()).await;
    let c = client();
    for (http2, version) in [(true, Version::HTTP_2), (false, Version::HTTP_11)] {
        let (plain, tls_url) = (up.url(), format!("https://localhost:{}", up.addr.port()));
        let (gw, _db) = TestGateway::on_with(Backend::Postgres, &up, "", |y| {
            y.patch(&plain, &tls_url).patch(
                "timeout: 5s }",
                &format!(
                    "timeout: 5s, http2: {http2}, tls: {{ ca: \"{}\" }} }}",
                    pki.ca.display()
                ),
            )
        })
        .await;
        let before = up.seen().len();
        assert_eq!(
            send(&c, Method::GET, &gw.url("/x"), &[], "").await.status,
            201
        );
        let keyed = post(&c, &gw, "a", &format!("k-{http2}"), "x").await;
        assert_eq!(keyed.status, 201, "{keyed:?}");
        let seen = up.seen();
        assert_eq!(seen.len(), before + 2);
        for s in &seen[before..] {
            assert_eq!(s.version, version, "http2: {http2}");
        }
    }
}
