//! Header names with a fixed meaning to a proxy, shared by the upstream client (which strips
//! them) and the configuration (which refuses to replay them). A leaf: it imports nothing of
//! the crate.

use http::HeaderName;
use http::header;

/// The hop-by-hop headers of RFC 9110 section 7.6.1 (plus the legacy `proxy-connection`).
/// Pre-parsed, so stripping them costs no header-name parsing per request. `Trailer` is not
/// one (it is end-to-end, RFC 9110 section 6.6.2): an HTTP/1.1 client needs it to be sent
/// the trailers it announces. `Connection` stays first (`forward::strip_hop_by_hop` relies on it).
/// `HTTP2-Settings` belongs to an `Upgrade: h2c` (RFC 7540 section 3.2.1), which is never
/// tunnelled: it is one connection's too.
pub const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    HeaderName::from_static("http2-settings"),
];

/// The lengths of the [`HOP_BY_HOP`] names, a bit each (all are shorter than 32 bytes; a
/// unit test keeps the two lists in step).
pub const HOP_BY_HOP_LENGTHS: u32 =
    1 << 2 | 1 << 7 | 1 << 10 | 1 << 14 | 1 << 16 | 1 << 17 | 1 << 18 | 1 << 19;

/// Whether `name` is hop-by-hop: meaningful for one connection only, never forwarded, stored
/// or replayed.
pub fn is_hop_by_hop(name: &HeaderName) -> bool {
    HOP_BY_HOP.contains(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_length_mask_has_the_length_of_every_hop_by_hop_name_and_no_other() {
        let lengths = HOP_BY_HOP
            .iter()
            .fold(0u32, |bits, name| bits | 1 << name.as_str().len());
        assert_eq!(HOP_BY_HOP_LENGTHS, lengths);
    }
}
