//! Key and scope extraction and validation (SPEC sections 1 and 3).
//!
//! A key comes from the first configured source that is present: a header (bare, or an RFC
//! 8941 structured-field string `"abc"`) or a JSON pointer into the body. A valid key is 1-255
//! bytes of visible ASCII (0x21-0x7E). The scope says whose key it is; a scope from the
//! `Authorization` header is the SHA-256 of the header value, so the credential itself is
//! never stored or logged. The body is parsed as JSON at most once per request, and only when
//! a source needs it ([`JsonBody`]).

use bytes::Bytes;
use http::HeaderMap;
use serde_json::Value;

use crate::config::{Idempotency, KeySource, ScopeSource};
use crate::fingerprint::{hex, sha256};
use crate::problem::GatewayError;

/// Longest key and scope accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// The request body, parsed as JSON on first use.
pub struct JsonBody<'a> {
    raw: &'a Bytes,
    parsed: Option<Option<Value>>,
}

impl<'a> JsonBody<'a> {
    pub fn new(raw: &'a Bytes) -> Self {
        JsonBody { raw, parsed: None }
    }

    /// The parsed body, or `body-not-json`. serde_json's recursion limit (128) bounds nesting.
    pub fn get(&mut self) -> Result<&Value, GatewayError> {
        let raw = self.raw;
        self.parsed
            .get_or_insert_with(|| serde_json::from_slice(raw).ok())
            .as_ref()
            .ok_or(GatewayError::BodyNotJson)
    }

    /// The parsed body if it was parsed already or parses now.
    pub fn value(&mut self) -> Option<&Value> {
        self.get().ok()
    }
}

/// Who the key belongs to and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyScope {
    pub key: String,
    pub scope: String,
}

/// Extracts key and scope. `Ok(None)`: no key and the route does not require one.
pub fn extract(
    idem: &Idempotency,
    headers: &HeaderMap,
    body: &mut JsonBody<'_>,
) -> Result<Option<KeyScope>, GatewayError> {
    let Some(key) = find_key(idem, headers, body)? else {
        return if idem.required {
            Err(GatewayError::KeyMissing)
        } else {
            Ok(None)
        };
    };
    let scope = scope(&idem.scope, headers, body)?;
    Ok(Some(KeyScope { key, scope }))
}

fn find_key(
    idem: &Idempotency,
    headers: &HeaderMap,
    body: &mut JsonBody<'_>,
) -> Result<Option<String>, GatewayError> {
    for source in &idem.key {
        let found = match source {
            KeySource::Header(name) => match headers.get(name) {
                None => None,
                Some(v) => Some(parse_header_key(v.as_bytes())?),
            },
            KeySource::Json(ptr) => match body.get()?.pointer(ptr) {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Some(n.to_string()),
                Some(_) => return Err(GatewayError::KeyInvalid("must be a string or an integer")),
            },
        };
        if let Some(key) = found {
            validate_key(&key)?;
            return Ok(Some(key));
        }
    }
    Ok(None)
}

/// A header key, bare (`abc`) or as an RFC 8941 sf-string (`"abc"`, with `\"` and `\\`).
pub fn parse_header_key(raw: &[u8]) -> Result<String, GatewayError> {
    let raw = trim_ows(raw);
    let text = if let Some(inner) = raw.strip_prefix(b"\"") {
        let mut out = Vec::with_capacity(inner.len());
        let mut iter = inner.iter();
        let mut closed = false;
        while let Some(&b) = iter.next() {
            match b {
                b'\\' => match iter.next() {
                    Some(&e @ (b'"' | b'\\')) => out.push(e),
                    _ => {
                        return Err(GatewayError::KeyInvalid(
                            "has a bad escape in its quoted form",
                        ));
                    }
                },
                b'"' => {
                    closed = true;
                    break;
                }
                _ => out.push(b),
            }
        }
        // Parameters after the string (`;a=b`) are allowed by RFC 8941 and ignored here.
        let rest = iter.as_slice();
        if !closed || !(rest.is_empty() || rest.starts_with(b";")) {
            return Err(GatewayError::KeyInvalid("is not a valid quoted string"));
        }
        out
    } else {
        raw.to_vec()
    };
    String::from_utf8(text).map_err(|_| GatewayError::KeyInvalid("must be visible ASCII"))
}

fn trim_ows(mut b: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = b {
        b = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = b {
        b = rest;
    }
    b
}

/// 1-255 bytes, visible ASCII only.
pub fn validate_key(key: &str) -> Result<(), GatewayError> {
    if key.is_empty() {
        return Err(GatewayError::KeyInvalid("is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(GatewayError::KeyInvalid("is longer than 255 bytes"));
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(GatewayError::KeyInvalid(
            "must be visible ASCII (no spaces or control characters)",
        ));
    }
    Ok(())
}

fn scope(
    source: &ScopeSource,
    headers: &HeaderMap,
    body: &mut JsonBody<'_>,
) -> Result<String, GatewayError> {
    let missing = GatewayError::ScopeMissing {
        unauthorized: false,
    };
    let value = match source {
        ScopeSource::Fixed(name) => return Ok(name.clone()),
        ScopeSource::Authorization => {
            let v = headers
                .get(http::header::AUTHORIZATION)
                .filter(|v| !v.is_empty())
                .ok_or(GatewayError::ScopeMissing { unauthorized: true })?;
            // Prefixed so a hashed credential can never equal a plain account id.
            return Ok(format!("authz:{}", hex(&sha256(v.as_bytes()))));
        }
        ScopeSource::Header(name) => {
            let v = headers.get(name).ok_or(missing)?;
            std::str::from_utf8(trim_ows(v.as_bytes()))
                .map_err(|_| GatewayError::ScopeInvalid("must be UTF-8 text"))?
                .to_string()
        }
        ScopeSource::Json(ptr) => match body.get()?.pointer(ptr) {
            None | Some(Value::Null) => return Err(missing),
            Some(Value::String(s)) => s.clone(),
            Some(Value::Number(n)) if n.is_i64() || n.is_u64() => n.to_string(),
            Some(_) => return Err(GatewayError::ScopeInvalid("must be a string or an integer")),
        },
    };
    if value.is_empty() {
        return Err(GatewayError::ScopeMissing {
            unauthorized: false,
        });
    }
    if value.len() > MAX_KEY_LEN || value.chars().any(char::is_control) {
        return Err(GatewayError::ScopeInvalid(
            "must be 1-255 bytes without control characters",
        ));
    }
    Ok(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_keys_bare_and_quoted() {
        assert_eq!(parse_header_key(b"abc").unwrap(), "abc");
        assert_eq!(parse_header_key(b" \"abc\" ").unwrap(), "abc");
        assert_eq!(parse_header_key(b"\"a\\\"b\"").unwrap(), "a\"b");
        assert_eq!(parse_header_key(b"\"abc\";p=1").unwrap(), "abc");
        assert!(parse_header_key(b"\"abc").is_err());
        assert!(parse_header_key(b"\"a\\nb\"").is_err());
    }

    #[test]
    fn keys_are_validated() {
        assert!(validate_key("k-1_2.3").is_ok());
        assert!(validate_key("").is_err());
        assert!(validate_key("a b").is_err());
        assert!(validate_key(&"x".repeat(256)).is_err());
        assert!(validate_key(&"x".repeat(255)).is_ok());
        assert!(validate_key("é").is_err());
    }
}
