//! Hostile or broken clients, over raw TCP: slow heads, huge heads, oversized and smuggling
//! bodies, uploads cut short, and the connection limit.

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::support::*;

/// Reads whatever the server sends until it closes the connection (bounded by `limit`).
async fn read_until_closed(s: &mut TcpStream, limit: Duration) -> Vec<u8> {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, s.read_to_end(&mut out))
        .await
        .expect("the server closed the connection in time");
    out
}

fn status_of(raw: &[u8]) -> u16 {
    let text = String::from_utf8_lossy(raw);
    text.split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {text:?}"))
}

#[tokio::test]
async fn a_slow_request_head_is_cut_off_while_others_are_served() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await; // header_read_timeout: 2s
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /pay HTTP/1.1\r\nhost: x\r\n")
        .await
        .unwrap();
    // Meanwhile, a normal client is served.
    let c = client();
    assert_eq!(post(&c, &gw, "a", "k", "x").await.status, 201);
    // The slow one never finishes its head and is disconnected (within a generous bound).
    let got = read_until_closed(&mut slow, Duration::from_secs(10)).await;
    if !got.is_empty() {
        assert_eq!(status_of(&got), 408, "only a timeout answer is acceptable");
    }
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn an_oversized_request_head_is_431() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let big = "v".repeat(100 * 1024);
    let req = format!("GET / HTTP/1.1\r\nhost: x\r\nx-big: {big}\r\n\r\n");
    let _ = s.write_all(req.as_bytes()).await; // the server may close before reading it all
    let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&got), 431);
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_body_announced_over_the_limit_is_refused_before_it_is_sent() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "max_request_body: 1KiB").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    // Announce 10 MB, send only the head: the answer must not wait for the body.
    s.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\nx-account-id: a\r\n\
          content-length: 10000000\r\n\r\n",
    )
    .await
    .unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&got), 413);
    assert!(String::from_utf8_lossy(&got).contains("body-too-large"));
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_chunked_body_over_the_limit_is_counted_and_refused() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "max_request_body: 1KiB").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let mut req = b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: k\r\nx-account-id: a\r\n\
                    transfer-encoding: chunked\r\n\r\n"
        .to_vec();
    for _ in 0..3 {
        req.extend_from_slice(b"200\r\n");
        req.extend_from_slice(&[b'x'; 0x200]);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let _ = s.write_all(&req).await;
    let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&got), 413);
    assert_eq!(up.executions(), 0);
    assert_eq!(row_state(&gw, "a", "k").await, None);
}

/// hyper parses HTTP/1 framing as RFC 9112 section 6.3 says: with both headers,
/// `Transfer-Encoding` wins, `Content-Length` is removed, and the connection is closed after
/// that request, so the bytes behind the chunked body are never parsed as a second request.
/// (The `Content-Length` is gone before the gateway sees the request, so it cannot answer 400.)
#[tokio::test]
async fn content_length_with_transfer_encoding_smuggles_nothing() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    // A classic CL.TE smuggle: the chunked body ends early, the rest is a second request.
    let smuggled = "GET /smuggled HTTP/1.1\r\nhost: x\r\n\r\n";
    let body = format!("0\r\n\r\n{smuggled}");
    for order in ["cl-first", "te-first"] {
        let (h1, h2) = (
            format!("content-length: {}\r\n", body.len()),
            "transfer-encoding: chunked\r\n".to_string(),
        );
        let heads = if order == "cl-first" {
            h1 + &h2
        } else {
            h2 + &h1
        };
        let req = format!("POST /other HTTP/1.1\r\nhost: x\r\n{heads}\r\n{body}");
        let mut s = TcpStream::connect(gw.addr).await.unwrap();
        let _ = s.write_all(req.as_bytes()).await;
        let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
        let text = String::from_utf8_lossy(&got);
        assert_eq!(
            text.matches("HTTP/1.1 ").count(),
            1,
            "{order}: one answer, then close: {text}"
        );
    }
    let seen = up.seen();
    let uris: Vec<&str> = seen.iter().map(|r| r.uri.as_str()).collect();
    assert_eq!(
        uris,
        ["/other", "/other"],
        "each POST reached the upstream once, and no smuggled request did"
    );
    assert!(
        seen.iter().all(|r| r.body.is_empty()),
        "the chunked framing was used"
    );
}

#[tokio::test]
async fn two_different_content_lengths_are_400() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    let _ = s
        .write_all(b"POST /other HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\ncontent-length: 30\r\n\r\nabc")
        .await;
    let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&got), 400);
    assert_eq!(up.executions(), 0);
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_upload_leaves_nothing_behind() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: cut\r\nx-account-id: a\r\n\
          content-length: 100\r\n\r\nonly part of it",
    )
    .await
    .unwrap();
    drop(s);
    // The gateway is still fine, and the cut upload claimed nothing and forwarded nothing.
    let c = client();
    assert_eq!(post(&c, &gw, "a", "other", "x").await.status, 201);
    assert_eq!(row_state(&gw, "a", "cut").await, None);
    assert_eq!(up.executions(), 1);
}

#[tokio::test]
async fn at_max_connections_new_connections_wait_while_existing_ones_keep_working() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    // Three serving threads (thread per core) share the two slots: were each to count its
    // own, a thread with none in use would accept the third connection.
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "server: { shutdown_grace: 5s,",
        "server: { max_connections: 2, worker_threads: 3, shutdown_grace: 5s,",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let req = |key: &str| {
        format!(
            "POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: {key}\r\nx-account-id: a\r\ncontent-length: 1\r\n\r\nx"
        )
    };
    async fn exchange(s: &mut TcpStream, req: &str) -> u16 {
        s.write_all(req.as_bytes()).await.unwrap();
        let mut buf = vec![0u8; 4096];
        let n = s.read(&mut buf).await.unwrap();
        status_of(&buf[..n])
    }
    let mut a = TcpStream::connect(gw.addr).await.unwrap();
    let mut b = TcpStream::connect(gw.addr).await.unwrap();
    assert_eq!(exchange(&mut a, &req("a1")).await, 201);
    assert_eq!(exchange(&mut b, &req("b1")).await, 201);
    // A third connection is not served while both slots are taken.
    let mut third = TcpStream::connect(gw.addr).await.unwrap();
    third.write_all(req("c1").as_bytes()).await.unwrap();
    let mut buf = vec![0u8; 4096];
    let early = tokio::time::timeout(Duration::from_millis(500), third.read(&mut buf)).await;
    assert!(early.is_err(), "the third connection waits for a free slot");
    // The existing connections keep working.
    assert_eq!(exchange(&mut a, &req("a2")).await, 201);
    // Freeing a slot lets the third in.
    drop(b);
    let n = tokio::time::timeout(Duration::from_secs(10), third.read(&mut buf))
        .await
        .expect("served once a slot is free")
        .unwrap();
    assert_eq!(status_of(&buf[..n]), 201);
    assert_eq!(up.executions(), 4);
}

#[tokio::test]
async fn a_keyed_body_slower_than_its_bound_is_408_and_claims_nothing() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let yaml = config_yaml(&db, &up.url(), "").patch(
        "header_read_timeout: 2s }",
        "header_read_timeout: 2s, body_read_timeout: 500ms }",
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let mut s = TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST /pay HTTP/1.1\r\nhost: x\r\nidempotency-key: slow\r\nx-account-id: a\r\n\
          content-length: 100\r\n\r\nthe rest never comes",
    )
    .await
    .unwrap();
    let got = read_until_closed(&mut s, Duration::from_secs(10)).await;
    assert_eq!(status_of(&got), 408);
    assert!(String::from_utf8_lossy(&got).contains("body-timeout"));
    assert_eq!(row_state(&gw, "a", "slow").await, None);
    assert_eq!(up.executions(), 0);
}
