//! Micro-benchmarks of the per-request work that is not I/O: fingerprinting, key and scope
//! extraction, route matching, response header filtering, problem rendering, and a keyed
//! request's whole reading of a 1 MiB body of each hostile shape next to an ordinary one
//! (`body_1MiB`: compare each shape's cost per byte with the ordinary body's).
//! Run: `cargo bench --bench micro`; the bodies alone: `cargo bench --bench micro -- body_1MiB`.

use std::hint::black_box;

use bytes::Bytes;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use http::{HeaderMap, HeaderName, Method, StatusCode};
use idemgate::config::{Config, FingerprintConfig};
use idemgate::fingerprint::fingerprint;
use idemgate::json::{MAX_DEPTH, has_duplicate_member};
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
                let mut json = JsonBody::new(black_box(&body));
                fingerprint(
                    &canonical,
                    &Method::POST,
                    "payments",
                    "/webhooks/payments",
                    &headers,
                    &body,
                    Some(json.get().unwrap()),
                )
                .unwrap()
            })
        });
    }
    g.finish();
}

const MIB: usize = 1024 * 1024;

/// The members a keyed request's body carries for its key and scope (the `payments` route).
const KEYED: &str =
    r#""event_id":"evt_123","account_id":"acct_789","sent_at":"2026-11-29T12:00:00Z""#;

/// A keyed body whose `data` is `piece` repeated (comma-separated) to about `size` bytes.
fn keyed_body(size: usize, piece: impl Fn(usize) -> String) -> Bytes {
    let mut s = format!(r#"{{{KEYED},"data":["#);
    let mut i = 0;
    while s.len() < size {
        if i > 0 {
            s.push(',');
        }
        s.push_str(&piece(i));
        i += 1;
    }
    s.push_str("]}");
    Bytes::from(s)
}

/// 1 MiB bodies: an ordinary one, and one of each shape that costs a parser the most per
/// byte (names to check, levels to enter, escapes to decode, numbers to keep as text).
fn hostile_bodies() -> Vec<(&'static str, Bytes)> {
    // One object of ~70,000 members: `"m0000001":1,`.
    let mut wide = format!("{{{KEYED}");
    let mut i = 0;
    while wide.len() < MIB {
        wide.push_str(&format!(r#","m{i:07}":{}"#, i % 10));
        i += 1;
    }
    wide.push('}');
    // The same names in a scrambled order (the canonical form sorts them).
    let mut wide_unsorted = format!("{{{KEYED}");
    let mut i: u64 = 0;
    while wide_unsorted.len() < MIB {
        let scrambled = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
        wide_unsorted.push_str(&format!(r#","m{scrambled:07}_{i}":{}"#, i % 10));
        i += 1;
    }
    wide_unsorted.push('}');
    // The same, every name spelled with escapes (each name is decoded and owned).
    let mut wide_escaped = format!("{{{KEYED}");
    let mut i = 0;
    while wide_escaped.len() < MIB {
        wide_escaped.push_str(&format!(r#","\u006d{i:07}\n":{}"#, i % 10));
        i += 1;
    }
    wide_escaped.push('}');
    // Blocks as deep as a body may go: arrays and objects in turn, the body's own two
    // levels (its object and `data`) included.
    let deep_piece = |_| {
        let depth = MAX_DEPTH - 2;
        let mut open = String::new();
        let mut close = String::new();
        for d in 0..depth {
            if d % 2 == 0 {
                open.push('[');
                close.push(']');
            } else {
                open.push_str(r#"{"a":"#);
                close.push('}');
            }
        }
        format!("{open}1{}", close.chars().rev().collect::<String>())
    };
    // Strings of 512 runs of every kind of escape (JSON text, not Rust's).
    let escapes_piece = |_| {
        format!(
            r#""{}""#,
            r#"\n\t\"\\\/\u00e9\ud83d\ude00\u0000"#.repeat(512)
        )
    };
    let numbers = |i: usize| match i % 4 {
        0 => format!("{}", i),
        1 => format!("-{i}.{i}e-7"),
        2 => "0.30000000000000001".to_string(),
        _ => format!("1234567890123456789012345678{i}"),
    };
    // Names as short as they come unique, out of order: `"3fa2c":1`, twice as many names
    // to a byte as the wide objects above.
    let mut short = format!("{{{KEYED}");
    let mut i: u64 = 0;
    while short.len() < MIB {
        // Multiplying by an odd number permutes the low 20 bits: no name repeats.
        let scrambled = i.wrapping_mul(0x9e37_79b9_7f4a_7c15) & 0xf_ffff;
        short.push_str(&format!(r#","{scrambled:x}":{}"#, i % 10));
        i += 1;
    }
    short.push('}');
    // Arrays only, as deep as a body may go: a container to every byte or so.
    let arrays_piece = |_| {
        let depth = MAX_DEPTH - 2;
        format!("{}1{}", "[".repeat(depth), "]".repeat(depth))
    };
    vec![
        ("plain", json_body(MIB)),
        ("wide_object", Bytes::from(wide)),
        ("wide_object_unsorted", Bytes::from(wide_unsorted)),
        ("wide_object_escaped_names", Bytes::from(wide_escaped)),
        ("wide_object_short_names", Bytes::from(short)),
        ("deep_nesting", keyed_body(MIB, deep_piece)),
        ("deep_arrays", keyed_body(MIB, arrays_piece)),
        ("escaped_strings", keyed_body(MIB, escapes_piece)),
        ("numbers", keyed_body(MIB, numbers)),
    ]
}

/// A keyed request's reading of its body, as the gateway does it: key and scope from the
/// body (one parse, which refuses repeated member names), then the canonical fingerprint;
/// and the repeated-member check alone (a raw fingerprint's, after a replay cache miss).
fn bodies(c: &mut Criterion) {
    let config = Config::from_yaml(CONFIG).unwrap();
    let mut idem = config.routes[3].idempotency.clone().unwrap();
    idem.fingerprint.json_canonical = true;
    idem.fingerprint.json_ignore = vec!["/sent_at".into()];
    let mut headers = HeaderMap::new();
    headers.insert("content-type", "application/json".parse().unwrap());
    let mut g = c.benchmark_group("body_1MiB");
    for (shape, body) in hostile_bodies() {
        g.throughput(Throughput::Bytes(body.len() as u64));
        g.bench_function(format!("keyed/{shape}"), |b| {
            b.iter(|| {
                let mut json = JsonBody::new(black_box(&body));
                let keyed = extract(&idem, &headers, &mut json).unwrap().unwrap();
                let parsed = json.get().unwrap();
                let fp = fingerprint(
                    &idem.fingerprint,
                    &Method::POST,
                    "payments",
                    "/webhooks/payments",
                    &headers,
                    &body,
                    Some(parsed),
                )
                .unwrap();
                (keyed, fp)
            })
        });
        g.bench_function(format!("check/{shape}"), |b| {
            b.iter(|| assert_eq!(has_duplicate_member(black_box(&body)), Some(false)))
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

criterion_group!(benches, fingerprints, keys_and_routes, responses, bodies);
criterion_main!(benches);
