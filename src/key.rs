//! Key and scope extraction and validation (docs/contract.md, sections 1 and 3).
//!
//! A key comes from the first configured source that is present: a header (bare, or an RFC
//! 8941 structured-field string `"abc"`) or a JSON pointer into the body. A valid key is 1-255
//! bytes of visible ASCII (0x21-0x7E). The scope says whose key it is; a scope from the
//! `Authorization` header is the SHA-256 of the header value, so the credential itself is
//! never stored or logged. The body is parsed as JSON at most once per request, and only when
//! a source needs it ([`JsonBody`]).
//!
//! Ambiguity is refused, never guessed (docs/contract.md, section 8.1): a key or scope header repeated
//! with different values is 400, and a JSON body with a repeated member name anywhere is not
//! JSON to the gateway (two parsers may read it two ways).
//!
//! The body is read by [`crate::json`], linear in its size whatever its shape, nested at
//! most 128 deep; the gateway reads a large body off its serving thread (`gateway/keyed.rs`,
//! `key_request`).
//!
//! Scopes from different sources never collide: the stored scope carries its source
//! ([`namespaced`]: `header:`, `json:`, `fixed:`, `authz:`), so a client that sends
//! `X-Account-Id: webhooks` cannot squat a key of a `fixed: webhooks` route.

use bytes::Bytes;
use http::HeaderMap;

use crate::config::{Idempotency, KeySource, ScopeSource};
use crate::fingerprint::{hex, sha256};
use crate::json::{Json, Node, is_ambiguous};

/// The identity of a key outside the store: 32 hex chars of SHA-256 over its scope, a zero
/// byte and the key. What the access log, the key API, wake-ups (a `NOTIFY` payload) and the
/// replay cache name a key by: short, fixed-size, and it carries neither the scope nor the
/// key in clear. A scope's `serialize` slots have one too ([`KeyId::slots`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyId(String);

impl KeyId {
    /// The id of `key` in `scope`.
    pub fn of(scope: &str, key: &str) -> KeyId {
        KeyId::hashed(&[scope.as_bytes(), b"\0", key.as_bytes()])
    }

    /// The id of a scope's forwarding slots (`serialize`).
    pub fn slots(scope: &str) -> KeyId {
        KeyId::hashed(&[b"slots\0", scope.as_bytes()])
    }

    /// 32 hex chars of SHA-256 over `parts` one after another, fed to the hasher in place.
    fn hashed(parts: &[&[u8]]) -> KeyId {
        use sha2::Digest;
        let mut hasher = sha2::Sha256::new();
        for part in parts {
            hasher.update(part);
        }
        let digest: crate::fingerprint::Fingerprint = hasher.finalize().into();
        KeyId(hex(&digest[..16]))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for KeyId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<KeyId> for String {
    fn from(id: KeyId) -> String {
        id.0
    }
}

/// Why a request's key or scope cannot be used; `problem.rs` maps each to its status.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("idempotency key missing")]
    Missing,
    #[error("idempotency key invalid: {0}")]
    Invalid(&'static str),
    #[error("scope missing")]
    ScopeMissing { unauthorized: bool },
    #[error("scope invalid: {0}")]
    ScopeInvalid(&'static str),
    /// The key, scope or fingerprint is read from a JSON body that is not JSON (or repeats a
    /// member name).
    #[error("body is not JSON")]
    NotJson,
}

/// Longest key and scope accepted, in bytes.
pub const MAX_KEY_LEN: usize = 255;

/// The request body, parsed as JSON on first use.
pub struct JsonBody<'a> {
    raw: &'a Bytes,
    parsed: Option<Option<Json<'a>>>,
}

impl<'a> JsonBody<'a> {
    pub fn new(raw: &'a Bytes) -> Self {
        JsonBody { raw, parsed: None }
    }

    /// The parsed body, or `body-not-json` (not JSON, nested deeper than [`MAX_DEPTH`], or a
    /// member name repeated in one object). One pass reads the document and checks the names.
    pub fn get(&mut self) -> Result<&Json<'a>, KeyError> {
        let raw: &'a [u8] = self.raw;
        self.parsed
            .get_or_insert_with(|| Json::parse(raw).ok())
            .as_ref()
            .ok_or(KeyError::NotJson)
    }

    /// Refuses a body that says it is JSON and repeats a member name, even where nothing is
    /// read from it (the upstream's parser may read it another way than a fingerprint does),
    /// or nests deeper than the gateway reads, where a repeat could hide ([`is_ambiguous`]).
    pub fn refuse_ambiguous(&mut self, headers: &HeaderMap) -> Result<(), KeyError> {
        if self.parsed.is_none() && is_json_content_type(headers) && is_ambiguous(self.raw) {
            self.parsed = Some(None);
            return Err(KeyError::NotJson);
        }
        Ok(())
    }

    /// Whether the body was parsed already, as JSON without a repeated member.
    pub fn is_parsed(&self) -> bool {
        matches!(self.parsed, Some(Some(_)))
    }

    /// The parsed body if it was parsed already or parses now.
    pub fn value(&mut self) -> Option<&Json<'a>> {
        self.get().ok()
    }
}

/// A key or scope read from the body: `Ok(None)` where the pointer names nothing or `null`,
/// `Err(())` where it names neither a string nor an integer.
fn text_at(json: &Json<'_>, ptr: &str) -> Result<Option<String>, ()> {
    match json.pointer(ptr) {
        None | Some(Node::Null) => Ok(None),
        Some(Node::Str(s)) => Ok(Some(json.text(s).to_string())),
        Some(Node::U64(n)) => Ok(Some(n.to_string())),
        Some(Node::I64(n)) => Ok(Some(n.to_string())),
        // serde_json's `Number::is_i64` and `is_u64` with `arbitrary_precision`: the text
        // parses as one (`-0` does).
        Some(Node::Number(n)) => {
            let n = json.text(n);
            if n.parse::<i64>().is_ok() || n.parse::<u64>().is_ok() {
                Ok(Some(n.to_string()))
            } else {
                Err(())
            }
        }
        Some(_) => Err(()),
    }
}

/// Whether a request says its body is JSON (`application/json` or `+json`).
pub fn is_json_content_type(headers: &HeaderMap) -> bool {
    headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(|v| v.split(';').next().unwrap_or("").trim())
        .is_some_and(|mime| {
            let tail = &mime.as_bytes()[mime.len().saturating_sub(5)..];
            mime.eq_ignore_ascii_case("application/json") || tail.eq_ignore_ascii_case(b"+json")
        })
}

/// The stored form of a scope: its source, then the value (see the module docs).
pub fn namespaced(source: &ScopeSource, value: &str) -> String {
    let prefix = match source {
        ScopeSource::Header(_) => "header:",
        ScopeSource::Json(_) => "json:",
        ScopeSource::Fixed(_) => "fixed:",
        // The value is already the hash with its prefix.
        ScopeSource::Authorization => return value.to_string(),
    };
    let mut s = String::with_capacity(prefix.len() + value.len());
    s.push_str(prefix);
    s.push_str(value);
    s
}

/// The one value of a header that may appear once: `Ok(None)` when absent; `Err(())` when
/// it is repeated with values that differ after `parse`.
fn single_header<T: PartialEq>(
    headers: &HeaderMap,
    name: &http::HeaderName,
    parse: impl Fn(&[u8]) -> Result<T, KeyError>,
) -> Result<Option<Result<T, KeyError>>, ()> {
    let mut all = headers.get_all(name).iter();
    let Some(first) = all.next() else {
        return Ok(None);
    };
    let value = parse(first.as_bytes());
    for other in all {
        if other.as_bytes() == first.as_bytes() {
            continue;
        }
        match (&value, parse(other.as_bytes())) {
            (Ok(a), Ok(b)) if *a == b => {}
            _ => return Err(()),
        }
    }
    Ok(Some(value))
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
) -> Result<Option<KeyScope>, KeyError> {
    let Some(key) = find_key(idem, headers, body)? else {
        return if idem.required {
            Err(KeyError::Missing)
        } else {
            Ok(None)
        };
    };
    let value = scope(&idem.scope, headers, body)?;
    Ok(Some(KeyScope {
        key,
        scope: namespaced(&idem.scope, &value),
    }))
}

fn find_key(
    idem: &Idempotency,
    headers: &HeaderMap,
    body: &mut JsonBody<'_>,
) -> Result<Option<String>, KeyError> {
    for source in &idem.key {
        let found = match source {
            KeySource::Header(name) => match single_header(headers, name, parse_header_key) {
                Err(()) => {
                    return Err(KeyError::Invalid(
                        "is given more than once with different values",
                    ));
                }
                Ok(None) => None,
                Ok(Some(key)) => Some(key?),
            },
            KeySource::Json(ptr) => text_at(body.get()?, ptr)
                .map_err(|()| KeyError::Invalid("must be a string or an integer"))?,
        };
        if let Some(key) = found {
            validate_key(&key)?;
            return Ok(Some(key));
        }
    }
    Ok(None)
}

/// A header key, bare (`abc`) or as an RFC 8941 sf-string (`"abc"`, with `\"` and `\\`).
pub fn parse_header_key(raw: &[u8]) -> Result<String, KeyError> {
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
                        return Err(KeyError::Invalid("has a bad escape in its quoted form"));
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
            return Err(KeyError::Invalid("is not a valid quoted string"));
        }
        out
    } else {
        raw.to_vec()
    };
    String::from_utf8(text).map_err(|_| KeyError::Invalid("must be visible ASCII"))
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
pub fn validate_key(key: &str) -> Result<(), KeyError> {
    if key.is_empty() {
        return Err(KeyError::Invalid("is empty"));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::Invalid("is longer than 255 bytes"));
    }
    if !key.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
        return Err(KeyError::Invalid(
            "must be visible ASCII (no spaces or control characters)",
        ));
    }
    Ok(())
}

fn scope(
    source: &ScopeSource,
    headers: &HeaderMap,
    body: &mut JsonBody<'_>,
) -> Result<String, KeyError> {
    let missing = KeyError::ScopeMissing {
        unauthorized: false,
    };
    let value = match source {
        ScopeSource::Fixed(name) => return Ok(name.clone()),
        ScopeSource::Authorization => {
            let mut all = headers.get_all(http::header::AUTHORIZATION).iter();
            let v = all
                .next()
                .filter(|v| !v.is_empty())
                .ok_or(KeyError::ScopeMissing { unauthorized: true })?;
            if all.any(|other| other != v) {
                return Err(KeyError::ScopeInvalid(
                    "header is given more than once with different values",
                ));
            }
            // Prefixed so a hashed credential can never equal a plain account id.
            return Ok(format!("authz:{}", hex(&sha256(v.as_bytes()))));
        }
        ScopeSource::Header(name) => {
            let text = |raw: &[u8]| {
                std::str::from_utf8(trim_ows(raw))
                    .map(str::to_string)
                    .map_err(|_| KeyError::ScopeInvalid("must be UTF-8 text"))
            };
            match single_header(headers, name, text) {
                Err(()) => {
                    return Err(KeyError::ScopeInvalid(
                        "header is given more than once with different values",
                    ));
                }
                Ok(None) => return Err(missing),
                Ok(Some(v)) => v?,
            }
        }
        ScopeSource::Json(ptr) => text_at(body.get()?, ptr)
            .map_err(|()| KeyError::ScopeInvalid("must be a string or an integer"))?
            .ok_or(missing)?,
    };
    if value.is_empty() {
        return Err(KeyError::ScopeMissing {
            unauthorized: false,
        });
    }
    if value.len() > MAX_KEY_LEN || value.chars().any(char::is_control) {
        return Err(KeyError::ScopeInvalid(
            "must be 1-255 bytes without control characters",
        ));
    }
    Ok(value)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn key_ids_are_short_and_distinct() {
        assert_eq!(KeyId::of("a", "b").as_str().len(), 32);
        assert_ne!(KeyId::of("a", "bc"), KeyId::of("ab", "c"));
        // SHA-256 of scope, a zero byte and key: the same id as every earlier release wrote
        // in its logs.
        assert_eq!(
            KeyId::of("acct-1", "k").as_str(),
            hex(&sha256(b"acct-1\0k")[..16])
        );
        assert_eq!(
            KeyId::slots("acct-1").as_str(),
            hex(&sha256(b"slots\0acct-1")[..16])
        );
    }

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
    fn json_content_types_are_recognised_in_any_case() {
        let says = |v: &'static str| {
            let mut h = HeaderMap::new();
            h.insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(v),
            );
            is_json_content_type(&h)
        };
        assert!(says("application/json"));
        assert!(says("Application/JSON; charset=utf-8"));
        assert!(says(" application/problem+json ;q=1"));
        assert!(says("application/VND.API+JSON"));
        assert!(!says("text/plain"));
        assert!(!says("application/json5"));
        assert!(!says("json"));
        assert!(!says("application/jsonx"));
        assert!(!is_json_content_type(&HeaderMap::new()));
    }

    #[test]
    fn repeated_headers_with_different_values_are_refused() {
        let mut idem = crate::config::Config::from_yaml(
            "store: { postgres: { url: \"postgres://u@h/d\" } }\n\
             upstreams: { a: { url: \"http://127.0.0.1:1\" } }\n\
             routes: [{ name: r, match: { path: /x }, upstream: a, \
               idempotency: { scope: { header: x-account-id } } }]\n",
        )
        .unwrap()
        .routes[0]
            .idempotency
            .clone()
            .unwrap();
        let raw = Bytes::new();
        let run = |idem: &Idempotency, pairs: &[(&str, &str)]| {
            let mut h = HeaderMap::new();
            for (k, v) in pairs {
                h.append(
                    http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                    v.parse().unwrap(),
                );
            }
            extract(idem, &h, &mut JsonBody::new(&raw))
        };
        let ok = run(&idem, &[("idempotency-key", "k"), ("x-account-id", "a")]).unwrap();
        assert_eq!(ok.unwrap().scope, "header:a");
        // The same value twice (bare and quoted) is one value.
        assert!(
            run(
                &idem,
                &[
                    ("idempotency-key", "k"),
                    ("idempotency-key", "\"k\""),
                    ("x-account-id", "a")
                ]
            )
            .is_ok()
        );
        assert!(matches!(
            run(
                &idem,
                &[
                    ("idempotency-key", "k"),
                    ("idempotency-key", "j"),
                    ("x-account-id", "a")
                ]
            ),
            Err(KeyError::Invalid(_))
        ));
        assert!(matches!(
            run(
                &idem,
                &[
                    ("idempotency-key", "k"),
                    ("x-account-id", "a"),
                    ("x-account-id", "b")
                ]
            ),
            Err(KeyError::ScopeInvalid(_))
        ));
        idem.scope = ScopeSource::Fixed("a".into());
        let fixed = run(&idem, &[("idempotency-key", "k")]).unwrap().unwrap();
        assert_eq!(
            fixed.scope, "fixed:a",
            "a fixed scope never equals a header scope"
        );
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
