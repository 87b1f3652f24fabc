//! Stored response ⇄ HTTP response.
//!
//! A stored response is the upstream's status, the headers on the route's allow-list
//! (`replay_headers`, never hop-by-hop), and the whole body. Headers are kept as raw bytes in a
//! small length-prefixed encoding so a replay is byte-identical even for values that are not
//! UTF-8. A replay carries every stored header plus `Idempotent-Replayed: true`.

use bytes::Bytes;
use http::header::{HeaderMap, HeaderName, HeaderValue};
use http::{Response, StatusCode};

use crate::forward::{Body, full};

/// Header added to every replayed response (a `HeaderName`: inserting a `&str` name copies it
/// into a new allocation at every replay).
pub const REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");

/// A response as it is stored in the claim row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    pub headers: Vec<(HeaderName, HeaderValue)>,
    pub body: Bytes,
}

impl StoredResponse {
    /// Keeps the allow-listed headers of an upstream response.
    pub fn capture(
        status: StatusCode,
        headers: &HeaderMap,
        allow: &[HeaderName],
        body: Bytes,
    ) -> StoredResponse {
        let headers = allow
            .iter()
            .flat_map(|name| {
                headers
                    .get_all(name)
                    .iter()
                    .map(move |v| (name.clone(), v.clone()))
            })
            .collect();
        StoredResponse {
            status: status.as_u16(),
            headers,
            body,
        }
    }

    /// The replay sent to a retry.
    pub fn to_replay(&self) -> Response<Body> {
        let mut resp = Response::new(full(self.body.clone()));
        *resp.status_mut() = StatusCode::from_u16(self.status).unwrap_or(StatusCode::OK);
        let h = resp.headers_mut();
        for (name, value) in &self.headers {
            h.append(name.clone(), value.clone());
        }
        h.insert(REPLAYED, HeaderValue::from_static("true"));
        resp
    }

    /// Encodes the headers: for each, u16 name length, name, u32 value length, value.
    pub fn encode_headers(&self) -> Vec<u8> {
        let mut out = Vec::new();
        for (name, value) in &self.headers {
            let n = name.as_str().as_bytes();
            out.extend_from_slice(&(n.len() as u16).to_be_bytes());
            out.extend_from_slice(n);
            out.extend_from_slice(&(value.len() as u32).to_be_bytes());
            out.extend_from_slice(value.as_bytes());
        }
        out
    }

    /// Decodes what [`encode_headers`](Self::encode_headers) wrote; `None` if corrupt.
    pub fn decode_headers(mut raw: &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
        let mut out = Vec::new();
        while !raw.is_empty() {
            let (len, rest) = raw.split_first_chunk::<2>()?;
            let (name, rest) = rest.split_at_checked(u16::from_be_bytes(*len) as usize)?;
            let (len, rest) = rest.split_first_chunk::<4>()?;
            let (value, rest) = rest.split_at_checked(u32::from_be_bytes(*len) as usize)?;
            out.push((
                HeaderName::from_bytes(name).ok()?,
                HeaderValue::from_bytes(value).ok()?,
            ));
            raw = rest;
        }
        Some(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_byte_for_byte() {
        let mut h = HeaderMap::new();
        h.insert("content-type", "application/json".parse().unwrap());
        h.append("link", "<a>; rel=x".parse().unwrap());
        h.append("link", HeaderValue::from_bytes(b"<b>; \xff").unwrap());
        h.insert("set-cookie", "secret".parse().unwrap());
        let allow = [
            HeaderName::from_static("content-type"),
            HeaderName::from_static("link"),
        ];
        let s = StoredResponse::capture(StatusCode::CREATED, &h, &allow, Bytes::from("x"));
        assert_eq!(s.headers.len(), 3);
        let decoded = StoredResponse::decode_headers(&s.encode_headers()).unwrap();
        assert_eq!(decoded, s.headers);
        let r = s.to_replay();
        assert!(r.headers().get("set-cookie").is_none());
        assert_eq!(r.headers()[REPLAYED], "true");
    }

    #[test]
    fn corrupt_headers_are_refused() {
        assert!(StoredResponse::decode_headers(&[0, 5, b'a']).is_none());
    }
}
