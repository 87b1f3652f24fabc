//! The reader's tests: what it reads and refuses, held against serde_json's reading (the
//! reader the gateway had before) and the quadratic repeated-member check it had before that.

use super::names::SMALL_OBJECT;
use super::*;
use crate::key::{JsonBody, KeyError};
use bytes::Bytes;
use proptest::prelude::*;
use serde_json::Value;

/// A document as serde_json's `Value`, to compare with what serde_json reads.
pub(crate) fn to_value(doc: &Json<'_>) -> Value {
    node_value(doc, doc.root())
}

fn node_value(doc: &Json<'_>, node: Node) -> Value {
    match node {
        Node::Null => Value::Null,
        Node::Bool(b) => Value::Bool(b),
        Node::U64(n) => Value::Number(n.into()),
        Node::I64(n) => Value::Number(n.into()),
        Node::Number(n) => Value::Number(doc.text(n).parse().expect("a number's kept text")),
        Node::Str(s) => Value::String(doc.text(s).to_string()),
        Node::Array(span) => Value::Array(
            doc.items(span)
                .iter()
                .map(|&n| node_value(doc, n))
                .collect(),
        ),
        Node::Object(span) => Value::Object(
            doc.members(span)
                .iter()
                .map(|m| (doc.text(m.name).to_string(), node_value(doc, m.value)))
                .collect(),
        ),
    }
}

#[test]
fn repeated_member_names_are_found_at_any_depth() {
    assert_eq!(has_duplicate_member(br#"{"a":1,"b":2}"#), Some(false));
    assert_eq!(has_duplicate_member(br#"{"a":1,"a":2}"#), Some(true));
    assert_eq!(
        has_duplicate_member(br#"[{"x":{"a":1,"a":1}}]"#),
        Some(true)
    );
    assert_eq!(
        has_duplicate_member(br#"{"a":{"a":1},"b":[1.5e3,"s",null]}"#),
        Some(false)
    );
    // Escapes spell the same name.
    assert_eq!(has_duplicate_member(br#"{"a":1,"\u0061":2}"#), Some(true));
    assert_eq!(has_duplicate_member(b"{\"a\":"), None);
    assert_eq!(has_duplicate_member(b"not json"), None);
    // Both spelled with escapes, and a name escaped only in its second spelling.
    assert_eq!(
        has_duplicate_member(br#"{"\u00e9":1,"x":{"\u00e9":2},"\u00e9":3}"#),
        Some(true)
    );
    assert_eq!(has_duplicate_member(br#"{"ab":1,"a\u0062":2}"#), Some(true));
    assert_eq!(has_duplicate_member(br#"{"a\"":1,"a\\":2}"#), Some(false));
}

/// A body nested `depth` deep: arrays and objects in turn, around `inner`.
fn nested(depth: usize, inner: &str) -> Bytes {
    let mut open = String::new();
    let mut close = String::new();
    for i in 0..depth {
        if i % 2 == 0 {
            open.push('[');
            close.insert(0, ']');
        } else {
            open.push_str(r#"{"k":"#);
            close.insert(0, '}');
        }
    }
    Bytes::from(format!("{open}{inner}{close}"))
}

/// A document `depth` arrays deep around `null`, built without a parser (which refuses
/// one deeper than [`MAX_DEPTH`]).
pub(crate) fn nested_doc(depth: usize) -> Json<'static> {
    let mut items = Vec::new();
    let mut root = Node::Null;
    for _ in 0..depth {
        items.push(root);
        root = Node::Array(Span {
            start: items.len() as u32 - 1,
            len: 1,
            verbatim: 0,
        });
    }
    Json {
        body: "",
        decoded: String::new(),
        verbatim: Vec::new(),
        root,
        items,
        members: Vec::new(),
    }
}

fn parses(raw: &Bytes) -> Result<Value, KeyError> {
    JsonBody::new(raw).get().map(to_value)
}

#[test]
fn nesting_of_128_is_json_and_129_is_not() {
    for inner in ["1", "1.25", r#""s""#, "null"] {
        let ok = nested(MAX_DEPTH - 1, &format!("[{inner}]"));
        assert!(parses(&ok).is_ok(), "{inner}");
        assert_eq!(has_duplicate_member(&ok), Some(false));
        let deep = nested(MAX_DEPTH, &format!("[{inner}]"));
        assert_eq!(parses(&deep), Err(KeyError::NotJson), "{inner}");
        assert_eq!(has_duplicate_member(&deep), None);
    }
    // Objects all the way down, and arrays all the way down.
    for (open, close) in [(r#"{"a":"#, "}"), ("[", "]")] {
        let at =
            |depth: usize| Bytes::from(format!("{}0{}", open.repeat(depth), close.repeat(depth)));
        assert!(parses(&at(MAX_DEPTH)).is_ok());
        assert_eq!(has_duplicate_member(&at(MAX_DEPTH)), Some(false));
        assert_eq!(parses(&at(MAX_DEPTH + 1)), Err(KeyError::NotJson));
        assert_eq!(has_duplicate_member(&at(MAX_DEPTH + 1)), None);
        // Far deeper: refused, not a stack overflow.
        assert_eq!(parses(&at(100_000)), Err(KeyError::NotJson));
        assert_eq!(has_duplicate_member(&at(100_000)), None);
    }
    // A repeated member as deep as a body may go is still found.
    let repeated = nested(MAX_DEPTH - 1, r#"{"a":1,"a":2}"#);
    assert_eq!(has_duplicate_member(&repeated), Some(true));
    assert_eq!(parses(&repeated), Err(KeyError::NotJson));
    // The value read at depth 128 is the one serde_json reads at 127, one level down.
    let v = parses(&nested(MAX_DEPTH, "0.30000000000000001")).unwrap();
    let mut inner = &v;
    for _ in 0..MAX_DEPTH {
        inner = match inner {
            Value::Array(items) => &items[0],
            Value::Object(members) => &members["k"],
            other => panic!("not nested: {other}"),
        };
    }
    assert_eq!(inner.to_string(), "0.30000000000000001");
}

/// `{"k0":0,"k1":1,…}` with `n` members, then `last` as its last member.
fn wide(n: usize, last: &str) -> String {
    let mut s = String::from("{");
    for i in 0..n {
        s.push_str(&format!(r#""k{i}":{i},"#));
    }
    s.push_str(last);
    s.push('}');
    s
}

#[test]
fn a_wide_object_with_its_last_member_repeated_is_refused() {
    for body in [
        wide(50_000, r#""k0":true"#),
        wide(50_000, r#""k49999":true"#),
        format!("[{}]", wide(50_000, r#""k25000":true"#)),
        format!(r#"{{"a":{}}}"#, wide(50_000, r#""k7":true"#)),
    ] {
        let raw = Bytes::from(body);
        assert_eq!(has_duplicate_member(&raw), Some(true));
        assert_eq!(parses(&raw), Err(KeyError::NotJson));
    }
    for body in [
        wide(50_000, r#""k50000":true"#),
        format!("[{}]", wide(50_000, r#""last":true"#)),
    ] {
        let raw = Bytes::from(body);
        assert_eq!(has_duplicate_member(&raw), Some(false));
        let v = parses(&raw).unwrap();
        let members = v.as_object().or_else(|| v[0].as_object()).unwrap();
        assert_eq!(members.len(), 50_001);
    }
}

#[test]
fn escaped_names_are_one_name_in_small_and_wide_objects() {
    for n in [0, 3, SMALL_OBJECT - 1, SMALL_OBJECT, SMALL_OBJECT + 1, 1000] {
        for (a, b) in [
            (r#""a""#, r#""\u0061""#),
            (r#""\u0061""#, r#""a""#),
            (r#""\u00e9""#, r#""é""#),
            (r#""\ud83d\ude00""#, r#""😀""#),
            (r#""a\/b""#, r#""a/b""#),
        ] {
            let last = format!("{b}:2");
            let body = wide(n, &format!("{a}:1,{last}"));
            for raw in [body.clone(), format!("[{body}]")] {
                let raw = Bytes::from(raw);
                assert_eq!(has_duplicate_member(&raw), Some(true), "{n} {a} {b}");
                assert_eq!(parses(&raw), Err(KeyError::NotJson), "{n} {a} {b}");
            }
        }
        // Names that only look alike are different names.
        let body = wide(n, r#""a\"":1,"a\\":2,"A":3,"a":4"#);
        for raw in [body.clone(), format!("[{body}]")] {
            let raw = Bytes::from(raw);
            assert_eq!(has_duplicate_member(&raw), Some(false), "{n}");
            assert!(parses(&raw).is_ok());
        }
    }
}

#[test]
fn containers_written_as_canonical_say_so() {
    let verbatim = |text: &str| {
        let raw = Bytes::from(text.to_owned());
        let doc = Json::parse(&raw).unwrap();
        let node = doc.root();
        match node {
            Node::Array(span) | Node::Object(span) => doc.verbatim(span).map(str::to_owned),
            _ => None,
        }
    };
    let canonical = r#"{"a":[1,-2.5e-3,{"b":null}],"c":"xé","é":[]}"#;
    assert_eq!(verbatim(canonical).as_deref(), Some(canonical));
    assert_eq!(verbatim(" [1] ").as_deref(), Some("[1]"));
    for written_otherwise in [
        r#"{"a":1, "b":2}"#,
        r#"{"b":1,"a":2}"#,
        r#"["\n"]"#,
        r#"{"\u0061":1}"#,
        "[1E2]",
        "[1e2]",
        r#"[{"$serde_json::private::Number":"5"}]"#,
        r#"[[1],[2 ]]"#,
    ] {
        assert_eq!(verbatim(written_otherwise), None, "{written_otherwise}");
    }
}

#[test]
fn one_pass_reads_what_serde_json_reads() {
    let same = [
        r#"{"amount":0.30000000000000001,"n":123456789012345678901234567890}"#,
        r#" [ 1 , -0 , -1.5e300 , 1E2 , 18446744073709551616 , "x\n\u0000" ] "#,
        "\t{\r\n}\n",
        "[]",
        r#""top""#,
        " 12 ",
        "-0.0",
        "true",
        "null",
        r#"{"a":{"b":[{"c":null}]},"d":"\ud83d\ude00"}"#,
        // serde_json reads this object as the number 5, at any depth.
        r#"{"$serde_json::private::Number":"5"}"#,
        r#"[{"$serde_json::private::Number":"5.50"}]"#,
    ];
    for text in same {
        let want: Value = serde_json::from_str(text).unwrap();
        let got = parses(&Bytes::from(text)).unwrap();
        assert_eq!(got, want, "{text}");
        assert_eq!(got.to_string(), want.to_string(), "{text}");
    }
    let not_json = [
        "",
        " ",
        "[1,]",
        "[,1]",
        "[1 2]",
        "[1}",
        r#"{"a":1,}"#,
        r#"{"a" 1}"#,
        r#"{"a":}"#,
        "{1:2}",
        r#"{"a":1"#,
        "[1]]",
        "[1] x",
        "1x",
        "[1x]",
        "[tru]",
        r#"["a"1]"#,
        r#"{"a":1"b":2}"#,
        r#"{"$serde_json::private::Number":"x"}"#,
        r#"{"$serde_json::private::Number":"5","b":1}"#,
        "\u{feff}{}",
    ];
    for text in not_json {
        let raw = Bytes::from(text);
        assert!(serde_json::from_str::<Value>(text).is_err(), "{text}");
        assert_eq!(parses(&raw), Err(KeyError::NotJson), "{text}");
    }
    // Not JSON, but repeated before it stops being JSON: the check says repeated.
    assert_eq!(has_duplicate_member(br#"{"a":1,"a":[}"#), Some(true));
    assert_eq!(has_duplicate_member(b"[1,]"), None);
}

/// The quadratic check this module had before, for comparison: a visitor that compares
/// every name with every earlier one, under serde_json's own limits.
fn reference_has_duplicate_member(raw: &[u8]) -> Option<bool> {
    struct Walk;
    impl<'de> serde::de::DeserializeSeed<'de> for Walk {
        type Value = ();
        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
            d.deserialize_any(self)
        }
    }
    impl<'de> serde::de::Visitor<'de> for Walk {
        type Value = ();
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("JSON")
        }
        fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
            let mut seen: Vec<String> = Vec::new();
            while let Some(name) = map.next_key::<String>()? {
                if seen.contains(&name) {
                    return Err(serde::de::Error::custom("repeated"));
                }
                seen.push(name);
                map.next_value_seed(Walk)?;
            }
            Ok(())
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
            while seq.next_element_seed(Walk)?.is_some() {}
            Ok(())
        }
        fn visit_bool<E>(self, _: bool) -> Result<(), E> {
            Ok(())
        }
        fn visit_i64<E>(self, _: i64) -> Result<(), E> {
            Ok(())
        }
        fn visit_u64<E>(self, _: u64) -> Result<(), E> {
            Ok(())
        }
        fn visit_f64<E>(self, _: f64) -> Result<(), E> {
            Ok(())
        }
        fn visit_str<E>(self, _: &str) -> Result<(), E> {
            Ok(())
        }
        fn visit_unit<E>(self) -> Result<(), E> {
            Ok(())
        }
    }
    use serde::de::DeserializeSeed as _;
    let mut de = serde_json::Deserializer::from_slice(raw);
    match Walk.deserialize(&mut de).and_then(|()| de.end()) {
        Ok(()) => Some(false),
        Err(e) if e.is_data() => Some(true),
        Err(_) => None,
    }
}

/// JSON-like text: values with random white space, escapes and names drawn from a few
/// (so that some repeat), some of it then cut or spliced.
pub(crate) fn json_text() -> impl Strategy<Value = String> {
    let ws = prop::sample::select(vec!["", "", " ", "\n", "\t ", "\r\n"]);
    let name = prop::sample::select(vec![
        r#""a""#,
        r#""\u0061""#,
        r#""b""#,
        r#""a\"""#,
        r#""é""#,
        r#""\u00e9""#,
        r#""""#,
        r#""c""#,
        r#""d""#,
        r#""k1""#,
        r#""K""#,
        r#""\u0000""#,
        r#""zz""#,
        r#""~1""#,
    ]);
    let leaf = prop::sample::select(vec![
        "0",
        "-1",
        "1.5",
        "1e400",
        "123456789012345678901234567890",
        "0.30000000000000001",
        "true",
        "false",
        "null",
        r#""s""#,
        r#""\n\u0000\\""#,
        r#""\u007f\/\b\f\u2028é""#,
        "[]",
        "{}",
        // Numbers serde_json keeps respelled, or at the edges of 64 bits.
        "1E2",
        "2e5",
        "-1.5E-3",
        "-0",
        "-0.0",
        "-9223372036854775808",
        "-9223372036854775809",
        "18446744073709551615",
        "18446744073709551616",
        // Surrogates, paired and (not JSON to serde_json) alone.
        r#""\ud83d\ude00\uD83D\uDE00""#,
        r#""\ud800""#,
        r#""\udc00x""#,
    ])
    .prop_map(str::to_string);
    let value = leaf.prop_recursive(5, 64, 8, move |inner| {
        let ws = ws.clone();
        prop_oneof![
            prop::collection::vec((inner.clone(), ws.clone()), 0..8).prop_map(|items| {
                let items: Vec<String> = items
                    .into_iter()
                    .map(|(v, w)| format!("{w}{v}{w}"))
                    .collect();
                format!("[{}]", items.join(","))
            }),
            prop::collection::vec((name.clone(), inner, ws), 0..8).prop_map(|members| {
                let members: Vec<String> = members
                    .into_iter()
                    .map(|(n, v, w)| format!("{w}{n}{w}:{w}{v}"))
                    .collect();
                format!("{{{}}}", members.join(","))
            }),
        ]
    });
    (value, any::<u16>(), 0u8..6).prop_map(|(text, at, how)| mangle(text, at, how))
}

/// Some texts cut short or spliced at `at` (`how` below 3), the others as they are.
fn mangle(text: String, at: u16, how: u8) -> String {
    let at = at as usize % (text.len() + 1);
    let at = (0..=at)
        .rev()
        .find(|&i| text.is_char_boundary(i))
        .unwrap_or(0);
    match how {
        0 => format!(
            "{}{}",
            &text[..at],
            &text[at..].replacen(['}', ']', ','], "", 1)
        ),
        1 => format!("{},{}", &text[..at], &text[at..]),
        2 => text[..at].to_string(),
        _ => text,
    }
}

/// Wide objects (past the 16 members that are compared one by one), with names drawn from
/// 48 (some spelled with escapes), in the order drawn, sorted, or sorted but for a few;
/// sometimes inside an array or another object, and cut or spliced as [`json_text`] is.
fn wide_text() -> impl Strategy<Value = String> {
    let member = (0usize..48, any::<bool>(), 0u8..4);
    let object = (prop::collection::vec(member, 0..80), 0u8..4, any::<u16>()).prop_map(
        |(mut members, order, swap)| {
            if order > 0 {
                members.sort_by_key(|m| m.0);
            }
            if order == 2 {
                members.dedup_by_key(|m| m.0);
            }
            if order == 3 && members.len() > 2 {
                let last = members.len() - 1;
                members.swap(swap as usize % last, last);
            }
            let members: Vec<String> = members
                .into_iter()
                .map(|(n, escaped, v)| {
                    let name = if escaped {
                        format!(r#""\u006e{n:02}""#)
                    } else {
                        format!(r#""n{n:02}""#)
                    };
                    let value = ["1", r#""v""#, "[]", r#"{"x":null}"#][v as usize];
                    format!("{name}:{value}")
                })
                .collect();
            format!("{{{}}}", members.join(","))
        },
    );
    (object, 0u8..3, any::<u16>(), 0u8..6).prop_map(|(object, wrap, at, how)| {
        let text = match wrap {
            0 => object,
            1 => format!("[{object},{object}]"),
            _ => format!(r#"{{"a":{object},"b":1}}"#),
        };
        mangle(text, at, how)
    })
}

/// The deepest nesting of arrays and objects in a text (outside its strings).
fn bracket_depth(text: &str) -> usize {
    let (mut depth, mut deepest, mut in_string, mut escape) = (0usize, 0, false, false);
    for b in text.bytes() {
        match (in_string, b) {
            (true, _) if escape => escape = false,
            (true, b'\\') => escape = true,
            (true, b'"') | (false, b'"') => in_string = !in_string,
            (false, b'[' | b'{') => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            (false, b']' | b'}') => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    deepest
}

/// `value` inside `levels` arrays and objects, as [`nested`] writes them.
fn nested_value(levels: usize, mut value: Value) -> Value {
    for level in (0..levels).rev() {
        value = if level % 2 == 0 {
            Value::Array(vec![value])
        } else {
            serde_json::json!({ "k": value })
        };
    }
    value
}

proptest! {
    #[test]
    fn the_one_pass_agrees_with_serde_json_and_the_quadratic_check(text in json_text()) {
        let raw = Bytes::from(text.clone());
        let repeated = reference_has_duplicate_member(&raw);
        let serde: Option<Value> = serde_json::from_str(&text).ok();
        // Either may stop first at a repeated name, before the text stops being JSON.
        if serde.is_some() {
            prop_assert!(repeated.is_some());
        }
        if repeated == Some(false) {
            prop_assert!(serde.is_some());
        }
        prop_assert_eq!(has_duplicate_member(&raw), repeated);
        let mut body = JsonBody::new(&raw);
        let parsed = body.get().ok();
        let want = serde.filter(|_| repeated == Some(false));
        prop_assert_eq!(
            parsed.map(|doc| to_value(doc).to_string()),
            want.as_ref().map(Value::to_string)
        );
        // Pointers find what serde_json's find.
        if let (Some(doc), Some(want)) = (parsed, &want) {
            for ptr in ["", "/", "/a", "/b", "/0", "/1", "/00", "/a/0", "/b/a", "/0/a", "/é", "/a\"", "/~0", "/1/0/0"] {
                prop_assert_eq!(
                    doc.pointer(ptr).map(|n| node_value(doc, n)),
                    want.pointer(ptr).cloned(),
                    "{}", ptr
                );
            }
        }
    }
}

proptest! {
    #[test]
    fn wide_objects_agree_with_serde_json_and_the_quadratic_check(text in wide_text()) {
        let raw = Bytes::from(text.clone());
        let repeated = reference_has_duplicate_member(&raw);
        prop_assert_eq!(has_duplicate_member(&raw), repeated);
        let serde: Option<Value> = serde_json::from_str(&text).ok();
        let want = serde.filter(|_| repeated == Some(false));
        prop_assert_eq!(parses(&raw).ok(), want);
    }

    #[test]
    fn nesting_is_counted_to_128_whatever_is_inside(
        text in json_text(),
        extra in 0usize..3,
    ) {
        // Texts serde_json reads (repeats or not), wrapped to 127, 128 and 129 levels.
        let inner = Bytes::from(text.clone());
        if serde_json::from_str::<Value>(&text).is_err() {
            return Ok(());
        }
        let depth = bracket_depth(&text);
        let levels = MAX_DEPTH + extra - depth.max(1);
        let raw = nested(levels, &text);
        if depth + levels <= MAX_DEPTH {
            prop_assert_eq!(has_duplicate_member(&raw), has_duplicate_member(&inner));
            let want = parses(&inner).ok().map(|v| nested_value(levels, v));
            prop_assert_eq!(parses(&raw).ok(), want);
        } else if has_duplicate_member(&inner) == Some(false) {
            prop_assert_eq!(has_duplicate_member(&raw), None);
            prop_assert_eq!(parses(&raw), Err(KeyError::NotJson));
        }
    }
}
