//! The request fingerprint: SHA-256 over what makes two requests "the same" (SPEC section 1).
//!
//! Parts, in order, each length-prefixed so that no two different requests can produce the
//! same byte stream: method, route name, path and query, each configured header (its values
//! in order, or an "absent" marker), and the body. The body is hashed raw, or, with
//! `json_canonical`, as canonical JSON: object keys sorted by their UTF-8 bytes, no
//! insignificant white space, with the `json_ignore` pointers removed first. Numbers keep
//! their text (serde_json's `arbitrary_precision`), so `0.30000000000000001` and `0.3` differ.
//! A JSON object with a duplicated member name counts as the last value given, as most
//! parsers read it.

use http::{HeaderMap, Method};
use std::borrow::Cow;

use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::FingerprintConfig;

/// A SHA-256 digest.
pub type Fingerprint = [u8; 32];

/// SHA-256 of one byte string.
pub fn sha256(data: &[u8]) -> Fingerprint {
    Sha256::digest(data).into()
}

/// Lower-case hex of some bytes (sha2 0.11 digests have no `{:x}`).
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for &b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 0xf) as usize] as char);
    }
    s
}

fn part(h: &mut Sha256, bytes: &[u8]) {
    h.update((bytes.len() as u64).to_le_bytes());
    h.update(bytes);
}

/// Why a request cannot be fingerprinted: `json_canonical` on a body that is not JSON.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FingerprintError {
    #[error("body is not JSON")]
    NotJson,
}

/// The fingerprint of one request. `json` is the parsed body when the route needs it.
pub fn fingerprint(
    cfg: &FingerprintConfig,
    method: &Method,
    route: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
    json: Option<&Value>,
) -> Result<Fingerprint, FingerprintError> {
    let mut h = Sha256::new();
    part(&mut h, method.as_str().as_bytes());
    part(&mut h, route.as_bytes());
    part(&mut h, path_and_query.as_bytes());
    for name in &cfg.headers {
        let mut values = headers.get_all(name).iter().peekable();
        if values.peek().is_none() {
            h.update([0u8]);
        } else {
            h.update([1u8]);
            for v in values {
                part(&mut h, v.as_bytes());
            }
        }
        part(&mut h, name.as_str().as_bytes());
    }
    if cfg.json_canonical {
        let json = json.ok_or(FingerprintError::NotJson)?;
        // Streamed into the hash (no buffer, no copy of the document); the length goes after
        // the bytes instead of before them, which is as unambiguous for the last part.
        let ignore: Vec<Vec<Cow<'_, str>>> = cfg.json_ignore.iter().map(|p| tokens(p)).collect();
        let ignore: Vec<&[Cow<'_, str>]> = ignore.iter().map(Vec::as_slice).collect();
        let mut w = HashWriter { h: &mut h, n: 0 };
        write_canonical(json, &mut w, &ignore);
        let n = w.n;
        h.update(n.to_le_bytes());
    } else {
        part(&mut h, body);
    }
    Ok(h.finalize().into())
}

/// The reference tokens of an RFC 6901 pointer (`/a/b~1c` is `a`, `b/c`).
fn tokens(ptr: &str) -> Vec<Cow<'_, str>> {
    ptr.split('/')
        .skip(1)
        .map(|t| {
            if t.contains('~') {
                Cow::Owned(t.replace("~1", "/").replace("~0", "~"))
            } else {
                Cow::Borrowed(t)
            }
        })
        .collect()
}

/// Feeds written bytes to a hash and counts them.
struct HashWriter<'a> {
    h: &'a mut Sha256,
    n: u64,
}

impl std::io::Write for HashWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.h.update(buf);
        self.n += buf.len() as u64;
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Canonical JSON: object members sorted by the UTF-8 bytes of their names, compact, numbers
/// as written. `ignore` holds the remaining tokens of the pointers to leave out: a member or
/// element whose pointer ends here is skipped; deeper ones are passed down.
pub fn write_canonical<W: std::io::Write>(value: &Value, out: &mut W, ignore: &[&[Cow<'_, str>]]) {
    let below = |name: &str| -> Option<Vec<&[Cow<'_, str>]>> {
        let mut deeper = Vec::new();
        for p in ignore {
            if let Some((first, rest)) = p.split_first()
                && first == name
            {
                if rest.is_empty() {
                    return None; // this very member is ignored
                }
                deeper.push(rest);
            }
        }
        Some(deeper)
    };
    let w = |out: &mut W, bytes: &[u8]| {
        out.write_all(bytes).expect("writing to a hash cannot fail");
    };
    match value {
        Value::Object(map) => {
            w(out, b"{");
            let mut first = true;
            let mut emit = |out: &mut W, k: &String, v: &Value| {
                let Some(deeper) = below(k) else { return };
                if !first {
                    w(out, b",");
                }
                first = false;
                serde_json::to_writer(&mut *out, k).expect("writing to a hash cannot fail");
                w(out, b":");
                write_canonical(v, out, &deeper);
            };
            // serde_json's default map iterates in sorted order already; if a build enables
            // `preserve_order`, sort here.
            let sorted = map
                .keys()
                .zip(map.keys().skip(1))
                .all(|(a, b)| a.as_bytes() < b.as_bytes());
            if sorted {
                for (k, v) in map {
                    emit(out, k, v);
                }
            } else {
                let mut entries: Vec<(&String, &Value)> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
                for (k, v) in entries {
                    emit(out, k, v);
                }
            }
            w(out, b"}");
        }
        Value::Array(items) => {
            w(out, b"[");
            let mut first = true;
            for (i, v) in items.iter().enumerate() {
                let deeper = if ignore.is_empty() {
                    Some(Vec::new())
                } else {
                    below(&i.to_string())
                };
                let Some(deeper) = deeper else { continue };
                if !first {
                    w(out, b",");
                }
                first = false;
                write_canonical(v, out, &deeper);
            }
            w(out, b"]");
        }
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to a hash cannot fail"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(cfg: &FingerprintConfig, body: &str) -> Fingerprint {
        let json: Option<Value> = serde_json::from_str(body).ok();
        fingerprint(
            cfg,
            &Method::POST,
            "r",
            "/p?q=1",
            &HeaderMap::new(),
            body.as_bytes(),
            json.as_ref(),
        )
        .unwrap()
    }

    #[test]
    fn raw_bodies_differ_by_whitespace_canonical_ones_do_not() {
        let raw = FingerprintConfig::default();
        assert_ne!(fp(&raw, r#"{"a":1,"b":2}"#), fp(&raw, r#"{"b":2, "a":1}"#));
        let canon = FingerprintConfig {
            json_canonical: true,
            ..Default::default()
        };
        assert_eq!(
            fp(&canon, r#"{"a":1,"b":2}"#),
            fp(&canon, r#"{"b":2, "a":1}"#)
        );
        assert_ne!(fp(&canon, r#"{"a":1}"#), fp(&canon, r#"{"a":2}"#));
    }

    #[test]
    fn canonical_form_is_sorted_compact_and_skips_ignored_members() {
        let v: Value = serde_json::from_str(
            r#"{ "b": [1, {"y": 2, "x": 1}], "a": "s", "skip": {"deep": 1}, "keep": {"deep": 1, "d2": 2} }"#,
        )
        .unwrap();
        let ign = [tokens("/skip"), tokens("/keep/deep"), tokens("/b/0")];
        let ign: Vec<&[Cow<'_, str>]> = ign.iter().map(Vec::as_slice).collect();
        let mut out = Vec::new();
        write_canonical(&v, &mut out, &ign);
        assert_eq!(
            String::from_utf8(out).unwrap(),
            r#"{"a":"s","b":[{"x":1,"y":2}],"keep":{"d2":2}}"#
        );
        assert_eq!(tokens("/a~1b/c~0d"), vec!["a/b", "c~d"]);
    }

    #[test]
    fn numbers_keep_their_precision() {
        let canon = FingerprintConfig {
            json_canonical: true,
            ..Default::default()
        };
        assert_ne!(
            fp(&canon, r#"{"amount":0.30000000000000001}"#),
            fp(&canon, r#"{"amount":0.3}"#)
        );
        assert_ne!(
            fp(&canon, r#"{"n":123456789012345678901234567890}"#),
            fp(&canon, r#"{"n":123456789012345678901234567891}"#)
        );
    }

    #[test]
    fn ignored_pointers_do_not_count() {
        let cfg = FingerprintConfig {
            json_canonical: true,
            json_ignore: vec!["/sent_at".into(), "/meta/trace".into()],
            ..Default::default()
        };
        assert_eq!(
            fp(&cfg, r#"{"a":1,"sent_at":"x","meta":{"trace":1,"k":2}}"#),
            fp(&cfg, r#"{"a":1,"sent_at":"y","meta":{"trace":9,"k":2}}"#)
        );
        assert_ne!(
            fp(&cfg, r#"{"a":1,"meta":{"k":2}}"#),
            fp(&cfg, r#"{"a":1,"meta":{"k":3}}"#)
        );
    }

    #[test]
    fn configured_headers_count() {
        let cfg = FingerprintConfig {
            headers: vec![http::header::CONTENT_TYPE],
            ..Default::default()
        };
        let mut a = HeaderMap::new();
        a.insert("content-type", "application/json".parse().unwrap());
        let run =
            |h: &HeaderMap| fingerprint(&cfg, &Method::POST, "r", "/", h, b"x", None).unwrap();
        assert_ne!(run(&a), run(&HeaderMap::new()));
    }

    #[test]
    fn hex_is_lowercase() {
        assert_eq!(hex(&[0x00, 0xab, 0xff]), "00abff");
        assert_eq!(
            hex(&sha256(b"")),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
