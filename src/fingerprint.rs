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
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::config::FingerprintConfig;
use crate::problem::GatewayError;

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

/// The fingerprint of one request. `json` is the parsed body when the route needs it.
pub fn fingerprint(
    cfg: &FingerprintConfig,
    method: &Method,
    route: &str,
    path_and_query: &str,
    headers: &HeaderMap,
    body: &[u8],
    json: Option<&Value>,
) -> Result<Fingerprint, GatewayError> {
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
        let json = json.ok_or(GatewayError::BodyNotJson)?;
        let mut buf = Vec::with_capacity(body.len());
        if cfg.json_ignore.is_empty() {
            write_canonical(json, &mut buf);
        } else {
            let mut pruned = json.clone();
            for ptr in &cfg.json_ignore {
                remove_pointer(&mut pruned, ptr);
            }
            write_canonical(&pruned, &mut buf);
        }
        part(&mut h, &buf);
    } else {
        part(&mut h, body);
    }
    Ok(h.finalize().into())
}

/// Removes the value at an RFC 6901 pointer, if present.
fn remove_pointer(value: &mut Value, ptr: &str) {
    let Some((parent, last)) = ptr.rsplit_once('/') else {
        return;
    };
    let last = last.replace("~1", "/").replace("~0", "~");
    match value.pointer_mut(parent) {
        Some(Value::Object(map)) => {
            map.remove(&last);
        }
        Some(Value::Array(items)) => {
            if let Ok(i) = last.parse::<usize>()
                && i < items.len()
            {
                items.remove(i);
            }
        }
        _ => {}
    }
}

/// Canonical JSON: sorted keys, compact. Independent of serde_json's map ordering feature.
pub fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, k).expect("writing to a Vec cannot fail");
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar).expect("writing to a Vec cannot fail"),
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
