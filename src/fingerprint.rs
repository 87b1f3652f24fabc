//! The request fingerprint: SHA-256 over what makes two requests "the same" (docs/contract.md, section 1).
//!
//! Parts, in order, each length-prefixed so that no two different requests can produce the
//! same byte stream: method, route name, path and query, each configured header (its values
//! in order, or an "absent" marker), and the body. The body is hashed raw, or, with
//! `json_canonical`, as canonical JSON: object keys sorted by their UTF-8 bytes, no
//! insignificant white space, with the `json_ignore` pointers removed first. Numbers keep
//! their text (serde_json's `arbitrary_precision`), so `0.30000000000000001` and `0.3` differ.
//! A body with a repeated member name is not JSON and has no canonical form (key.rs). The
//! canonical form is written in one walk of the parsed body ([`Json`]), whose objects are
//! sorted already: linear in its size.

use http::{HeaderMap, Method};
use std::borrow::Cow;

use sha2::{Digest, Sha256};

use crate::config::FingerprintConfig;
use crate::json::{Json, MAX_DEPTH, Member, Node, Text};

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
    json: Option<&Json<'_>>,
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
        let mut w = HashWriter::new(&mut h);
        write_canonical(json, &mut w, &ignore)?;
        let n = w.finish();
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

/// Feeds written bytes to a hash and counts them. Small writes (a name's quotes, an escape
/// of a string) are gathered first: a hash update per byte or two costs more than the hash.
struct HashWriter<'a> {
    h: &'a mut Sha256,
    n: u64,
    buf: [u8; HashWriter::BUFFER],
    len: usize,
}

impl<'a> HashWriter<'a> {
    const BUFFER: usize = 4096;

    fn new(h: &'a mut Sha256) -> Self {
        HashWriter {
            h,
            n: 0,
            buf: [0; HashWriter::BUFFER],
            len: 0,
        }
    }

    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.n += bytes.len() as u64;
        let end = self.len + bytes.len();
        if end <= Self::BUFFER {
            copy_short(&mut self.buf[self.len..end], bytes);
            self.len = end;
        } else {
            self.spill(bytes);
        }
    }

    #[cold]
    fn spill(&mut self, bytes: &[u8]) {
        self.h.update(&self.buf[..self.len]);
        if bytes.len() >= Self::BUFFER {
            self.h.update(bytes);
            self.len = 0;
        } else {
            self.buf[..bytes.len()].copy_from_slice(bytes);
            self.len = bytes.len();
        }
    }

    /// Hashes what is buffered; the count of bytes written.
    fn finish(self) -> u64 {
        self.h.update(&self.buf[..self.len]);
        self.n
    }
}

/// `src` into `dst` (of the same length). Most writes are a few bytes (a name, a digit, a
/// comma): those are copied in two overlapping loads and stores of a fixed size, rather than
/// by a call to `memcpy` for a length known only at run time.
#[inline(always)]
fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    match n {
        8..=16 => {
            dst[..8].copy_from_slice(&src[..8]);
            dst[n - 8..].copy_from_slice(&src[n - 8..]);
        }
        4..=7 => {
            dst[..4].copy_from_slice(&src[..4]);
            dst[n - 4..].copy_from_slice(&src[n - 4..]);
        }
        1..=3 => {
            dst[0] = src[0];
            dst[n / 2] = src[n / 2];
            dst[n - 1] = src[n - 1];
        }
        _ => dst.copy_from_slice(src),
    }
}

impl std::io::Write for HashWriter<'_> {
    #[inline]
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.put(buf);
        Ok(buf.len())
    }
    #[inline]
    fn write_all(&mut self, buf: &[u8]) -> std::io::Result<()> {
        self.put(buf);
        Ok(())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Canonical JSON: object members sorted by the UTF-8 bytes of their names, compact, numbers
/// as written. `ignore` holds the remaining tokens of the pointers to leave out: a member or
/// element whose pointer ends here is skipped; deeper ones are passed down. A value nested
/// deeper than [`MAX_DEPTH`] is refused (the recursion is bounded whatever the document), as
/// is one the writer does not take.
pub fn write_canonical<W: std::io::Write>(
    doc: &Json<'_>,
    out: &mut W,
    ignore: &[&[Cow<'_, str>]],
) -> Result<(), FingerprintError> {
    canonical(doc, doc.root(), out, ignore, 0).map_err(|_| FingerprintError::NotJson)
}

/// A value nested deeper than [`MAX_DEPTH`], or a writer that failed.
struct Unwritten;

impl From<std::io::Error> for Unwritten {
    fn from(_: std::io::Error) -> Unwritten {
        Unwritten
    }
}

impl From<serde_json::Error> for Unwritten {
    fn from(_: serde_json::Error) -> Unwritten {
        Unwritten
    }
}

/// [`write_canonical`] of a value inside `depth` arrays and objects, with pointers to leave
/// out below it; [`whole`] once there are none (nearly every value).
fn canonical<W: std::io::Write>(
    doc: &Json<'_>,
    node: Node,
    out: &mut W,
    ignore: &[&[Cow<'_, str>]],
    depth: usize,
) -> Result<(), Unwritten> {
    if ignore.is_empty() {
        return whole(doc, node, out, depth);
    }
    match node {
        Node::Object(span) => {
            if depth >= MAX_DEPTH {
                return Err(Unwritten);
            }
            out.write_all(b"{")?;
            // The members the pointers name next, found by their names (sorted already:
            // `Json::members`), so that the others cost nothing more than in `whole`.
            let members = doc.members(span);
            let named = named(ignore, |token| {
                members
                    .binary_search_by(|m| doc.text(m.name).as_bytes().cmp(token.as_bytes()))
                    .ok()
            });
            let mut first = true;
            // The first of `named` not behind the member at hand.
            let mut next = 0;
            for (i, m) in members.iter().enumerate() {
                while named.get(next).is_some_and(|&(at, _)| at < i) {
                    next += 1;
                }
                if named.get(next).is_none_or(|&(at, _)| at != i) {
                    // No pointer names it (nearly every member): written whole.
                    if !first {
                        out.write_all(b",")?;
                    }
                    first = false;
                    member(doc, m, out, depth)?;
                    continue;
                }
                let Some(deeper) = below(&named[next..], i) else {
                    continue; // this very member is ignored
                };
                if !first {
                    out.write_all(b",")?;
                }
                first = false;
                write_str(out, doc, m.name)?;
                out.write_all(b":")?;
                canonical(doc, m.value, out, &deeper, depth + 1)?;
            }
            out.write_all(b"}")?;
        }
        Node::Array(span) => {
            if depth >= MAX_DEPTH {
                return Err(Unwritten);
            }
            out.write_all(b"[")?;
            // Only a pointer whose next token is an array index (`0`, or digits without a
            // leading zero) can name an element.
            let items = doc.items(span);
            let named = named(ignore, |token| {
                let at: usize = token.parse().ok().filter(|_| is_index(token))?;
                (at < items.len()).then_some(at)
            });
            let mut first = true;
            for (i, &value) in items.iter().enumerate() {
                let Some(deeper) = below(&named, i) else {
                    continue;
                };
                if !first {
                    out.write_all(b",")?;
                }
                first = false;
                canonical(doc, value, out, &deeper, depth + 1)?;
            }
            out.write_all(b"]")?;
        }
        scalar => whole(doc, scalar, out, depth)?,
    }
    Ok(())
}

/// [`write_canonical`] of a value inside `depth` arrays and objects, all of it.
fn whole<W: std::io::Write>(
    doc: &Json<'_>,
    node: Node,
    out: &mut W,
    depth: usize,
) -> Result<(), Unwritten> {
    match node {
        Node::Null => out.write_all(b"null")?,
        Node::Bool(true) => out.write_all(b"true")?,
        Node::Bool(false) => out.write_all(b"false")?,
        // The text serde_json keeps for an integer that fits is its decimal form.
        Node::U64(n) => write_integer(out, false, n)?,
        Node::I64(n) => write_integer(out, n < 0, n.unsigned_abs())?,
        // Its text as serde_json keeps it (`Node::Number`), which serde_json writes as it is.
        Node::Number(n) => out.write_all(doc.text(n).as_bytes())?,
        Node::Str(s) => write_str(out, doc, s)?,
        Node::Object(span) | Node::Array(span) if doc.verbatim(span).is_some() => {
            // Written in the body as it is written here (`Json::verbatim`).
            if depth >= MAX_DEPTH {
                return Err(Unwritten);
            }
            out.write_all(doc.verbatim(span).unwrap_or_default().as_bytes())?;
        }
        Node::Object(span) => {
            if depth >= MAX_DEPTH {
                return Err(Unwritten);
            }
            out.write_all(b"{")?;
            for (i, m) in doc.members(span).iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                member(doc, m, out, depth)?;
            }
            out.write_all(b"}")?;
        }
        Node::Array(span) => {
            if depth >= MAX_DEPTH {
                return Err(Unwritten);
            }
            out.write_all(b"[")?;
            for (i, &value) in doc.items(span).iter().enumerate() {
                if i > 0 {
                    out.write_all(b",")?;
                }
                whole(doc, value, out, depth + 1)?;
            }
            out.write_all(b"]")?;
        }
    }
    Ok(())
}

/// A member of an object inside `depth` arrays and objects, written whole: its name, a
/// colon, its value.
#[inline]
fn member<W: std::io::Write>(
    doc: &Json<'_>,
    m: &Member,
    out: &mut W,
    depth: usize,
) -> Result<(), Unwritten> {
    write_str(out, doc, m.name)?;
    out.write_all(b":")?;
    whole(doc, m.value, out, depth + 1)
}

/// An integer in decimal, `-` first if `negative`.
fn write_integer<W: std::io::Write>(
    out: &mut W,
    negative: bool,
    mut n: u64,
) -> Result<(), Unwritten> {
    let mut digits = [0u8; 21];
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (n % 10) as u8;
        n /= 10;
        if n == 0 {
            break;
        }
    }
    if negative {
        at -= 1;
        digits[at] = b'-';
    }
    out.write_all(&digits[at..])?;
    Ok(())
}

/// A string as serde_json writes it: quoted, with `"`, `\` and control characters escaped
/// (nothing else). A string as written in the body had no escapes there, so it has none of
/// those ([`Text`]); only a decoded one is looked at.
#[inline]
fn write_str<W: std::io::Write>(out: &mut W, doc: &Json<'_>, t: Text) -> Result<(), Unwritten> {
    if let Some(quoted) = doc.quoted(t) {
        // As written in the body, quotes and all: one write.
        out.write_all(quoted)?;
        return Ok(());
    }
    // Decoded from escapes (or respelled): it may have characters to escape.
    let s = doc.text(t);
    if s.bytes().any(|b| b < 0x20 || b == b'"' || b == b'\\') {
        serde_json::to_writer(&mut *out, s)?;
    } else {
        out.write_all(b"\"")?;
        out.write_all(s.as_bytes())?;
        out.write_all(b"\"")?;
    }
    Ok(())
}

/// The pointers, by the member or element their next token names (`find`: its index, if
/// the container has it), in the order of those indices, each with its remaining tokens.
fn named<'p, 'c>(
    ignore: &[&'p [Cow<'c, str>]],
    find: impl Fn(&str) -> Option<usize>,
) -> Vec<(usize, &'p [Cow<'c, str>])> {
    let mut named: Vec<_> = ignore
        .iter()
        .filter_map(|p| {
            let (token, rest) = p.split_first()?;
            Some((find(token)?, rest))
        })
        .collect();
    named.sort_by_key(|&(at, _)| at);
    named
}

/// The pointers that go on below the member or element at `at` (of those [`named`] found);
/// `None` if one ends there (it is left out). No allocation while there are none.
fn below<'p, 'c>(
    named: &[(usize, &'p [Cow<'c, str>])],
    at: usize,
) -> Option<Vec<&'p [Cow<'c, str>]>> {
    let from = named.partition_point(|&(i, _)| i < at);
    let mut deeper = Vec::new();
    for &(_, rest) in named[from..].iter().take_while(|&&(i, _)| i == at) {
        if rest.is_empty() {
            return None;
        }
        deeper.push(rest);
    }
    Some(deeper)
}

/// Whether a pointer token is an array index: `0`, or digits without a leading zero.
fn is_index(token: &str) -> bool {
    let b = token.as_bytes();
    !b.is_empty() && b.iter().all(u8::is_ascii_digit) && (b[0] != b'0' || b.len() == 1)
}

#[cfg(test)]
mod tests;
