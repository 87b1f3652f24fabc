//! Following one request: its request id and its access log line.
//!
//! - **Request id.** A client's `X-Request-Id` is kept when it is 1-128 bytes of visible
//!   ASCII; otherwise one is made (a random per-process prefix and a counter: unique across
//!   instances without coordination). It is forwarded to the upstream, returned to the
//!   client, written in the access line and put in problem bodies (`request_id`).
//! - **Access line.** One event per request, target `idemgate::access`, written when the
//!   response body is done with (sent, or dropped by a client that hung up), like nginx's
//!   `$request_time`: method, path, protocol, client IP, route, outcome, status, bytes in and
//!   out, upstream and total time in integer microseconds, the key id (never the raw key,
//!   scope, body or credentials), and the request id. Server errors are logged at `warn`,
//!   the rest at `info`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Method, Version};
use hyper::body::{Frame, SizeHint};
use tokio::time::Instant;

use crate::forward::{Body, BoxError};

pub const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// Longest client request id kept.
pub const MAX_REQUEST_ID: usize = 128;

/// The client's request id if it is acceptable, else a new one.
pub fn request_id(headers: &HeaderMap) -> HeaderValue {
    let mut given = headers.get_all(&X_REQUEST_ID).iter();
    if let (Some(v), None) = (given.next(), given.next())
        && !v.is_empty()
        && v.len() <= MAX_REQUEST_ID
        && v.as_bytes().iter().all(|b| (0x21..=0x7e).contains(b))
    {
        return v.clone();
    }
    new_request_id()
}

/// A new request id: 16 hex digits fixed per process, a dash, a counter in hex.
pub fn new_request_id() -> HeaderValue {
    static PREFIX: OnceLock<String> = OnceLock::new();
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = PREFIX.get_or_init(|| {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let seed = format!(
            "{}:{}:{:?}",
            std::process::id(),
            now.as_nanos(),
            std::thread::current().id()
        );
        crate::fingerprint::hex(&crate::fingerprint::sha256(seed.as_bytes())[..8])
    });
    // Each thread takes its numbers a block at a time: the runtime's workers do not pass one
    // counter's cache line between their cores at every request. Ids stay unique per process;
    // they rise per thread, not across threads.
    const BLOCK: u64 = 1024;
    thread_local! {
        static NEXT: std::cell::Cell<(u64, u64)> = const { std::cell::Cell::new((0, 0)) };
    }
    let n = NEXT.with(|next| {
        let (mut n, mut end) = next.get();
        if n == end {
            n = COUNTER.fetch_add(BLOCK, Ordering::Relaxed);
            end = n + BLOCK;
        }
        next.set((n + 1, end));
        n
    });
    // 16 hex digits, a dash and at most 16 more, written in place (no `format!` per request).
    let mut id = [0u8; 33];
    id[..16].copy_from_slice(prefix.as_bytes());
    id[16] = b'-';
    let digits = (64 - n.leading_zeros()).div_ceil(4).max(1) as usize;
    for i in 0..digits {
        id[16 + digits - i] = b"0123456789abcdef"[((n >> (4 * i)) & 0xf) as usize];
    }
    // Owned by one allocation that every clone shares (the id goes to the upstream, the
    // client and the access line): copied into a `Vec`, the first clone would allocate again.
    let id = Bytes::from_owner(id).slice(..17 + digits);
    HeaderValue::from_maybe_shared(id).expect("hex and a dash are a valid header value")
}

/// What the access log line and the request counter say about one request, filled in as
/// the gateway serves it (the gateway's stages write it; `Gateway::handle` turns it into an
/// [`AccessLine`] and the route's counters).
pub(crate) struct RequestLog {
    /// The matched route's metric handles (and name).
    pub(crate) route: Option<Arc<crate::metrics::RouteHandles>>,
    /// The matched route's index in the routing snapshot the request was served with.
    pub(crate) index: Option<usize>,
    pub(crate) outcome: &'static str,
    pub(crate) key_id: Option<crate::key::KeyId>,
    pub(crate) upstream: Option<Duration>,
    /// Request body bytes when known (a keyed body read whole).
    pub(crate) bytes_in: Option<u64>,
    /// Counts a streamed request body of unknown length.
    pub(crate) counted_in: Option<Arc<std::sync::atomic::AtomicU64>>,
    /// A passed-on answer's admission, held by the response body until it is done with.
    pub(crate) held: Option<crate::limits::Admission>,
    /// The request's trace when traces are on (`telemetry`): its forwards are child spans.
    pub(crate) trace: Option<crate::telemetry::RequestTrace>,
}

impl RequestLog {
    pub(crate) fn new(outcome: &'static str) -> RequestLog {
        RequestLog {
            route: None,
            index: None,
            outcome,
            key_id: None,
            upstream: None,
            bytes_in: None,
            counted_in: None,
            held: None,
            trace: None,
        }
    }
}

/// What the access line says about one request; filled in as the request goes.
pub struct AccessLine {
    pub method: Method,
    /// The request's target as it came (the line has its path). A clone shares the bytes
    /// the request was read into.
    pub uri: http::Uri,
    pub version: Version,
    pub client_ip: std::net::IpAddr,
    pub request_id: HeaderValue,
    pub started: Instant,
    /// The matched route's handles (its name is the line's `route`; `""` when none
    /// matched); its request duration is observed in them when the line is written.
    pub route: Arc<crate::metrics::RouteHandles>,
    /// Where the request was counted (`RouteHandles::request`).
    pub counted: crate::metrics::Counted,
    pub outcome: &'static str,
    pub status: u16,
    pub key_id: Option<String>,
    pub upstream: Option<Duration>,
    /// Request body bytes: known from the body read or `Content-Length`, else counted.
    pub bytes_in: Option<u64>,
    pub error: Option<String>,
    /// The request's trace (traces on): its server span ends with the line.
    pub trace: Option<crate::telemetry::RequestTrace>,
}

fn protocol(v: Version) -> &'static str {
    match v {
        Version::HTTP_09 => "HTTP/0.9",
        Version::HTTP_10 => "HTTP/1.0",
        Version::HTTP_11 => "HTTP/1.1",
        Version::HTTP_2 => "HTTP/2",
        Version::HTTP_3 => "HTTP/3",
        _ => "HTTP",
    }
}

impl AccessLine {
    /// Writes the line (see the module docs).
    fn emit(&self, bytes_out: u64, counted_in: Option<&AtomicU64>) {
        let route = &*self.route.name;
        if let Some(trace) = &self.trace {
            trace.end(route, self.outcome, self.status, self.key_id.as_deref());
        }
        let key = self.key_id.as_deref().unwrap_or("");
        let upstream_us = self.upstream.map_or(-1, |d| d.as_micros() as i64);
        let took = self.started.elapsed();
        self.route.finished(self.counted, self.outcome, took);
        let duration_us = took.as_micros() as u64;
        let bytes_in = self
            .bytes_in
            .or_else(|| counted_in.map(|c| c.load(Ordering::Relaxed)))
            .unwrap_or(0);
        let request_id = self.request_id.to_str().unwrap_or("");
        let error = self.error.as_deref().unwrap_or("");
        let (method, path, proto, client, status) = (
            self.method.as_str(),
            self.uri.path(),
            protocol(self.version),
            self.client_ip,
            self.status,
        );
        let warn = status >= 500;
        if let Some(format) = crate::logging::own_format() {
            // Straight into the log buffer in the subscriber's layout (logging.rs), if its
            // filter lets the line through.
            let enabled = if warn {
                tracing::enabled!(target: "idemgate::access", tracing::Level::WARN)
            } else {
                tracing::enabled!(target: "idemgate::access", tracing::Level::INFO)
            };
            if enabled {
                use crate::logging::{Event, Value, field_name};
                let mut line = Event::new(format, warn, "idemgate::access", "request");
                line.field(&field_name!("method"), Value::Plain(method))
                    .field(&field_name!("path"), Value::Str(path))
                    .field(&field_name!("proto"), Value::Plain(proto))
                    .field(&field_name!("client"), Value::Ip(client))
                    .field(&field_name!("route"), Value::Str(route))
                    .field(&field_name!("outcome"), Value::Plain(self.outcome))
                    .field(&field_name!("status"), Value::U64(u64::from(status)))
                    .field(&field_name!("bytes_in"), Value::U64(bytes_in))
                    .field(&field_name!("bytes_out"), Value::U64(bytes_out))
                    .field(&field_name!("upstream_us"), Value::I64(upstream_us))
                    .field(&field_name!("duration_us"), Value::U64(duration_us))
                    .field(&field_name!("key"), Value::Plain(key))
                    .field(&field_name!("request_id"), Value::Str(request_id))
                    .field(&field_name!("error"), Value::Str(error));
                line.write();
            }
        } else if warn {
            tracing::warn!(
                target: "idemgate::access", method, path, proto, %client, route,
                outcome = self.outcome, status, bytes_in, bytes_out, upstream_us, duration_us,
                key, request_id, error, "request"
            );
        } else {
            tracing::info!(
                target: "idemgate::access", method, path, proto, %client, route,
                outcome = self.outcome, status, bytes_in, bytes_out, upstream_us, duration_us,
                key, request_id, error, "request"
            );
        }
    }
}

/// A response body that counts what it yields and writes the access line when it is done
/// with (its end, or its drop when a client hangs up mid-body). It also holds a passed-on
/// answer's admission (`limits.rs`), released when the body is dropped.
pub struct Logged {
    body: Body,
    line: Option<AccessLine>,
    bytes_out: u64,
    /// Counts a request body of unknown length as it is read (plain routes).
    counted_in: Option<Arc<AtomicU64>>,
    _held: Option<crate::limits::Admission>,
}

impl Logged {
    pub fn new(
        body: Body,
        line: AccessLine,
        counted_in: Option<Arc<AtomicU64>>,
        held: Option<crate::limits::Admission>,
    ) -> Logged {
        Logged {
            body,
            line: Some(line),
            bytes_out: 0,
            counted_in,
            _held: held,
        }
    }

    fn finish(&mut self) {
        if let Some(line) = self.line.take() {
            line.emit(self.bytes_out, self.counted_in.as_deref());
        }
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        self.finish();
    }
}

impl hyper::body::Body for Logged {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        match &polled {
            std::task::Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    self.bytes_out += data.len() as u64;
                }
                if self.body.is_end_stream() {
                    self.finish();
                }
            }
            std::task::Poll::Ready(None) | std::task::Poll::Ready(Some(Err(_))) => self.finish(),
            std::task::Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// A request body that counts its bytes into a shared counter (for the access line).
pub struct Counted<B> {
    pub body: B,
    pub count: Arc<AtomicU64>,
}

impl<B> hyper::body::Body for Counted<B>
where
    B: hyper::body::Body<Data = Bytes> + Unpin,
{
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
        if let std::task::Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.count.fetch_add(data.len() as u64, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clients_request_id_is_kept_only_when_it_is_sane() {
        let mut h = HeaderMap::new();
        h.insert(X_REQUEST_ID, "abc-123".parse().unwrap());
        assert_eq!(request_id(&h), "abc-123");
        h.insert(X_REQUEST_ID, "a b".parse().unwrap());
        assert_ne!(request_id(&h), "a b", "a space is not visible ASCII");
        h.insert(X_REQUEST_ID, "x".repeat(129).parse().unwrap());
        let made = request_id(&h);
        assert!(
            made.len() < 129 && made.as_bytes()[16] == b'-',
            "too long: a new one"
        );
        h.insert(X_REQUEST_ID, "one".parse().unwrap());
        h.append(X_REQUEST_ID, "two".parse().unwrap());
        assert_ne!(request_id(&h), "one", "two ids: a new one");
    }

    #[test]
    fn new_request_ids_differ() {
        assert_ne!(new_request_id(), new_request_id());
    }

    #[test]
    fn request_ids_taken_on_many_threads_at_once_are_all_distinct() {
        // More ids per thread than one block holds, so every thread takes several blocks.
        let threads: Vec<_> = (0..8)
            .map(|_| std::thread::spawn(|| (0..3000).map(|_| new_request_id()).collect::<Vec<_>>()))
            .collect();
        let mut all = std::collections::HashSet::new();
        for t in threads {
            for id in t.join().unwrap() {
                assert!(all.insert(id.clone()), "{id:?} given twice");
            }
        }
        assert_eq!(all.len(), 8 * 3000);
    }

    #[test]
    fn a_new_request_id_is_the_prefix_a_dash_and_the_counter_in_hex() {
        let a = new_request_id();
        let b = new_request_id();
        let (pa, na) = a.to_str().unwrap().split_once('-').unwrap();
        let (pb, nb) = b.to_str().unwrap().split_once('-').unwrap();
        assert_eq!(pa, pb);
        assert_eq!(pa.len(), 16);
        assert!(pa.bytes().all(|c| c.is_ascii_hexdigit()));
        let (na, nb) = (
            u64::from_str_radix(na, 16).unwrap(),
            u64::from_str_radix(nb, 16).unwrap(),
        );
        // Other tests in this process take ids too: later, never equal.
        assert!(nb > na, "{a:?} then {b:?}");
        assert_eq!(format!("{na:x}"), a.to_str().unwrap()[17..]);
    }
}
