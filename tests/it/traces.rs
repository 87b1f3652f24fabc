//! Traces over OTLP (src/telemetry/), end to end against the release binary: real OTLP
//! receivers started here (HTTP/protobuf, and gRPC served by hyper) decode what the gateway
//! exports; the test upstream shows the `traceparent` the gateway sent on.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idemgate::key::KeyId;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message as _;
use tokio::net::TcpListener;

use crate::support::process::GatewayProcess;
use crate::support::*;

/// A span as a receiver got it, with its resource's `service.name`.
#[derive(Clone, Debug)]
struct Got {
    service: String,
    span: Span,
}

impl Got {
    fn attr(&self, key: &str) -> Option<String> {
        self.span
            .attributes
            .iter()
            .find(|kv| kv.key == key)
            .and_then(|kv| kv.value.as_ref()?.value.as_ref())
            .map(|v| match v {
                Value::StringValue(s) => s.clone(),
                Value::IntValue(i) => i.to_string(),
                other => format!("{other:?}"),
            })
    }

    fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    fn parent_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a receiver has got so far.
#[derive(Clone, Default)]
struct Received(Arc<Mutex<Vec<Got>>>);

impl Received {
    fn take_request(&self, req: ExportTraceServiceRequest) {
        let mut got = self.0.lock().unwrap();
        for rs in req.resource_spans {
            let service = rs
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
                    Value::StringValue(s) => Some(s.clone()),
                    _ => None,
                })
                .unwrap_or_default();
            for ss in rs.scope_spans {
                for span in ss.spans {
                    got.push(Got {
                        service: service.clone(),
                        span,
                    });
                }
            }
        }
    }

    fn spans(&self) -> Vec<Got> {
        self.0.lock().unwrap().clone()
    }

    fn of_trace(&self, trace_id: &str) -> Vec<Got> {
        self.spans()
            .into_iter()
            .filter(|g| g.trace_id() == trace_id)
            .collect()
    }

    /// Waits (at most 20 s: batches leave after 1 s) until `n` spans of `trace_id` arrived.
    async fn wait_trace(&self, trace_id: &str, n: usize) -> Vec<Got> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let got = self.of_trace(trace_id);
            if got.len() >= n {
                return got;
            }
            assert!(
                Instant::now() < deadline,
                "timed out waiting for {n} spans of trace {trace_id}; got {got:#?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// An OTLP/HTTP receiver on 127.0.0.1 (protobuf bodies on any path; it records the path).
async fn http_receiver() -> (SocketAddr, Received, Arc<Mutex<Vec<String>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Received::default();
    let paths = Arc::new(Mutex::new(Vec::new()));
    let (r, p) = (received.clone(), Arc::clone(&paths));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (r, p) = (r.clone(), Arc::clone(&p));
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let (r, p) = (r.clone(), Arc::clone(&p));
                    async move {
                        p.lock().unwrap().push(req.uri().path().to_string());
                        let body = req.into_body().collect().await?.to_bytes();
                        let status = match ExportTraceServiceRequest::decode(body) {
                            Ok(decoded) => {
                                r.take_request(decoded);
                                200
                            }
                            Err(_) => 400,
                        };
                        let answer = ExportTraceServiceResponse::default().encode_to_vec();
                        Ok::<_, hyper::Error>(
                            Response::builder()
                                .status(status)
                                .header("content-type", "application/x-protobuf")
                                .body(Full::new(Bytes::from(answer)))
                                .unwrap(),
                        )
                    }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, received, paths)
}

struct GrpcReceiver(Received);

#[tonic::async_trait]
impl TraceService for GrpcReceiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        self.0.take_request(request.into_inner());
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// An OTLP/gRPC receiver on 127.0.0.1: the generated trace service, served over h2 by hyper.
async fn grpc_receiver() -> (SocketAddr, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Received::default();
    let server = TraceServiceServer::new(GrpcReceiver(received.clone()));
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let server = server.clone();
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                    let mut server = server.clone();
                    async move { tower_service::Service::call(&mut server, req).await }
                });
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (addr, received)
}

const CLIENT_TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CLIENT_SPAN: &str = "00f067aa0ba902b7";

/// `traceparent` as W3C writes it: (trace id, parent id, flags).
fn traceparent(value: &str) -> (String, String, String) {
    let parts: Vec<&str> = value.split('-').collect();
    assert_eq!(parts.len(), 4, "traceparent {value}");
    assert_eq!(parts[0], "00");
    (parts[1].into(), parts[2].into(), parts[3].into())
}

/// A keyed request and its replay, each under the client's trace, arrive as server spans
/// whose parent is the client's span, with the route, the outcome (`forwarded`, then
/// `replayed`), the status, the method and the key's id (never the key); the first has
/// `claim`, `forward` and `record` children; the upstream got a `traceparent` of the same
/// trace whose parent is the gateway's `forward` span, and the client's `tracestate`. With
/// `sampling_ratio: 0.0`, the client's sampled flag is still followed: a request it did not
/// sample, and one without a parent, export nothing, and the upstream is told so.
#[tokio::test]
async fn keyed_requests_and_their_replays_arrive_as_spans_with_the_clients_trace() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let (collector, received, paths) = http_receiver().await;
    let yaml = format!(
        "{}telemetry:\n  service_name: idemgate-test\n  sampling_ratio: 0.0\n  otlp: {{ endpoint: \"http://{collector}\" }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let client = client();
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let headers = [
        ("idempotency-key", "k-trace-secret"),
        ("x-account-id", "acct-traced"),
        ("content-type", "application/json"),
        ("traceparent", parent.as_str()),
        ("tracestate", "vendor=opaque"),
    ];
    let first = send(&client, Method::POST, &gw.url("/pay"), &headers, "{}").await;
    assert_eq!(first.status, 201);
    let replay = send(&client, Method::POST, &gw.url("/pay"), &headers, "{}").await;
    assert_eq!(replay.status, 201);
    assert!(replay.replayed());

    // Not sampled by the client, and no parent at all (ratio 0): nothing exported.
    let unsampled_trace = "0af7651916cd43dd8448eb211c80319c";
    let unsampled = format!("00-{unsampled_trace}-b7ad6b7169203331-00");
    let r = send(
        &client,
        Method::GET,
        &gw.url("/other"),
        &[("traceparent", unsampled.as_str())],
        "",
    )
    .await;
    assert_eq!(r.status, 201);
    let r = send(&client, Method::GET, &gw.url("/orphan"), &[], "").await;
    assert_eq!(r.status, 201);
    // A sampled one last: once its span is in, every earlier one would be (one queue, in
    // order).
    let last_trace = "11111111111111111111111111111111";
    let last = format!("00-{last_trace}-2222222222222222-01");
    let r = send(
        &client,
        Method::GET,
        &gw.url("/last"),
        &[("traceparent", last.as_str())],
        "",
    )
    .await;
    assert_eq!(r.status, 201);

    // The first request's server span and three children, the replay's server span and its
    // claim; all in once the last request's spans are.
    received.wait_trace(last_trace, 2).await;
    let spans = received.wait_trace(CLIENT_TRACE, 6).await;
    let servers: Vec<&Got> = spans.iter().filter(|g| g.span.kind == 2).collect();
    assert_eq!(servers.len(), 2, "two server spans: {spans:#?}");
    let key_id = KeyId::of(&scoped("acct-traced"), "k-trace-secret");
    for (server, outcome) in servers.iter().zip(["forwarded", "replayed"]) {
        assert_eq!(server.service, "idemgate-test");
        assert_eq!(
            server.parent_id(),
            CLIENT_SPAN,
            "the client's span is the parent"
        );
        assert_eq!(server.span.name, "POST payments");
        assert_eq!(server.attr("idemgate.route").as_deref(), Some("payments"));
        assert_eq!(server.attr("idemgate.outcome").as_deref(), Some(outcome));
        assert_eq!(
            server.attr("http.response.status_code").as_deref(),
            Some("201")
        );
        assert_eq!(server.attr("http.request.method").as_deref(), Some("POST"));
        assert_eq!(
            server.attr("idemgate.key_id").as_deref(),
            Some(key_id.as_str())
        );
        let printed = format!("{:?}", server.span);
        assert!(
            !printed.contains("k-trace-secret") && !printed.contains("acct-traced"),
            "no raw key or scope in a span: {printed}"
        );
    }
    let first_server = servers[0];
    let child = |name: &str| {
        spans
            .iter()
            .find(|g| g.span.name == name && g.parent_id() == first_server.span_id())
            .unwrap_or_else(|| panic!("no {name} span under the server span: {spans:#?}"))
    };
    let forward = child("forward");
    child("claim");
    child("record");

    let seen = up.seen();
    assert_eq!(
        seen.len(),
        4,
        "one execution of the keyed request, three plain"
    );
    let sent = seen[0].headers["traceparent"].to_str().unwrap();
    let (trace, parent_id, flags) = traceparent(sent);
    assert_eq!(trace, CLIENT_TRACE);
    assert_eq!(
        parent_id,
        forward.span_id(),
        "the forward span is the parent"
    );
    assert_eq!(flags, "01");
    assert_eq!(seen[0].headers["tracestate"], "vendor=opaque");

    let (trace, parent_id, flags) = traceparent(seen[1].headers["traceparent"].to_str().unwrap());
    assert_eq!(
        (trace.as_str(), flags.as_str()),
        (unsampled_trace, "00"),
        "not sampled, said so upstream"
    );
    assert_ne!(
        parent_id, "b7ad6b7169203331",
        "the gateway's span is the parent"
    );
    let (_, _, flags) = traceparent(seen[2].headers["traceparent"].to_str().unwrap());
    assert_eq!(flags, "00", "ratio 0: a new trace is not sampled");
    assert!(received.of_trace(unsampled_trace).is_empty());
    let sampled: std::collections::HashSet<String> =
        received.spans().iter().map(Got::trace_id).collect();
    assert_eq!(
        sampled.len(),
        2,
        "only the client-sampled traces: {sampled:?}"
    );
    assert!(
        paths.lock().unwrap().iter().all(|p| p == "/v1/traces"),
        "the endpoint without a path gets /v1/traces"
    );
    // The access line names the same key id.
    assert!(gw.log_text().contains(key_id.as_str()));
    gw.kill();
}

/// `protocol: grpc` delivers spans to a gRPC collector.
#[tokio::test]
async fn the_grpc_protocol_delivers_spans() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let (collector, received) = grpc_receiver().await;
    let yaml = format!(
        "{}telemetry:\n  otlp: {{ endpoint: \"http://{collector}\", protocol: grpc }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = send(
        &client(),
        Method::GET,
        &gw.url("/plain"),
        &[("traceparent", parent.as_str())],
        "",
    )
    .await;
    assert_eq!(r.status, 201);
    let spans = received.wait_trace(CLIENT_TRACE, 2).await;
    let server = spans
        .iter()
        .find(|g| g.span.kind == 2)
        .expect("a server span");
    assert_eq!(server.service, "idemgate");
    assert_eq!(server.attr("idemgate.route").as_deref(), Some("rest"));
    assert_eq!(server.attr("idemgate.outcome").as_deref(), Some("proxied"));
    assert_eq!(server.parent_id(), CLIENT_SPAN);
    let forward = spans
        .iter()
        .find(|g| g.span.name == "forward")
        .expect("a forward span");
    assert_eq!(forward.parent_id(), server.span_id());
    let (_, parent_id, _) = traceparent(up.seen()[0].headers["traceparent"].to_str().unwrap());
    assert_eq!(parent_id, forward.span_id());
    gw.kill();
}

/// SIGTERM exports the spans still queued before the process exits (the batch would
/// otherwise wait a second for company).
#[tokio::test]
async fn spans_still_queued_are_exported_at_shutdown() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let (collector, received, _) = http_receiver().await;
    let yaml = format!(
        "{}telemetry:\n  otlp: {{ endpoint: \"http://{collector}\" }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let mut gw = GatewayProcess::start(&yaml).await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = send(
        &client(),
        Method::GET,
        &gw.url("/last-words"),
        &[("traceparent", parent.as_str())],
        "",
    )
    .await;
    assert_eq!(r.status, 201);
    gw.terminate();
    let exited = gw.wait_exit(Duration::from_secs(15)).await;
    assert!(exited, "a clean exit:\n{}", gw.log_text());
    let got = received.of_trace(CLIENT_TRACE);
    assert!(
        got.iter().any(|g| g.span.kind == 2),
        "the server span was exported before the exit: {got:#?}"
    );
}

/// A duplicate that arrives while the first attempt is upstream waits in a `wait` span under
/// its server span, which says `coalesced`; the first attempt's says `forwarded`. (A gateway
/// in this process: `App::build` reads `telemetry` as `serve` does.)
#[tokio::test]
async fn a_duplicate_in_flight_waits_in_a_wait_span() {
    let (up, gate) = Upstream::start_gated().await;
    let db = pg::fresh_database().await;
    let (collector, received, _) = http_receiver().await;
    let yaml = format!(
        "{}telemetry:\n  otlp: {{ endpoint: \"http://{collector}\" }}\n",
        config_yaml(&db, &up.url(), "")
    );
    let gw = TestGateway::start(&yaml, &db).await;
    let first = in_flight(&gw.url("/pay"), &up, "acct-w", "k-wait", "{}").await;
    let claims = || {
        let text = gw.gateway.render_metrics(idemgate::metrics::Format::Text);
        metric(&text, "idemgate_store_latency_seconds_count{op=\"claim\"}")
    };
    let before = claims();
    let second = spawn_post(&client(), &gw.url("/pay"), "acct-w", "k-wait", "{}");
    // Its claim found the key in flight: from there it waits for the first's answer.
    wait_until(
        "the duplicate has claimed",
        Duration::from_secs(10),
        || async { claims() > before },
    )
    .await;
    gate.open();
    assert_eq!(first.await.unwrap().status, 201);
    let dup = second.await.unwrap();
    assert_eq!(dup.status, 201);
    let deadline = Instant::now() + Duration::from_secs(20);
    let (server, wait) = loop {
        let spans = received.spans();
        let coalesced = spans
            .iter()
            .find(|g| g.attr("idemgate.outcome").as_deref() == Some("coalesced"))
            .cloned();
        if let Some(server) = coalesced
            && let Some(wait) = spans
                .iter()
                .find(|g| g.span.name == "wait" && g.parent_id() == server.span_id())
        {
            break (server, wait.clone());
        }
        assert!(
            Instant::now() < deadline,
            "no coalesced server span with a wait child: {spans:#?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(wait.trace_id(), server.trace_id());
    assert!(
        received
            .spans()
            .iter()
            .any(|g| g.attr("idemgate.outcome").as_deref() == Some("forwarded")),
        "the first attempt's server span"
    );
    gw.shutdown().await;
}

/// The dropped-span counter of a gateway's `/metrics`.
async fn spans_dropped(admin: SocketAddr) -> f64 {
    let r = send(
        &client(),
        Method::GET,
        &format!("http://{admin}/metrics"),
        &[],
        "",
    )
    .await;
    metric(
        &String::from_utf8_lossy(&r.body),
        "idemgate_trace_spans_dropped_total ",
    )
}

/// A collector that is down (a closed port), or one that accepts connections and never
/// answers, costs requests nothing: they all succeed at once, and the spans that could not
/// go are counted as dropped.
#[tokio::test]
async fn a_collector_down_or_silent_costs_requests_nothing_and_drops_are_counted() {
    let up = Upstream::start().await;
    let db = pg::fresh_database().await;
    let (_refusing, closed) = refused_port();
    // Accepts, never reads nor answers.
    let silent = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let held = Arc::new(Mutex::new(Vec::new()));
    let keep = Arc::clone(&held);
    tokio::spawn(async move {
        while let Ok((s, _)) = silent.accept().await {
            keep.lock().unwrap().push(s);
        }
    });
    for endpoint in [
        format!("http://127.0.0.1:{closed}"),
        format!("http://{silent_addr}"),
    ] {
        let yaml = format!(
            "{}admin: {{ listen: \"127.0.0.1:0\" }}\ntelemetry:\n  otlp: {{ endpoint: \"{endpoint}\", timeout: 30s, max_queue_spans: 4 }}\n",
            config_yaml(&db, &up.url(), "")
        );
        let mut gw = GatewayProcess::start(&yaml).await;
        let admin = gw.admin.expect("an admin listener");
        let client = client();
        // Requests go on, each answered at once (the export timeout is 30 s), until the
        // spans that could not go are counted: the failed export's (closed port), or those
        // the full queue refused while the export hangs (silent collector).
        let deadline = Instant::now() + Duration::from_secs(25);
        for i in 0.. {
            let started = Instant::now();
            let key = format!("k-down-{i}-{}", endpoint.len());
            let r = post_to(&client, &gw.url("/pay"), "acct-down", &key, "{}").await;
            assert_eq!(r.status, 201);
            let took = started.elapsed();
            assert!(
                took < Duration::from_secs(5),
                "{endpoint}: a request took {took:?}"
            );
            if i % 10 == 9 && spans_dropped(admin).await > 0.0 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{endpoint}: no span counted as dropped after {i} requests"
            );
        }
        gw.kill();
    }
    drop(held);
}

/// Without telemetry, the client's `traceparent` and `tracestate` reach the upstream
/// untouched.
#[tokio::test]
async fn without_telemetry_the_clients_trace_headers_pass_untouched() {
    let up = Upstream::start().await;
    let gw = TestGateway::with_upstream(&up, "").await;
    let parent = format!("00-{CLIENT_TRACE}-{CLIENT_SPAN}-01");
    let r = send(
        &client(),
        Method::POST,
        &gw.url("/pay"),
        &[
            ("idempotency-key", "k-untraced"),
            ("x-account-id", "acct"),
            ("traceparent", parent.as_str()),
            ("tracestate", "vendor=opaque"),
        ],
        "{}",
    )
    .await;
    assert_eq!(r.status, 201);
    let seen = up.seen();
    assert_eq!(seen[0].headers["traceparent"], parent.as_str());
    assert_eq!(seen[0].headers["tracestate"], "vendor=opaque");
    gw.shutdown().await;
}

/// `OTEL_TRACES_SAMPLER` chooses the sampler, as the OpenTelemetry SDKs read it: `always_on`
/// samples a trace whose client said "not sampled" (a parent-based sampler, the default,
/// would follow the client); `parentbased_always_off` starts no trace of its own but follows a
/// client that samples. The release binary, the variables in its environment.
#[tokio::test]
async fn the_standard_sampler_variable_chooses_the_sampler() {
    let up = Upstream::start().await;
    let (collector, received, _) = http_receiver().await;
    let yaml = |db: &str| {
        format!(
            "{}telemetry:\n  otlp: {{ endpoint: \"http://{collector}\" }}\n",
            config_yaml(db, &up.url(), "")
        )
    };
    let get = async |gw: &GatewayProcess, path: &str, parent: Option<&str>| {
        let headers: Vec<(&str, &str)> = parent.map(|p| ("traceparent", p)).into_iter().collect();
        let r = send(&client(), Method::GET, &gw.url(path), &headers, "").await;
        assert_eq!(r.status, 201, "{path}");
    };

    let db = pg::fresh_database().await;
    let gw =
        GatewayProcess::start_with_env(&yaml(&db), &[("OTEL_TRACES_SAMPLER", "always_on")]).await;
    let unsampled_trace = "0af7651916cd43dd8448eb211c80319c";
    let unsampled = format!("00-{unsampled_trace}-b7ad6b7169203331-00");
    get(&gw, "/not-sampled-by-the-client", Some(&unsampled)).await;
    let got = received.wait_trace(unsampled_trace, 1).await;
    assert!(
        got.iter().any(|g| g.span.kind == 2),
        "always_on exported the server span of a trace its client did not sample: {got:#?}"
    );
    drop(gw);

    let db = pg::fresh_database().await;
    let gw = GatewayProcess::start_with_env(
        &yaml(&db),
        &[("OTEL_TRACES_SAMPLER", "parentbased_always_off")],
    )
    .await;
    let before = received.spans().len();
    get(&gw, "/no-parent", None).await;
    // A sampled one last: once its spans are in, the first request's would be (one queue,
    // in order).
    let last_trace = "11111111111111111111111111111111";
    let last = format!("00-{last_trace}-2222222222222222-01");
    get(&gw, "/sampled-by-the-client", Some(&last)).await;
    let followed = received.wait_trace(last_trace, 1).await;
    let all = received.spans();
    let others: Vec<&Got> = all[before..]
        .iter()
        // (A late span of the first gateway's trace is not one.)
        .filter(|g| g.trace_id() != last_trace && g.trace_id() != unsampled_trace)
        .collect();
    assert!(
        others.is_empty(),
        "parentbased_always_off started a trace of its own: {others:#?}"
    );
    assert!(followed.iter().all(|g| g.trace_id() == last_trace));
}
