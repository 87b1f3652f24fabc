//! The spans' way out: a bounded queue between the requests and one exporter thread, which
//! batches them and sends each batch to the collector over OTLP (HTTP/protobuf through
//! hyper-util's client and rustls with ring, or gRPC through tonic, plaintext).
//!
//! The SDK's own batch processor counts nothing it drops; this one does.
//!
//! Invariants:
//! - [`Queue::on_end`] (on a request's path) never blocks and never waits for the network:
//!   one `try_send` on a bounded channel; a full queue drops the span and counts it in
//!   `dropped`. It does not wake the exporter thread either, but when the queue holds a full
//!   batch (or a quarter of its bound, if less): the thread is not parked on the channel (a
//!   wake-up per span cost a context switch and a futex call on the request's thread, about
//!   half of what a traced request cost), it polls it every [`POLL`] and sends a batch when
//!   one is full or its first span has waited [`BATCH_DELAY`].
//! - The exporter thread owns the exporter and a runtime of its own (one thread): a slow
//!   or absent collector only slows that thread, each export bounded by the configured
//!   timeout (retries included). A failed export's spans are counted in `dropped`, an
//!   accepted one's in `exported`.
//! - Shutdown exports what was queued before it, waiting at most its bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError};
use std::time::{Duration, Instant};

use opentelemetry::Context;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _, WithTonicConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::error::{OTelSdkError, OTelSdkResult};
use opentelemetry_sdk::trace::{Span, SpanData, SpanExporter as _, SpanProcessor};

use super::settings::Settings;
use crate::config::OtlpProtocol;

/// What the exporter counts into `/metrics`.
#[derive(Clone, Debug, Default)]
pub struct Counters {
    /// Spans dropped: the queue was full, or their export failed.
    pub dropped: prometheus_client::metrics::counter::Counter,
    /// Spans the collector accepted.
    pub exported: prometheus_client::metrics::counter::Counter,
}

/// Spans sent to the collector at once, at most.
const MAX_BATCH: usize = 512;

/// How long the first span of a batch waits for others before the batch is sent.
const BATCH_DELAY: Duration = Duration::from_secs(1);

/// How often the exporter thread looks at the queue when nobody woke it.
const POLL: Duration = Duration::from_millis(200);

enum Message {
    Span(Box<SpanData>),
    /// Export what came before, then answer and stop.
    Stop(SyncSender<()>),
}

/// The span processor: a bounded queue to the exporter thread.
#[derive(Debug)]
pub(super) struct Queue {
    tx: SyncSender<Message>,
    dropped: prometheus_client::metrics::counter::Counter,
    stopped: AtomicBool,
    /// Spans sent and not yet taken by the exporter thread (never fewer than there are).
    queued: Arc<AtomicUsize>,
    /// The count at which a span wakes the exporter thread: a full batch, or a quarter of
    /// the queue's bound when that is less.
    wake_at: usize,
    exporter: std::thread::Thread,
}

impl std::fmt::Debug for Message {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Message::Span(_) => "Span",
            Message::Stop(_) => "Stop",
        })
    }
}

impl Queue {
    /// Starts the exporter thread; the exporter is built there, inside the thread's own
    /// runtime (tonic's channel needs one), and this waits until it is.
    pub(super) fn start(
        settings: &Settings,
        resource: Resource,
        counters: Counters,
    ) -> Result<Queue, String> {
        let (tx, rx) = std::sync::mpsc::sync_channel(settings.max_queue_spans);
        let (built_tx, built_rx) = std::sync::mpsc::sync_channel(1);
        let timeout = settings.timeout;
        let dropped = counters.dropped.clone();
        let settings = settings.clone();
        let queued = Arc::new(AtomicUsize::new(0));
        let taken = Arc::clone(&queued);
        // A full batch, or a quarter of the bound when that is less: the room left takes
        // what arrives while the thread wakes and sends.
        let wake_at = (settings.max_queue_spans / 4).clamp(1, MAX_BATCH);
        let thread = std::thread::Builder::new()
            .name("idemgate-traces".into())
            .spawn(move || {
                let runtime = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = built_tx.send(Err(format!(
                            "traces: cannot start the exporter's runtime: {e}"
                        )));
                        return;
                    }
                };
                match runtime.block_on(async { Exporter::build(&settings, resource) }) {
                    Ok(exporter) => {
                        let _ = built_tx.send(Ok(()));
                        export_loop(rx, &taken, runtime, exporter, timeout, counters);
                    }
                    Err(e) => {
                        let _ = built_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| format!("traces: cannot start the exporter thread: {e}"))?;
        built_rx
            .recv()
            .map_err(|_| "traces: the exporter thread ended at start".to_string())??;
        Ok(Queue {
            tx,
            dropped,
            stopped: AtomicBool::new(false),
            queued,
            wake_at,
            exporter: thread.thread().clone(),
        })
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        // Counted before it is sent, so the exporter never takes more than was counted.
        let before = self.queued.fetch_add(1, Ordering::Relaxed);
        if self.tx.try_send(Message::Span(Box::new(span))).is_err() {
            // Full, or the exporter thread is gone (after shutdown).
            self.queued.fetch_sub(1, Ordering::Relaxed);
            self.dropped.inc();
        } else if before + 1 == self.wake_at {
            self.exporter.unpark();
        }
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        if self.stopped.swap(true, Ordering::SeqCst) {
            return Err(OTelSdkError::AlreadyShutdown);
        }
        let deadline = Instant::now() + timeout;
        let (ack_tx, ack_rx) = std::sync::mpsc::sync_channel(1);
        let mut stop = Message::Stop(ack_tx);
        // Behind the spans already queued: the thread makes room as it exports.
        loop {
            match self.tx.try_send(stop) {
                Ok(()) => {
                    self.exporter.unpark();
                    break;
                }
                Err(TrySendError::Disconnected(_)) => return Ok(()),
                Err(TrySendError::Full(back)) => {
                    if Instant::now() >= deadline {
                        return Err(OTelSdkError::Timeout(timeout));
                    }
                    stop = back;
                    self.exporter.unpark();
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
        }
        match ack_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(()) | Err(RecvTimeoutError::Disconnected) => Ok(()),
            Err(RecvTimeoutError::Timeout) => Err(OTelSdkError::Timeout(timeout)),
        }
    }
}

/// The OTLP exporter of the configured protocol.
struct Exporter;

impl Exporter {
    fn build(
        settings: &Settings,
        resource: Resource,
    ) -> Result<opentelemetry_otlp::SpanExporter, String> {
        let endpoint = settings.endpoint.to_string();
        let built = match settings.protocol {
            OtlpProtocol::HttpProtobuf => {
                let mut connector = hyper_util::client::legacy::connect::HttpConnector::new();
                connector.enforce_http(false);
                connector.set_nodelay(true);
                connector.set_connect_timeout(Some(settings.timeout));
                let tls = crate::tls::client_config(None)
                    .map_err(|e| format!("traces: cannot load the trusted roots: {e}"))?;
                let connector = hyper_rustls::HttpsConnectorBuilder::new()
                    .with_tls_config(tls)
                    .https_or_http()
                    .enable_http1()
                    .wrap_connector(connector);
                let client =
                    opentelemetry_http::hyper::HyperClient::new(connector, settings.timeout, None);
                let headers = settings
                    .headers
                    .iter()
                    .filter_map(|(n, v)| Some((n.to_string(), v.to_str().ok()?.to_owned())))
                    .collect();
                opentelemetry_otlp::SpanExporter::builder()
                    .with_http()
                    .with_http_client(client)
                    .with_protocol(opentelemetry_otlp::Protocol::HttpBinary)
                    .with_endpoint(endpoint)
                    .with_timeout(settings.timeout)
                    .with_headers(headers)
                    .build()
            }
            OtlpProtocol::Grpc => {
                let headers: http::HeaderMap = settings.headers.iter().cloned().collect();
                let metadata =
                    opentelemetry_otlp::tonic_types::metadata::MetadataMap::from_headers(headers);
                opentelemetry_otlp::SpanExporter::builder()
                    .with_tonic()
                    .with_protocol(opentelemetry_otlp::Protocol::Grpc)
                    .with_endpoint(endpoint)
                    .with_timeout(settings.timeout)
                    .with_metadata(metadata)
                    .build()
            }
        };
        let mut exporter = built.map_err(|e| format!("traces: cannot build the exporter: {e}"))?;
        exporter.set_resource(&resource);
        Ok(exporter)
    }
}

/// The exporter thread: takes what is queued (woken when a full batch is queued, or every
/// [`POLL`]), and sends a batch of up to [`MAX_BATCH`] spans when it is full or
/// [`BATCH_DELAY`] after its first span, each send bounded by `timeout`.
fn export_loop(
    rx: Receiver<Message>,
    queued: &AtomicUsize,
    runtime: tokio::runtime::Runtime,
    exporter: opentelemetry_otlp::SpanExporter,
    timeout: Duration,
    counters: Counters,
) {
    let mut failing = false;
    let mut batch: Vec<SpanData> = Vec::with_capacity(MAX_BATCH);
    let mut first_at: Option<Instant> = None;
    loop {
        let mut stop = None;
        let mut gone = false;
        let mut taken = 0;
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Message::Span(span)) => {
                    batch.push(*span);
                    taken += 1;
                }
                Ok(Message::Stop(ack)) => {
                    stop = Some(ack);
                    break;
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => {
                    gone = true;
                    break;
                }
            }
        }
        queued.fetch_sub(taken, Ordering::Relaxed);
        if !batch.is_empty() && first_at.is_none() {
            first_at = Some(Instant::now());
        }
        let full = batch.len() >= MAX_BATCH;
        let due =
            full || stop.is_some() || gone || first_at.is_some_and(|t| t.elapsed() >= BATCH_DELAY);
        if due && !batch.is_empty() {
            first_at = None;
            let n = batch.len() as u64;
            let spans = std::mem::replace(&mut batch, Vec::with_capacity(MAX_BATCH));
            let sent = runtime
                .block_on(async { tokio::time::timeout(timeout, exporter.export(spans)).await });
            match sent {
                Ok(Ok(())) => {
                    counters.exported.inc_by(n);
                    if failing {
                        failing = false;
                        tracing::info!("traces: the collector accepts spans again");
                    }
                }
                Ok(Err(e)) => {
                    counters.dropped.inc_by(n);
                    if !failing {
                        failing = true;
                        tracing::warn!(error = %e, spans = n, "traces: export failed; spans dropped (counted in idemgate_trace_spans_dropped_total) until the collector answers");
                    }
                }
                Err(_) => {
                    counters.dropped.inc_by(n);
                    if !failing {
                        failing = true;
                        tracing::warn!(timeout = ?timeout, spans = n, "traces: export timed out; spans dropped (counted in idemgate_trace_spans_dropped_total) until the collector answers");
                    }
                }
            }
        }
        if let Some(ack) = stop {
            let _ = ack.send(());
            return;
        }
        if gone {
            return;
        }
        if !full {
            let wait = first_at.map_or(POLL, |t| BATCH_DELAY.saturating_sub(t.elapsed()).min(POLL));
            std::thread::park_timeout(wait);
        }
    }
}
