//! Why a forward failed: what the forwards (`mod.rs`, `h1.rs`) return and the gateway maps
//! to the client's problem (`problem.rs`).

/// Why a forward failed.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// The request never reached the upstream (refused, DNS, connect timeout).
    #[error("connect: {0}")]
    Connect(String),
    /// No complete answer within the upstream's `timeout`; it may have been processed.
    #[error("timed out")]
    Timeout,
    /// The connection failed after the request was sent; it may have been processed.
    #[error("failed: {0}")]
    Failed(String),
}
