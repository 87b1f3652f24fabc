//! Request path normalization (docs/contract.md §8.1): one request, one spelling.
//!
//! A legacy stack behind nginx routes `/a/b`, `/a//b`, `/a/./b`, `/a/x/../b` and `/a/%62`
//! to one handler. If the gateway matched the raw spelling, a redelivery spelled another way
//! would miss a keyed route and be forwarded a second time on a catch-all. So the path is
//! normalized once, before routing, and the normalized form is what is matched,
//! fingerprinted and forwarded (the query string is untouched):
//!
//! 1. Percent-encoded *unreserved* characters (RFC 3986 section 2.3: `A-Z a-z 0-9 - . _ ~`)
//!    are decoded; the hexadecimal digits of every other escape are uppercased (`%2f` →
//!    `%2F`, never decoded: an encoded slash is data, not a separator).
//! 2. Runs of slashes are merged.
//! 3. `.` and `..` segments are resolved (RFC 3986 section 5.2.4); a `..` above the root is
//!    refused ([`PathInvalid`]), never clamped.
//!
//! Invariants: the result starts with `/`; normalizing it again changes nothing; a path
//! that needs no change is returned borrowed (no allocation on the common path).
//!
//! Backends read more spellings as one path than the normalization above merges: Werkzeug,
//! gunicorn and uvicorn decode `%2F`; Tomcat and Spring drop `;parameters` from segments;
//! IIS and ASP.NET match without case. [`lenient`] is that reading (docs/guarantees.md, "no
//! spelling around a key"): the gateway refuses a request whose lenient reading would reach
//! a keyed route when its own reading does not, instead of forwarding it unkeyed.

use std::borrow::Cow;

/// A path that cannot be normalized: a `..` segment climbs above the root.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the path climbs above the root with '..'")]
pub struct PathInvalid;

/// Whether a byte is an RFC 3986 unreserved character.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex_value(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// Whether `path` is already in normal form (the fast check every request pays).
fn is_normal(path: &[u8]) -> bool {
    if path.first() != Some(&b'/') {
        return false;
    }
    let mut i = 0;
    while i < path.len() {
        match path[i] {
            b'%' => return false,
            b'/' => {
                // `//`, `/.` followed by `/` or the end, `/..` likewise.
                let rest = &path[i + 1..];
                if rest.first() == Some(&b'/') {
                    return false;
                }
                let seg_end = rest.iter().position(|&b| b == b'/').unwrap_or(rest.len());
                let seg = &rest[..seg_end];
                if seg == b"." || seg == b".." {
                    return false;
                }
            }
            _ => {}
        }
        i += 1;
    }
    true
}

/// Normalizes a request path (see the module docs). `path` is the path component only.
pub fn normalize(path: &str) -> Result<Cow<'_, str>, PathInvalid> {
    if is_normal(path.as_bytes()) {
        return Ok(Cow::Borrowed(path));
    }
    // 1. Escapes: decode unreserved, uppercase the rest. The output stays ASCII-compatible:
    //    only unreserved (ASCII) bytes are ever decoded.
    let b = path.as_bytes();
    let mut decoded = String::with_capacity(b.len() + 1);
    if b.first() != Some(&b'/') {
        decoded.push('/');
    }
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(hi), Some(lo)) = (hex_value(b[i + 1]), hex_value(b[i + 2]))
        {
            let v = hi * 16 + lo;
            if unreserved(v) {
                decoded.push(v as char);
            } else {
                decoded.push('%');
                decoded.push(b[i + 1].to_ascii_uppercase() as char);
                decoded.push(b[i + 2].to_ascii_uppercase() as char);
            }
            i += 3;
            continue;
        }
        // Not an escape (or a malformed one, kept as it is): copy the whole character.
        let ch = path[i..].chars().next().expect("i is on a char boundary");
        decoded.push(ch);
        i += ch.len_utf8();
    }
    // 2 and 3. Segments: empty ones (repeated slashes) and `.` dropped, `..` pops.
    resolve(&decoded, false).map(Cow::Owned).ok_or(PathInvalid)
}

/// Resolves the segments of a path whose escapes are settled: empty ones (repeated slashes)
/// and `.` are dropped, `..` pops the one before it. A `..` above the root is `None`, or,
/// with `clamp`, stays at the root. A trailing slash (or `.`, `..`) is kept as one slash.
fn resolve(path: &str, clamp: bool) -> Option<String> {
    let trailing =
        path.ends_with('/') || path.ends_with("/.") || path.ends_with("/..") || path == "/";
    let mut segments: Vec<&str> = Vec::new();
    for seg in path.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                if segments.pop().is_none() && !clamp {
                    return None;
                }
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(path.len());
    for seg in &segments {
        out.push('/');
        out.push_str(seg);
    }
    if trailing || out.is_empty() {
        out.push('/');
    }
    Some(out)
}

/// Whether a normalized path may read differently to a lenient backend: it holds an escape,
/// a backslash, a `;` or an upper-case ASCII letter. Paths without any need no second look.
pub fn may_read_otherwise(path: &str) -> bool {
    path.bytes()
        .any(|b| matches!(b, b'%' | b'\\' | b';') || b.is_ascii_uppercase())
}

/// The lenient reading of a normalized path: `%2F` decoded to `/`, `%5C` and a backslash
/// read as `/`, `;...` dropped from every segment, normalized again, ASCII letters
/// lower-cased (compare it with lower-cased route paths). A `..` that the decoded slashes
/// make climb above the root stays at the root, as most servers clamp it.
pub fn lenient(path: &str) -> String {
    let b = path.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut in_params = false;
    let mut i = 0;
    while i < b.len() {
        let (c, step) = match b[i] {
            b'%' if i + 2 < b.len() => {
                match (b[i + 1].to_ascii_uppercase(), b[i + 2].to_ascii_uppercase()) {
                    (b'2', b'F') | (b'5', b'C') => (b'/', 3),
                    _ => (b'%', 1),
                }
            }
            b'\\' => (b'/', 1),
            other => (other, 1),
        };
        i += step;
        if c == b'/' {
            in_params = false;
        } else if c == b';' {
            in_params = true;
        }
        if in_params {
            continue;
        }
        if c.is_ascii() {
            out.push(c as char);
        } else {
            // A multi-byte character: copy it whole (it was not an escape or a separator).
            let ch = path[i - step..].chars().next().expect("on a char boundary");
            out.push(ch);
            i += ch.len_utf8() - 1;
        }
    }
    // The input was normalized: its unreserved escapes are decoded already, so resolving
    // the segments is all that is left.
    let mut read = resolve(&out, true).unwrap_or_else(|| "/".to_string());
    read.make_ascii_lowercase();
    read
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn spellings_of_one_path_normalize_to_it() {
        for raw in [
            "/webhooks/payments",
            "/webhooks//payments",
            "//webhooks/payments",
            "/webhooks/%70ayments",
            "/webhooks/./payments",
            "/webhooks/x/../payments",
            "/%77ebhooks/payments",
            "/webhooks/%2e/payments",
            "/webhooks/x/%2E%2E/payments",
        ] {
            assert_eq!(normalize(raw).unwrap(), "/webhooks/payments", "{raw}");
        }
    }

    #[test]
    fn reserved_escapes_stay_encoded_in_upper_case() {
        assert_eq!(normalize("/a%2fb").unwrap(), "/a%2Fb");
        assert_eq!(normalize("/a%2Fb").unwrap(), "/a%2Fb");
        assert_eq!(normalize("/caf%c3%a9").unwrap(), "/caf%C3%A9");
        // A malformed escape is kept as it is.
        assert_eq!(normalize("/a%zz").unwrap(), "/a%zz");
        assert_eq!(normalize("/a%4").unwrap(), "/a%4");
    }

    #[test]
    fn trailing_slashes_are_kept_and_roots_stay_roots() {
        assert_eq!(normalize("/a/").unwrap(), "/a/");
        assert_eq!(normalize("/a//").unwrap(), "/a/");
        assert_eq!(normalize("/a/.").unwrap(), "/a/");
        assert_eq!(normalize("/a/b/..").unwrap(), "/a/");
        assert_eq!(normalize("/").unwrap(), "/");
        assert_eq!(normalize("//").unwrap(), "/");
        assert_eq!(normalize("/.").unwrap(), "/");
        assert_eq!(normalize("/a/..").unwrap(), "/");
    }

    #[test]
    fn climbing_above_the_root_is_refused() {
        assert_eq!(normalize("/.."), Err(PathInvalid));
        assert_eq!(normalize("/a/../.."), Err(PathInvalid));
        assert_eq!(normalize("/%2e%2e/etc"), Err(PathInvalid));
    }

    #[test]
    fn the_lenient_reading_is_what_lenient_backends_route() {
        for (raw, read) in [
            ("/webhooks%2Fpayments", "/webhooks/payments"),
            ("/webhooks%2fpayments", "/webhooks/payments"),
            ("/webhooks%5Cpayments", "/webhooks/payments"),
            ("/webhooks\\payments", "/webhooks/payments"),
            ("/webhooks;v=1/payments", "/webhooks/payments"),
            ("/webhooks/payments;jsessionid=x", "/webhooks/payments"),
            ("/WebHooks/Payments", "/webhooks/payments"),
            ("/a%2F..%2Fb", "/b"),
            ("/a%2F..%2F..%2F..%2Fb", "/b"),
            ("/caf%C3%A9", "/caf%c3%a9"),
            ("/x%", "/x%"),
            ("/a/", "/a/"),
        ] {
            assert_eq!(lenient(raw), read, "{raw}");
        }
        assert!(!may_read_otherwise("/webhooks/payments"));
        for p in ["/a%2Fb", "/a\\b", "/a;b", "/A"] {
            assert!(may_read_otherwise(p), "{p}");
        }
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize("/a/b.c/d_e~f"), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a/..b/c."), Ok(Cow::Borrowed(_))));
        assert!(matches!(normalize("/a//b"), Ok(Cow::Owned(_))));
    }

    /// One of the spellings a client or a proxy may use for a segment character.
    fn spell(c: char) -> impl Strategy<Value = String> {
        let plain = c.to_string();
        let lower = format!("%{:02x}", c as u32);
        let upper = format!("%{:02X}", c as u32);
        prop_oneof![Just(plain), Just(lower), Just(upper)]
    }

    /// A path of segments, each character spelled one of several ways, with extra slashes,
    /// `.` segments and `x/..` detours sprinkled in.
    fn spellings(segments: Vec<String>) -> impl Strategy<Value = String> {
        let parts: Vec<_> = segments
            .into_iter()
            .map(|seg| {
                let chars: Vec<_> = seg.chars().map(spell).collect();
                (
                    chars,
                    prop_oneof![Just("/"), Just("//"), Just("/./"), Just("/zz/../")],
                )
            })
            .collect();
        parts.prop_map(|parts| {
            let mut s = String::new();
            for (chars, sep) in parts {
                s.push_str(sep);
                for c in chars {
                    s.push_str(&c);
                }
            }
            s
        })
    }

    proptest! {
        #[test]
        fn every_spelling_normalizes_to_the_plain_path(
            (plain, spelled) in proptest::collection::vec("[a-zA-Z0-9._~-]{1,6}", 1..5)
                .prop_filter("dot segments are not plain names", |segs| {
                    segs.iter().all(|s| s != "." && s != "..")
                })
                .prop_flat_map(|segs| {
                    let plain = format!("/{}", segs.join("/"));
                    (Just(plain), spellings(segs))
                })
        ) {
            prop_assert_eq!(normalize(&spelled).unwrap(), plain.as_str());
        }

        #[test]
        fn normalizing_twice_changes_nothing(raw in "(/|//|/\\.|/\\.\\.|%2[eEfF]|%7[0-9a-fA-F]|[a-z]){0,12}") {
            if let Ok(once) = normalize(&raw) {
                let once = once.into_owned();
                prop_assert!(once.starts_with('/'));
                prop_assert_eq!(normalize(&once).unwrap(), once.as_str());
            }
        }
    }
}
