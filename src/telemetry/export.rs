//! The spans' way out: a bounded queue between the requests and one exporter thread, which
//! batches them and sends each batch to the collector over OTLP (HTTP/protobuf through
//! hyper-util's client and rustls with ring, or gRPC through tonic, plaintext).
//!
//! The SDK's own batch processor counts nothing it drops; this one does.
//!
//! Invariants:
//! - [`Queue::on_end`] (on a request's path) never blocks and never waits for the network:
//!   one `try_send` on a bounded channel; a full queue drops the span and counts it in
//!   `dropped`.
//! - The exporter thread owns the exporter and a runtime of its own (one thread): a slow
//!   or absent collector only slows that thread, each export bounded by the configured
//!   timeout (retries included). A failed export's spans are counted in `dropped`, an
//!   accepted one's in `exported`.
//! - Shutdown exports what was queued before it, waiting at most its bound.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, SyncSender, TrySendError};
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
        std::thread::Builder::new()
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
                        export_loop(rx, runtime, exporter, timeout, counters);
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
        })
    }
}

impl SpanProcessor for Queue {
    fn on_start(&self, _span: &mut Span, _cx: &Context) {}

    fn on_end(&self, span: SpanData) {
        if !span.span_context.is_sampled() {
            return;
        }
        if self.tx.try_send(Message::Span(Box::new(span))).is_err() {
            // Full, or the exporter thread is gone (after shutdown).
            self.dropped.inc();
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
                Ok(()) => break,
                Err(TrySendError::Disconnected(_)) => return Ok(()),
                Err(TrySendError::Full(back)) => {
                    if Instant::now() >= deadline {
                        return Err(OTelSdkError::Timeout(timeout));
                    }
                    stop = back;
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

/// The exporter thread: batches of up to [`MAX_BATCH`] spans, sent when full or
/// [`BATCH_DELAY`] after their first span, each send bounded by `timeout`.
fn export_loop(
    rx: Receiver<Message>,
    runtime: tokio::runtime::Runtime,
    exporter: opentelemetry_otlp::SpanExporter,
    timeout: Duration,
    counters: Counters,
) {
    let mut failing = false;
    let mut batch: Vec<SpanData> = Vec::with_capacity(MAX_BATCH);
    loop {
        let mut stop = None;
        match rx.recv() {
            Ok(Message::Span(span)) => batch.push(*span),
            Ok(Message::Stop(ack)) => stop = Some(ack),
            Err(_) => return,
        }
        let deadline = Instant::now() + BATCH_DELAY;
        while stop.is_none() && batch.len() < MAX_BATCH {
            match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
                Ok(Message::Span(span)) => batch.push(*span),
                Ok(Message::Stop(ack)) => stop = Some(ack),
                Err(_) => break,
            }
        }
        if !batch.is_empty() {
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
    }
}
