//! The body type both sides of the proxy use ([`Body`]), how bytes and hyper's bodies become
//! one, and [`error_chain`]: what the gateway, the forwards and the stores share. A leaf: it
//! imports nothing of the crate.

use bytes::Bytes;
use http_body_util::BodyExt;
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;

/// Boxed error for bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// The body type used on both sides of the proxy.
pub type Body = UnsyncBoxBody<Bytes, BoxError>;

/// A body from bytes. Past [`PIECE`] bytes it yields them in pieces of that size (slices of
/// one buffer, no copy): a connection takes the next piece only once it has room for it, so
/// an answer waiting for a slow reader stays in its body, counted in the byte budget with
/// it, instead of being queued whole on the connection at once.
pub fn full(bytes: impl Into<Bytes>) -> Body {
    let bytes = bytes.into();
    if bytes.len() <= PIECE {
        return http_body_util::Full::new(bytes)
            .map_err(|never| match never {})
            .boxed_unsync();
    }
    Pieces { rest: bytes }.boxed_unsync()
}

/// The largest piece [`full`] yields at once.
pub const PIECE: usize = 64 * 1024;

/// Bytes yielded [`PIECE`] at a time, with their exact length known up front.
struct Pieces {
    rest: Bytes,
}

impl hyper::body::Body for Pieces {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        _: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Bytes>, BoxError>>> {
        if self.rest.is_empty() {
            return std::task::Poll::Ready(None);
        }
        let n = self.rest.len().min(PIECE);
        let piece = self.rest.split_to(n);
        std::task::Poll::Ready(Some(Ok(hyper::body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        hyper::body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

/// A streamed body from a hyper body.
pub fn stream(body: Incoming) -> Body {
    body.map_err(|e| Box::new(e) as BoxError).boxed_unsync()
}

/// An error and its causes on one line, for logs.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
