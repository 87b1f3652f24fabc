//! Request and response bodies on their way through the gateway: a keyed request's body read
//! within its limit (by `Content-Length` up front, then by count), an upstream response
//! captured up to `max_stored_response` for the store. (A passed-on answer's admission is
//! held by its response body, `access::Logged`, until the body is done with.)
//!
//! Invariants: a body over its limit is never truncated silently: what was read is put back
//! in front of the unread rest ([`Prefixed`]), so an observe route forwards it whole and a
//! too-large response reaches its first client whole; captured bytes are counted in the
//! request's byte reservation as they arrive.

use bytes::Bytes;
use http::header;
use http_body_util::BodyExt;
use hyper::body::Incoming;

use crate::forward::{Body, UpstreamError, stream};
use crate::problem::GatewayError;

/// A keyed request's body as read.
pub(crate) enum RequestBody {
    /// All of it, within the route's limit.
    Whole(Bytes),
    /// Over the limit: what was read, then the rest, unread, as one body (only an observe
    /// route forwards it; enforcing refuses it with 413).
    TooLarge(Body),
}

/// Reads a keyed request's body up to `limit`: by `Content-Length` up front (a body that
/// says it is larger is not read at all), then by count. What it holds is reserved in `held`
/// as it arrives, never before: past `server.max_buffered_bytes` it stops with 503
/// `overloaded`.
pub(crate) async fn read_body(
    headers: &http::HeaderMap,
    mut body: Incoming,
    limit: usize,
    held: &mut crate::limits::Reservation,
) -> Result<RequestBody, GatewayError> {
    use hyper::body::Body as _;
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        && len > limit as u64
    {
        return Ok(RequestBody::TooLarge(stream(body)));
    }
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| GatewayError::BodyRead(e.to_string()))?;
        if let Ok(data) = frame.into_data() {
            // Reserved as it arrives, before it is kept.
            if !held.try_resize(buf.len() + data.len()) {
                return Err(GatewayError::Overloaded("max_buffered_bytes"));
            }
            buf.extend_from_slice(&data);
            if buf.len() > limit {
                let rest = Prefixed {
                    head: Some(buf.freeze()),
                    rest: stream(body),
                };
                return Ok(RequestBody::TooLarge(rest.boxed_unsync()));
            }
        }
        if body.is_end_stream() {
            break;
        }
    }
    Ok(RequestBody::Whole(buf.freeze()))
}

/// An upstream body, read as far as the store limit allows.
pub(crate) enum Captured {
    /// A retryable status: not read at all.
    PassOn(Body),
    /// The whole body, within the limit.
    Whole(Bytes),
    /// Over the limit: what was read, and the rest still streaming.
    TooLarge { head: Bytes, rest: Body },
}

/// Reads an upstream body up to `limit`, counting what it holds in `held` on top of the
/// request body already counted there.
pub(crate) async fn read_capped(
    mut body: Body,
    limit: usize,
    held: &mut crate::limits::Reservation,
) -> Result<Captured, UpstreamError> {
    use hyper::body::Body as _;
    let base = held.bytes();
    let mut buf = bytes::BytesMut::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| UpstreamError::Failed(crate::forward::error_chain(&*e)))?;
        if let Ok(data) = frame.into_data() {
            buf.extend_from_slice(&data);
            held.resize(base + buf.len());
            if buf.len() > limit {
                return Ok(Captured::TooLarge {
                    head: buf.freeze(),
                    rest: body,
                });
            }
        }
        if body.is_end_stream() {
            break;
        }
    }
    Ok(Captured::Whole(buf.freeze()))
}

/// A body that yields bytes already read, then the rest of an upstream body.
pub(crate) struct Prefixed {
    pub(crate) head: Option<Bytes>,
    pub(crate) rest: Body,
}

impl hyper::body::Body for Prefixed {
    type Data = Bytes;
    type Error = crate::forward::BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, Self::Error>>> {
        if let Some(head) = self.head.take() {
            return std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(head))));
        }
        std::pin::Pin::new(&mut self.rest).poll_frame(cx)
    }

    /// At least the head, which is held in memory (what the byte budget counts for a body
    /// passed on past a limit: `gateway::keyed`'s `hold_answer`); at most the head and what
    /// the rest may still bring.
    fn size_hint(&self) -> hyper::body::SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let mut hint = hyper::body::SizeHint::new();
        hint.set_lower(head);
        if let Some(upper) = self.rest.size_hint().upper() {
            hint.set_upper(head.saturating_add(upper));
        }
        hint
    }
}
