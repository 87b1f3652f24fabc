//! The JSON of keyed request bodies: one pass that reads a body into a [`Json`] document
//! (what key and scope extraction and the canonical fingerprint read), and the repeated-member
//! check alone ([`has_duplicate_member`]) for a body that is forwarded but not read.
//!
//! No body costs more than its size: every step over it is linear, whatever its shape. One
//! hand-written reader (`parse.rs`, its byte-level string scanning in `scan.rs`) goes over the
//! bytes once, with a stack of its own rather
//! than recursion, and accepts what serde_json accepts; what it reads goes either into a
//! document (`tape.rs`) or to the check (`names.rs`). The document keeps its values in flat
//! vectors of small plain values rather than a value per allocation, strings where they lie
//! in the body unless they have escapes, numbers as written. Each object's members are sorted by name as it closes
//! (one pass when they come sorted, `n log n` comparisons at most otherwise, as any canonical
//! form takes), which puts a repeated name next to its twin. The check alone builds nothing
//! and keeps each object's names on a stack, compared one by one while the object is small
//! and through a hash table past 16 members. Names compare as text: `"a"` and `"\u0061"` are
//! one name.
//!
//! Nesting is bounded: a body with more than [`MAX_DEPTH`] (128) arrays and objects inside
//! one another is not JSON (400 `body-not-json`); 128 are read.
//!
//! A leaf: it imports nothing of the crate.

use std::borrow::Cow;

mod hashed;
mod names;
mod order;
mod parse;
mod scan;
mod spare;
mod tape;

#[cfg(test)]
pub(crate) mod tests;

/// Deepest nesting of arrays and objects in a body the gateway reads: a body nested deeper is
/// not JSON to it (400 `body-not-json`).
pub const MAX_DEPTH: usize = 128;

/// The member name by which serde_json (with `arbitrary_precision`) hands a number over as
/// its text: a one-member map `{TOKEN: "1.50"}`, which serde_json's own `Value` reads as that
/// number at any depth; so does [`Json`], to read what serde_json reads.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// The longest body [`Json`] reads (2 GiB less a byte): a document addresses its strings
/// with 32-bit offsets. A longer body is not JSON to it; the check alone
/// ([`has_duplicate_member`]) has no such bound.
pub const MAX_DOCUMENT: usize = i32::MAX as usize;

/// A JSON document read from a body. Its values lie in two flat vectors of small, plain
/// values (16 bytes a node, 24 a member): each array's elements side by side and each
/// object's members side by side, sorted by the bytes of their names (the canonical order,
/// and how a repeated name is found). A string is where it lies in the body, or, if it had
/// escapes, where its decoded text lies in one buffer of the document's; numbers keep their
/// text, as serde_json's `arbitrary_precision` keeps it. A document costs a few allocations,
/// whatever it holds.
#[derive(Debug, Clone)]
pub struct Json<'a> {
    /// The body (what of it is UTF-8: all of it, once it is read).
    body: &'a str,
    /// The text of strings with escapes, and of numbers that serde_json spells otherwise.
    decoded: String,
    root: Node,
    items: Vec<Node>,
    members: Vec<Member>,
    /// Where containers written in the body as their canonical form lie there (start and
    /// length); [`Span::verbatim`] is 1 + an index in it.
    verbatim: Vec<(u32, u32)>,
}

/// A string of a [`Json`] document (its text: [`Json::text`]): as written in the body, which
/// had no escapes in it (so it has no `"`, `\` or control character to escape when written
/// out), or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Text {
    start: u32,
    /// The length, and [`Text::DECODED`] where the text is the document's own.
    len: u32,
}

impl Text {
    const DECODED: u32 = 1 << 31;

    /// Whether the text was decoded from escapes (or respelled), rather than written as it is
    /// in the body: only such a string may have characters to escape.
    pub fn is_decoded(self) -> bool {
        self.len & Text::DECODED != 0
    }
}

/// A member of an object: its name (unescaped) and its value.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Member {
    pub name: Text,
    pub value: Node,
}

/// One value of a [`Json`] document; what an array or an object holds is in the document
/// ([`Json::items`], [`Json::members`]), as is a string's text ([`Json::text`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Node {
    Null,
    Bool(bool),
    /// A number written as an integer that fits 64 bits (but `-0`): its text is its decimal
    /// form.
    U64(u64),
    I64(i64),
    /// Any other number, as serde_json's `arbitrary_precision` keeps its text: as written,
    /// but `E` written `e` and an exponent's `+` written out (`1E2` is `1e+2`).
    Number(Text),
    Str(Text),
    Array(Span),
    Object(Span),
}

/// Where an array's elements or an object's members lie in their document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    start: u32,
    len: u32,
    /// Whether (and where) the container is written in the body as its canonical form: 0 if
    /// not, else 1 + its record's index ([`Json::verbatim`]).
    verbatim: u32,
}

// Nodes stay two words: a document costs at most 16 bytes a value and 24 a member.
const _: () = assert!(std::mem::size_of::<Node>() == 16);
const _: () = assert!(std::mem::size_of::<Member>() == 24);

impl Span {
    fn range(self) -> std::ops::Range<usize> {
        self.start as usize..self.start as usize + self.len as usize
    }
}

impl<'a> Json<'a> {
    /// A JSON text, refused if it is not JSON, nests deeper than [`MAX_DEPTH`], repeats a
    /// member name in one of its objects or is longer than [`MAX_DOCUMENT`].
    pub(crate) fn parse(raw: &'a [u8]) -> Result<Json<'a>, Refusal> {
        if raw.len() > MAX_DOCUMENT {
            return Err(Refusal::NotJson);
        }
        let text = parse::utf8_prefix(raw);
        let mut tape = tape::Tape::new(text);
        match parse::read(raw, text, &mut tape) {
            Ok(root) => Ok(tape.into_json(root)),
            Err(refusal) => {
                tape.discard();
                Err(refusal)
            }
        }
    }

    /// The document's value.
    pub fn root(&self) -> Node {
        self.root
    }

    /// An array's elements.
    pub fn items(&self, span: Span) -> &[Node] {
        &self.items[span.range()]
    }

    /// An object's members, sorted by the bytes of their names.
    pub fn members(&self, span: Span) -> &[Member] {
        &self.members[span.range()]
    }

    /// A string's text.
    pub fn text(&self, t: Text) -> &str {
        text_of(self.body, &self.decoded, t)
    }

    /// A string as written in the body between its quotes, the quotes included, if it was
    /// written there without escapes (then it is written out as it is).
    #[inline]
    pub(crate) fn quoted(&self, t: Text) -> Option<&[u8]> {
        if t.is_decoded() {
            return None;
        }
        let start = t.start as usize;
        let body = self.body.as_bytes();
        body.get(start.checked_sub(1)?..start + t.len as usize + 1)
    }

    /// An array's or an object's text as written in the body, if it is written there as its
    /// canonical form writes it: compact, names sorted by their bytes, no escapes, numbers as
    /// serde_json keeps them, and so all the way down. Only the outermost such containers
    /// say so (one inside another says `None`, its parent's text holds it).
    pub fn verbatim(&self, span: Span) -> Option<&str> {
        let (start, len) = *self.verbatim.get(span.verbatim.checked_sub(1)? as usize)?;
        self.body.get(start as usize..(start + len) as usize)
    }

    /// The value an RFC 6901 pointer names, as `serde_json::Value::pointer` finds it.
    pub fn pointer(&self, ptr: &str) -> Option<Node> {
        if ptr.is_empty() {
            return Some(self.root);
        }
        if !ptr.starts_with('/') {
            return None;
        }
        let mut node = self.root;
        for token in ptr.split('/').skip(1) {
            let token = if token.contains('~') {
                Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
            } else {
                Cow::Borrowed(token)
            };
            node = match node {
                Node::Object(span) => {
                    let members = self.members(span);
                    let at = members
                        .binary_search_by(|m| self.text(m.name).as_bytes().cmp(token.as_bytes()))
                        .ok()?;
                    members[at].value
                }
                Node::Array(span) => *self.items(span).get(array_index(&token)?)?,
                _ => return None,
            };
        }
        Some(node)
    }
}

/// The text of `t`, in the body or among the decoded.
#[inline]
fn text_of<'t>(body: &'t str, decoded: &'t str, t: Text) -> &'t str {
    let start = t.start as usize;
    let len = (t.len & !Text::DECODED) as usize;
    let whole = if t.is_decoded() { decoded } else { body };
    &whole[start..start + len]
}

impl Drop for Json<'_> {
    /// Its buffers are kept for the next document (`spare.rs`).
    fn drop(&mut self) {
        spare::keep(self.body.len(), |kept| {
            kept.items = std::mem::take(&mut self.items);
            kept.members = std::mem::take(&mut self.members);
            kept.decoded = std::mem::take(&mut self.decoded).into_bytes();
            kept.verbatim = std::mem::take(&mut self.verbatim);
        });
    }
}

/// An array index in a pointer, as serde_json reads one: digits, no sign, no leading zero.
fn array_index(token: &str) -> Option<usize> {
    if token.starts_with('+') || (token.starts_with('0') && token.len() != 1) {
        return None;
    }
    token.parse().ok()
}

/// Whether a JSON text repeats a member name in one of its objects: `Some(true)` if so,
/// `Some(false)` if it is JSON without repeats, `None` if it is not JSON at all (or nested
/// deeper than [`MAX_DEPTH`]). Builds nothing: names without escapes are borrowed.
pub fn has_duplicate_member(raw: &[u8]) -> Option<bool> {
    match check(raw) {
        Ok(()) => Some(false),
        Err(Refusal::Repeated) => Some(true),
        Err(Refusal::NotJson | Refusal::TooDeep) => None,
    }
}

/// Whether the gateway refuses a body that says it is JSON even where it reads nothing of it
/// (400 `body-not-json`): it repeats a member name, which two parsers may read two ways, or
/// it nests deeper than [`MAX_DEPTH`], which the gateway does not read whole and so cannot
/// tell free of repeats (a repeat may lie past the deep part). A body that is not JSON in any
/// other way is not refused: nothing of it is read, and the upstream answers it.
pub fn is_ambiguous(raw: &[u8]) -> bool {
    matches!(check(raw), Err(Refusal::Repeated | Refusal::TooDeep))
}

/// The repeated-member check over a whole text.
fn check(raw: &[u8]) -> Result<(), Refusal> {
    parse::read(raw, parse::utf8_prefix(raw), &mut names::Names::new(raw))
}

/// Why a body is not JSON to the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    NotJson,
    Repeated,
    /// Nested deeper than [`MAX_DEPTH`] (before any repeat or other error).
    TooDeep,
}
