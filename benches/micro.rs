//! Micro-benchmarks of the per-request work that is not I/O: fingerprinting, key and scope
//! extraction, route matching, response header filtering, problem rendering.
//! Run: `cargo bench --bench micro`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderName, Method, StatusCode};
use idemgate::config::{Config, FingerprintConfig};
use idemgate::fingerprint::fingerprint;
use idemgate::key::{JsonBody, extract};
use idemgate::problem::GatewayError;
use idemgate::replay::StoredResponse;

fn json_body(size: usize) -> Bytes {
    let mut items = Vec::new();
    let mut len = 0;
    let mut i = 0;
    while len < size {
        let item = format!(
            r#"{{"id":{i},"sku":"sku-{i:06}","qty":{},"price":"{}.99"}}"#,
            i % 7,
            i % 100
        );
        len += item.len() + 1;
        items.push(item);
        i += 1;
    }
    Bytes::from(format!(
        r#"{{"event_id":"evt_123","payment_id":"pay_456","account_id":"acct_789","amount":1000,"sent_at":"2026-11-29T12:00:00Z","items":[{}]}}"#,
        items.join(",")
    ))
}

const CONFIG: &str = r#"
store: { postgres: { url: "postgres://u@localhost/db" } }
upstreams: { app: { url: "http://127.0.0.1:9000" } }
routes:
  - { name: health, match: { path: /healthz, methods: [GET] }, upstream: app }
  - { name: users, match: { path_prefix: /users/ }, upstream: app }
  - { name: orders, match: { path_prefix: /orders/, methods: [POST, PUT] }, upstream: app }
  - name: payments
    match: { path: /webhooks/payments, methods: [POST] }
    upstream: app
    idempotency:
      key: [ { header: Idempotency-Key }, { json: /event_id } ]
      scope: { json: /account_id }
  - { name: rest, match: { path_prefix: / }, upstream: app }
"#;

fn fingerprints(c: &mut Criterion) {
    let raw = FingerprintConfig {
        headers: vec![http::header::CONTENT_TYPE],
        ..Default::default()
    };
    let canonical = FingerprintConfig {
        json_canonical: true,
        json_ignore: vec!["/sent_at".into()],
        ..raw.clone()
    };
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let mut g = c.benchmark_group("fingerprint");
    for size in [1024, 64 * 1024] {
        let body = json_body(size);
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(format!("raw/{}KiB", size / 1024), |b| {
            b.iter(|| {
                fingerprint(
                    &raw,
                    &Method::POST,
                    "payments",
                    "/webhooks/payments",
                    &headers,
                    black_box(&body),
                    None,
                )
                .unwrap()
            })
        });
        g.bench_function(format!("canonical_json/{}KiB", size / 1024), |b| {
            b.iter(|| {
                // Parsing is part of the cost of the canonical form.
                let parsed: serde_json::Value = serde_json::from_slice(black_box(&body)).unwrap();
                fingerprint(
                    &canonical,
                    &Method::POST,
                    "payments",
                    "/webhooks/payments",
                    &headers,
                    &body,
                    Some(&parsed),
                )
                .unwrap()
            })
        });
    }
    g.finish();
}

fn keys_and_routes(c: &mut Criterion) {
    let config = Config::from_yaml(CONFIG).unwrap();
    let idem = config.routes[3].idempotency.clone().unwrap();
    let body = json_body(1024);
    let mut with_header = HeaderMap::new();
    with_header.insert("idempotency-key", "\"evt_123\"".parse().unwrap());
    c.bench_function("key_scope/header_key+json_scope", |b| {
        b.iter(|| {
            let mut json = JsonBody::new(&body);
            extract(&idem, black_box(&with_header), &mut json).unwrap()
        })
    });
    c.bench_function("key_scope/json_key+json_scope", |b| {
        b.iter(|| {
            let mut json = JsonBody::new(&body);
            extract(&idem, black_box(&HeaderMap::new()), &mut json).unwrap()
        })
    });
    c.bench_function("route/match_4th_of_5", |b| {
        b.iter(|| {
            config
                .route_for(black_box(&Method::POST), black_box("/webhooks/payments"))
                .unwrap()
        })
    });
}

fn responses(c: &mut Criterion) {
    let mut h = HeaderMap::new();
    for (k, v) in [
        ("content-type", "application/json"),
        ("content-length", "123"),
        ("connection", "keep-alive, x-trace"),
        ("x-trace", "abc"),
        ("keep-alive", "timeout=5"),
        ("set-cookie", "s=1"),
        ("etag", "\"v1\""),
        ("location", "/payments/1"),
        ("cache-control", "no-store"),
        ("x-request-id", "r-1"),
        ("date", "Sun, 29 Nov 2026 12:00:00 GMT"),
    ] {
        h.append(k, v.parse().unwrap());
    }
    let allow: Vec<HeaderName> = idemgate::config::defaults::REPLAY_HEADERS
        .iter()
        .map(|n| HeaderName::from_static(n))
        .collect();
    let body = Bytes::from_static(b"{\"ok\":true}");
    c.bench_function("response/clean+capture_headers", |b| {
        b.iter(|| {
            let mut headers = black_box(&h).clone();
            idemgate::forward::clean_response_headers(&mut headers);
            StoredResponse::capture(StatusCode::CREATED, &headers, &allow, body.clone())
        })
    });
    c.bench_function("problem/render", |b| {
        b.iter(|| {
            black_box(GatewayError::FingerprintMismatch)
                .problem()
                .into_response()
        })
    });
}

criterion_group!(benches, fingerprints, keys_and_routes, responses);
criterion_main!(benches);
