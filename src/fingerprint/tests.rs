use super::*;
use bytes::Bytes;
use proptest::prelude::*;
use serde_json::Value;

use crate::json::tests::{json_text, nested_doc};
use crate::key::JsonBody;

fn fp(cfg: &FingerprintConfig, body: &str) -> Fingerprint {
    let raw = Bytes::from(body.to_owned());
    let mut json = JsonBody::new(&raw);
    fingerprint(
        cfg,
        &Method::POST,
        "r",
        "/p?q=1",
        &HeaderMap::new(),
        body.as_bytes(),
        json.value(),
    )
    .unwrap()
}

/// The canonical form of a JSON text, without the members and elements `ignore` names.
fn canon(text: &str, ignore: &[&str]) -> String {
    let raw = Bytes::from(text.to_owned());
    let mut json = JsonBody::new(&raw);
    let ign: Vec<Vec<Cow<'_, str>>> = ignore.iter().map(|p| tokens(p)).collect();
    let ign: Vec<&[Cow<'_, str>]> = ign.iter().map(Vec::as_slice).collect();
    let mut out = Vec::new();
    write_canonical(json.get().unwrap(), &mut out, &ign).unwrap();
    String::from_utf8(out).unwrap()
}

/// The canonical form as this module wrote it from a `serde_json::Value` before it had a
/// document of its own: what the fingerprints stored so far were computed from.
fn reference(value: &Value, out: &mut Vec<u8>, ignore: &[&[Cow<'_, str>]]) {
    let below = |name: &str| -> Option<Vec<&[Cow<'_, str>]>> {
        let mut deeper = Vec::new();
        for p in ignore {
            if let Some((first, rest)) = p.split_first()
                && first == name
            {
                if rest.is_empty() {
                    return None;
                }
                deeper.push(rest);
            }
        }
        Some(deeper)
    };
    match value {
        Value::Object(map) => {
            out.push(b'{');
            let mut entries: Vec<(&String, &Value)> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
            let mut first = true;
            for (k, v) in entries {
                let Some(deeper) = below(k) else { continue };
                if !first {
                    out.push(b',');
                }
                first = false;
                serde_json::to_writer(&mut *out, k).unwrap();
                out.push(b':');
                reference(v, out, &deeper);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            let mut first = true;
            for (i, v) in items.iter().enumerate() {
                let Some(deeper) = below(&i.to_string()) else {
                    continue;
                };
                if !first {
                    out.push(b',');
                }
                first = false;
                reference(v, out, &deeper);
            }
            out.push(b']');
        }
        scalar => serde_json::to_writer(&mut *out, scalar).unwrap(),
    }
}

proptest! {
    #[test]
    fn the_canonical_form_is_the_one_fingerprints_were_computed_from(
        text in json_text(),
        ignore in prop::sample::subsequence(
            vec!["/a", "/b", "/0", "/1", "/a/0", "/a/a", "/0/b", "/1/0", "/", "/é"],
            0..4,
        ),
    ) {
        let raw = Bytes::from(text.clone());
        let mut json = JsonBody::new(&raw);
        if let Some(doc) = json.value() {
            let value: Value = serde_json::from_str(&text).unwrap();
            let ign: Vec<Vec<Cow<'_, str>>> = ignore.iter().map(|p| tokens(p)).collect();
            let ign: Vec<&[Cow<'_, str>]> = ign.iter().map(Vec::as_slice).collect();
            let mut want = Vec::new();
            reference(&value, &mut want, &ign);
            let mut got = Vec::new();
            write_canonical(doc, &mut got, &ign).unwrap();
            prop_assert_eq!(String::from_utf8(got).unwrap(), String::from_utf8(want).unwrap());
        }
    }
}

proptest! {
    #[test]
    fn a_canonical_text_is_its_own_canonical_form(text in json_text()) {
        // serde_json writes a value compact, names sorted (its map is ordered), numbers
        // as kept: the canonical form, which the document copies where it can.
        let Ok(value) = serde_json::from_str::<Value>(&text) else {
            return Ok(());
        };
        let compact = value.to_string();
        prop_assert_eq!(canon(&compact, &[]), compact.clone());
        let mut want = Vec::new();
        reference(&value, &mut want, &[]);
        prop_assert_eq!(compact.into_bytes(), want);
    }
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
    assert_eq!(
        canon(
            r#"{ "b": [1, {"y": 2, "x": 1}], "a": "s", "skip": {"deep": 1}, "keep": {"deep": 1, "d2": 2} }"#,
            &["/skip", "/keep/deep", "/b/0"],
        ),
        r#"{"a":"s","b":[{"x":1,"y":2}],"keep":{"d2":2}}"#
    );
    // Names sort by their bytes once unescaped; strings and numbers are written as
    // serde_json writes them (`1E2` as serde_json keeps it).
    assert_eq!(
        canon(
            r#"{"\u00e9":1,"z":-0,"\u0041":"\u00e9\/\n","":[1E2,-0.0,18446744073709551616]}"#,
            &[]
        ),
        "{\"\":[1e+2,-0.0,18446744073709551616],\"A\":\"é/\\n\",\"z\":-0,\"é\":1}"
    );
    let integers = "[0,-1,7,-9223372036854775808,9223372036854775807,18446744073709551615]";
    assert_eq!(canon(integers, &[]), integers);
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
fn canonical_form_is_bounded_in_depth() {
    let mut out = Vec::new();
    write_canonical(&nested_doc(MAX_DEPTH), &mut out, &[]).unwrap();
    assert_eq!(out.len(), 2 * MAX_DEPTH + 4);
    for depth in [MAX_DEPTH + 1, 100_000] {
        let deep = nested_doc(depth);
        assert_eq!(
            write_canonical(&deep, &mut Vec::new(), &[]),
            Err(FingerprintError::NotJson)
        );
    }
    let cfg = FingerprintConfig {
        json_canonical: true,
        ..Default::default()
    };
    let run = |depth: usize| {
        let doc = nested_doc(depth);
        fingerprint(
            &cfg,
            &Method::POST,
            "r",
            "/",
            &HeaderMap::new(),
            b"",
            Some(&doc),
        )
    };
    assert!(run(MAX_DEPTH).is_ok());
    assert_eq!(run(MAX_DEPTH + 1), Err(FingerprintError::NotJson));
}

#[test]
fn the_hash_writer_buffers_without_changing_the_hash() {
    // A string of escapes is written a byte or two at a time; a long one in one piece.
    let text = format!(
        r#"{{"e":"{}","long":"{}","n":[1,2.5]}}"#,
        r#"\n\t\""#.repeat(5000),
        "x".repeat(3 * HashWriter::BUFFER)
    );
    let raw = Bytes::from(text);
    let mut json = JsonBody::new(&raw);
    let doc = json.get().unwrap();
    let mut plain = Vec::new();
    write_canonical(doc, &mut plain, &[]).unwrap();
    let mut h = Sha256::new();
    let mut w = HashWriter::new(&mut h);
    write_canonical(doc, &mut w, &[]).unwrap();
    assert_eq!(w.finish(), plain.len() as u64);
    assert_eq!(<[u8; 32]>::from(h.finalize()), sha256(&plain));
}

#[test]
fn writes_of_every_short_length_hash_as_their_bytes() {
    // Each length up to past the short copies' 16 bytes, again and again: the buffer fills
    // and spills at every place in a write.
    let bytes: Vec<u8> = (0..=255u8).cycle().take(64).collect();
    let mut written = Vec::new();
    let mut h = Sha256::new();
    let mut w = HashWriter::new(&mut h);
    for round in 0..400 {
        for len in 0..=20 {
            let piece = &bytes[(round + len) % 40..][..len];
            w.put(piece);
            written.extend_from_slice(piece);
        }
    }
    assert!(written.len() > 2 * HashWriter::BUFFER);
    assert_eq!(w.finish(), written.len() as u64);
    assert_eq!(<[u8; 32]>::from(h.finalize()), sha256(&written));
}

#[test]
fn ignored_array_elements_are_named_by_their_index() {
    assert_eq!(
        canon(
            r#"{"a": [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, {"x": 1, "y": 2}]}"#,
            &["/a/1", "/a/01", "/a/10", "/a/11/x"],
        ),
        r#"{"a":[0,2,3,4,5,6,7,8,9,{"y":2}]}"#
    );
    assert!(is_index("0") && is_index("10") && !is_index("01") && !is_index("-1"));
    assert!(!is_index("") && !is_index("1a"));
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
    let run = |h: &HeaderMap| fingerprint(&cfg, &Method::POST, "r", "/", h, b"x", None).unwrap();
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
