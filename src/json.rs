//! The JSON of keyed request bodies: one pass that reads a body into a [`Json`] document
//! (what key and scope extraction and the canonical fingerprint read), and the repeated-member
//! check alone ([`has_duplicate_member`]) for a body that is forwarded but not read.
//!
//! No body costs more than its size: every step over it is linear, whatever its shape. The
//! document keeps its values in flat vectors rather than a value per allocation, strings
//! borrowed from the body, numbers as written. Each object's members are sorted by name as it
//! closes (one pass when they come sorted, `n log n` comparisons at most otherwise, as any
//! canonical form takes), which puts a repeated name next to its twin. The check alone builds
//! nothing and keeps each object's names in a vector while it is small and in a hash set past
//! 16 members. Names compare as text: `"a"` and `"\u0061"` are one name.
//!
//! Nesting is bounded: a body with more than [`MAX_DEPTH`] (128) arrays and objects inside
//! one another is not JSON (400 `body-not-json`); 128 are read. serde_json reads a body in
//! one pass, but its recursion limit refuses a body 128 deep, so a body it refuses is read
//! once more with its top level read here and each element or member by serde_json
//! (`read_top`): at most two passes, and exact bounds.
//!
//! A leaf: it imports nothing of the crate.

use std::borrow::Cow;
use std::collections::HashSet;

use serde_json::Number;

/// Deepest nesting of arrays and objects in a body the gateway reads: a body nested deeper is
/// not JSON to it (400 `body-not-json`).
pub const MAX_DEPTH: usize = 128;

/// In the check alone ([`has_duplicate_member`]), objects with up to this many members look
/// for a repeated name in a vector; a larger one moves its names into a hash set, so that a
/// wide object costs linear time.
const SMALL_OBJECT: usize = 16;

/// The member name by which serde_json (with `arbitrary_precision`) hands a number over as
/// its text: a one-member map `{TOKEN: "1.50"}`.
const NUMBER_TOKEN: &str = "$serde_json::private::Number";

/// A JSON document read from a body. Its values lie in two flat vectors, each array's
/// elements side by side and each object's members side by side, sorted by the bytes of their
/// names (the canonical order, and how a repeated name is found); strings are borrowed from
/// the body unless they have escapes, and numbers keep their text, as serde_json's
/// `arbitrary_precision` keeps it. Strings with escapes and numbers that are not 64-bit
/// integers aside, a document costs a few allocations, not one per value.
#[derive(Debug, Clone)]
pub struct Json<'a> {
    root: Node<'a>,
    items: Vec<Node<'a>>,
    members: Vec<Member<'a>>,
}

/// A member of an object: its name (unescaped) and its value.
pub type Member<'a> = (Cow<'a, str>, Node<'a>);

/// One value of a [`Json`] document; what an array or an object holds is in the document
/// ([`Json::items`], [`Json::members`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Node<'a> {
    Null,
    Bool(bool),
    /// A number written as an integer that fits 64 bits: its text is its decimal form.
    U64(u64),
    I64(i64),
    /// Any other number, as written.
    Number(Number),
    Str(Cow<'a, str>),
    Array(Span),
    Object(Span),
}

/// Where an array's elements or an object's members lie in their document.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    start: usize,
    len: usize,
}

impl<'a> Json<'a> {
    /// A JSON text, refused if it is not JSON, nests deeper than [`MAX_DEPTH`] or repeats a
    /// member name in one of its objects.
    pub(crate) fn parse(raw: &'a [u8]) -> Result<Json<'a>, Refusal> {
        read::<BuildTop>(raw)
    }

    /// The document's value.
    pub fn root(&self) -> &Node<'a> {
        &self.root
    }

    /// An array's elements.
    pub fn items(&self, span: Span) -> &[Node<'a>] {
        &self.items[span.start..span.start + span.len]
    }

    /// An object's members, sorted by the bytes of their names.
    pub fn members(&self, span: Span) -> &[Member<'a>] {
        &self.members[span.start..span.start + span.len]
    }

    /// The value an RFC 6901 pointer names, as `serde_json::Value::pointer` finds it.
    pub fn pointer(&self, ptr: &str) -> Option<&Node<'a>> {
        if ptr.is_empty() {
            return Some(&self.root);
        }
        if !ptr.starts_with('/') {
            return None;
        }
        let mut node = &self.root;
        for token in ptr.split('/').skip(1) {
            let token = if token.contains('~') {
                Cow::Owned(token.replace("~1", "/").replace("~0", "~"))
            } else {
                Cow::Borrowed(token)
            };
            node = match node {
                Node::Object(span) => {
                    let members = self.members(*span);
                    let at = members
                        .binary_search_by(|(name, _)| name.as_bytes().cmp(token.as_bytes()))
                        .ok()?;
                    &members[at].1
                }
                Node::Array(span) => self.items(*span).get(array_index(&token)?)?,
                _ => return None,
            };
        }
        Some(node)
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
    match read::<CheckTop>(raw) {
        Ok(()) => Some(false),
        Err(Refusal::Repeated) => Some(true),
        Err(Refusal::NotJson) => None,
    }
}

/// Why a body is not JSON to the gateway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    NotJson,
    Repeated,
}

impl From<serde_json::Error> for Refusal {
    /// Inside a value, the only data errors are ours, raised on a repeated name.
    fn from(e: serde_json::Error) -> Refusal {
        if e.is_data() {
            Refusal::Repeated
        } else {
            Refusal::NotJson
        }
    }
}

/// Reads a JSON text in one serde_json pass; where serde_json refuses it for a reason of its
/// own (not a repeated name), once more with [`read_top`], which is the one that decides: a
/// text nested exactly [`MAX_DEPTH`] deep is one serde_json refuses and the gateway reads.
/// At most two passes, then, and one for nearly every body.
fn read<'de, P: TopPass<'de>>(raw: &'de [u8]) -> Result<P::Out, Refusal> {
    match P::whole(raw) {
        Err(Refusal::NotJson) => read_top::<P>(raw),
        done => done,
    }
}

/// One pass over a body: all of it read by serde_json (`whole`), or its top level by
/// [`read_top`], where `Item` is what serde_json reads below the top level and the pass
/// folds the top level's elements or members into its result.
trait TopPass<'de>: Sized {
    type Item: serde::Deserialize<'de>;
    type Out;
    /// The whole text read by serde_json.
    fn whole(raw: &'de [u8]) -> Result<Self::Out, Refusal>;
    /// The whole text is one item (a scalar, or a form serde_json must read itself).
    fn item(item: Self::Item) -> Self::Out;
    fn array() -> Self;
    fn element(&mut self, item: Self::Item);
    fn object() -> Self;
    /// The next member's name: false if the object has it already.
    fn name(&mut self, name: Cow<'de, str>) -> bool;
    /// The value of the member just named.
    fn value(&mut self, item: Self::Item);
    fn finish(self) -> Result<Self::Out, Refusal>;
}

/// Reads a JSON text: the top-level array or object here, each of its elements and members
/// with serde_json. Why not all with serde_json: it counts the outermost container against
/// its recursion limit of 128 and refuses a text nested 128 deep; here, each element and
/// member has the whole limit, so that 128 levels in all are read and 129 are not. Each byte
/// is read once: serde_json goes on from where this reader stopped, and back. Slower than one
/// serde_json pass by a little per member of the top level, so [`read`] tries that first.
fn read_top<'de, P: TopPass<'de>>(raw: &'de [u8]) -> Result<P::Out, Refusal> {
    let mut r = TopReader { raw, pos: 0 };
    let out = match r.next_token() {
        Some(b'[') => {
            r.pos += 1;
            let mut pass = P::array();
            if !r.close(b']') {
                loop {
                    pass.element(r.item()?);
                    if r.close(b']') {
                        break;
                    }
                    r.expect(b',')?;
                }
            }
            pass.finish()?
        }
        Some(b'{') => {
            r.pos += 1;
            let mut pass = P::object();
            let mut first = true;
            if !r.close(b'}') {
                loop {
                    if r.next_token() != Some(b'"') {
                        return Err(Refusal::NotJson);
                    }
                    let MemberNameOf(name) = r.item()?;
                    if first && name == NUMBER_TOKEN {
                        // serde_json may read this object as a number (see `NUMBER_TOKEN`):
                        // it reads the whole text, as `serde_json::from_slice` would.
                        return Ok(P::item(read_whole(raw)?));
                    }
                    first = false;
                    if !pass.name(name) {
                        return Err(Refusal::Repeated);
                    }
                    r.expect(b':')?;
                    pass.value(r.item()?);
                    if r.close(b'}') {
                        break;
                    }
                    r.expect(b',')?;
                }
            }
            pass.finish()?
        }
        _ => return Ok(P::item(read_whole(raw)?)),
    };
    if r.next_token().is_some() {
        return Err(Refusal::NotJson);
    }
    Ok(out)
}

/// A whole JSON text read by serde_json, trailing white space allowed.
fn read_whole<'de, T: serde::Deserialize<'de>>(raw: &'de [u8]) -> Result<T, Refusal> {
    let mut de = serde_json::Deserializer::from_slice(raw);
    let item = T::deserialize(&mut de)?;
    de.end()?;
    Ok(item)
}

/// The position of [`read_top`] in the text.
struct TopReader<'de> {
    raw: &'de [u8],
    pos: usize,
}

impl<'de> TopReader<'de> {
    /// Skips JSON white space; the byte after it, if any.
    fn next_token(&mut self) -> Option<u8> {
        while let Some(&b) = self.raw.get(self.pos) {
            if !matches!(b, b' ' | b'\n' | b'\t' | b'\r') {
                return Some(b);
            }
            self.pos += 1;
        }
        None
    }

    /// Consumes `b` if it comes next.
    fn close(&mut self, b: u8) -> bool {
        let next = self.next_token() == Some(b);
        if next {
            self.pos += 1;
        }
        next
    }

    fn expect(&mut self, b: u8) -> Result<(), Refusal> {
        if self.close(b) {
            Ok(())
        } else {
            Err(Refusal::NotJson)
        }
    }

    /// One JSON value, read by serde_json from here on (with its own recursion limit).
    fn item<T: serde::Deserialize<'de>>(&mut self) -> Result<T, Refusal> {
        let rest = &self.raw[self.pos..];
        let mut stream = serde_json::Deserializer::from_slice(rest).into_iter::<T>();
        // A number, `true`, `false` or `null` must end where a value may end (the stream
        // checks that); a string, an array or an object ends itself.
        let item = stream.next().ok_or(Refusal::NotJson)??;
        self.pos += stream.byte_offset();
        Ok(item)
    }
}

/// The check pass: nothing built, names compared.
struct CheckTop<'de>(Seen<'de>);

impl<'de> TopPass<'de> for CheckTop<'de> {
    type Item = Checked;
    type Out = ();
    fn whole(raw: &'de [u8]) -> Result<(), Refusal> {
        read_whole::<Checked>(raw).map(|Checked| ())
    }
    fn item(_: Checked) {}
    fn array() -> Self {
        CheckTop(Seen::new())
    }
    fn element(&mut self, _: Checked) {}
    fn object() -> Self {
        CheckTop(Seen::new())
    }
    fn name(&mut self, name: Cow<'de, str>) -> bool {
        self.0.insert(name)
    }
    fn value(&mut self, _: Checked) {}
    fn finish(self) -> Result<(), Refusal> {
        Ok(())
    }
}

/// A value walked by [`UniqueMembers`].
struct Checked;

impl<'de> serde::Deserialize<'de> for Checked {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Checked, D::Error> {
        d.deserialize_any(UniqueMembers).map(|()| Checked)
    }
}

/// The member names of one object seen so far: a vector while the object is small, a hash
/// set once it is not (std's, with its randomly keyed hash: no list of names collides on
/// purpose). Names compare by their text, escaped or not.
enum Seen<'de> {
    Few(Vec<Cow<'de, str>>),
    Many(HashSet<Cow<'de, str>>),
}

impl<'de> Seen<'de> {
    fn new() -> Self {
        Seen::Few(Vec::new())
    }

    /// Adds a name: false if it was there already.
    fn insert(&mut self, name: Cow<'de, str>) -> bool {
        match self {
            Seen::Few(names) => {
                if names.contains(&name) {
                    return false;
                }
                if names.len() < SMALL_OBJECT {
                    names.push(name);
                } else {
                    let mut set = HashSet::with_capacity(4 * SMALL_OBJECT);
                    set.extend(names.drain(..));
                    set.insert(name);
                    *self = Seen::Many(set);
                }
                true
            }
            Seen::Many(set) => set.insert(name),
        }
    }
}

/// A visitor that walks a JSON value and fails with a data error on a repeated member name.
/// serde_json's recursion limit bounds how deep it goes.
struct UniqueMembers;

impl<'de> serde::de::DeserializeSeed<'de> for UniqueMembers {
    type Value = ();
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for UniqueMembers {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        let mut seen = Seen::new();
        while let Some(name) = map.next_key_seed(MemberName)? {
            if !seen.insert(name) {
                return Err(serde::de::Error::custom("repeated member name"));
            }
            map.next_value_seed(UniqueMembers)?;
        }
        Ok(())
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(UniqueMembers)?.is_some() {}
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

/// A document being built: the finished arrays' elements and objects' members, and those of
/// the arrays and objects still open (innermost last), moved over as each closes.
#[derive(Default)]
struct Tape<'a> {
    items: Vec<Node<'a>>,
    members: Vec<Member<'a>>,
    open_items: Vec<Node<'a>>,
    open_members: Vec<Member<'a>>,
}

impl<'a> Tape<'a> {
    /// The array whose elements are the open ones from `mark` on.
    fn close_array(&mut self, mark: usize) -> Node<'a> {
        let start = self.items.len();
        if self.open_items.len() == mark + 1 {
            // One element (nesting): no drain to set up.
            self.items.extend(self.open_items.pop());
        } else {
            self.items.extend(self.open_items.drain(mark..));
        }
        Node::Array(Span {
            start,
            len: self.items.len() - start,
        })
    }

    /// The object whose members are the open ones from `mark` on; `None` if a name repeats.
    fn close_object(&mut self, mark: usize) -> Option<Node<'a>> {
        let start = self.members.len();
        if self.open_members.len() == mark + 1 {
            self.members.extend(self.open_members.pop());
        } else {
            self.members.extend(self.open_members.drain(mark..));
        }
        let members = &mut self.members[start..];
        if !sort_members(members) {
            return None;
        }
        Some(Node::Object(Span {
            start,
            len: members.len(),
        }))
    }

    fn into_json(self, root: Node<'a>) -> Json<'a> {
        Json {
            root,
            items: self.items,
            members: self.members,
        }
    }
}

/// Sorts an object's members by the bytes of their names: false if a name repeats (equal
/// names end up side by side). Names mostly come sorted, which one pass finds; otherwise the
/// sort (stable: it merges the sorted runs it finds) takes `n log n` comparisons at most, as
/// any canonical form's does.
fn sort_members(members: &mut [Member<'_>]) -> bool {
    let ascending = |w: &[Member<'_>]| w[0].0.as_bytes() < w[1].0.as_bytes();
    if members.windows(2).all(ascending) {
        return true;
    }
    members.sort_by(|a, b| a.0.as_bytes().cmp(b.0.as_bytes()));
    members.windows(2).all(ascending)
}

/// Reads one value into a [`Tape`]; fails with a data error on a repeated member name.
/// serde_json's recursion limit bounds how deep it goes.
struct NodeSeed<'t, 'a> {
    tape: &'t mut Tape<'a>,
}

impl<'de> serde::de::DeserializeSeed<'de> for NodeSeed<'_, 'de> {
    type Value = Node<'de>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Node<'de>, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for NodeSeed<'_, 'de> {
    type Value = Node<'de>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Node<'de>, E> {
        Ok(Node::Bool(v))
    }
    fn visit_i64<E>(self, v: i64) -> Result<Node<'de>, E> {
        Ok(Node::I64(v))
    }
    fn visit_u64<E>(self, v: u64) -> Result<Node<'de>, E> {
        Ok(Node::U64(v))
    }
    fn visit_f64<E>(self, v: f64) -> Result<Node<'de>, E> {
        Ok(Number::from_f64(v).map_or(Node::Null, Node::Number))
    }
    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Borrowed(v)))
    }
    fn visit_str<E>(self, v: &str) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Owned(v.to_owned())))
    }
    fn visit_string<E>(self, v: String) -> Result<Node<'de>, E> {
        Ok(Node::Str(Cow::Owned(v)))
    }
    fn visit_unit<E>(self) -> Result<Node<'de>, E> {
        Ok(Node::Null)
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Node<'de>, A::Error> {
        let tape = self.tape;
        let mark = tape.open_items.len();
        while let Some(item) = seq.next_element_seed(NodeSeed { tape: &mut *tape })? {
            tape.open_items.push(item);
        }
        Ok(tape.close_array(mark))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Node<'de>, A::Error> {
        let tape = self.tape;
        let mark = tape.open_members.len();
        let mut next = map.next_key_seed(MemberName)?;
        if next.as_deref() == Some(NUMBER_TOKEN) {
            // A number as written, as serde_json's own `Value` reads it.
            let text: String = map.next_value()?;
            return text
                .parse::<Number>()
                .map(Node::Number)
                .map_err(serde::de::Error::custom);
        }
        while let Some(name) = next {
            let value = map.next_value_seed(NodeSeed { tape: &mut *tape })?;
            tape.open_members.push((name, value));
            next = map.next_key_seed(MemberName)?;
        }
        tape.close_object(mark)
            .ok_or_else(|| serde::de::Error::custom("repeated member name"))
    }
}

/// A value read with its own [`Tape`]: an element or member of the top level.
struct Piece<'a>(Json<'a>);

impl<'de> serde::Deserialize<'de> for Piece<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let mut tape = Tape::default();
        let root = serde::de::DeserializeSeed::deserialize(NodeSeed { tape: &mut tape }, d)?;
        Ok(Piece(tape.into_json(root)))
    }
}

/// The build pass: a [`Json`] document, refused on a repeated name.
struct BuildTop<'a> {
    /// The pieces read so far, moved into one document.
    doc: Tape<'a>,
    /// The top level's elements or members (with the name of the one being read).
    top_items: Vec<Node<'a>>,
    top_members: Vec<Member<'a>>,
    pending: Option<Cow<'a, str>>,
    object: bool,
}

impl<'a> BuildTop<'a> {
    fn new(object: bool) -> Self {
        BuildTop {
            doc: Tape::default(),
            top_items: Vec::new(),
            top_members: Vec::new(),
            pending: None,
            object,
        }
    }

    /// A piece's value, its contents moved into the document (its spans moved with them).
    fn adopt(&mut self, Piece(piece): Piece<'a>) -> Node<'a> {
        if self.doc.items.is_empty() && self.doc.members.is_empty() {
            self.doc.items = piece.items;
            self.doc.members = piece.members;
            return piece.root;
        }
        let (items, members) = (self.doc.items.len(), self.doc.members.len());
        let moved = move |node: Node<'a>| match node {
            Node::Array(span) => Node::Array(Span {
                start: span.start + items,
                ..span
            }),
            Node::Object(span) => Node::Object(Span {
                start: span.start + members,
                ..span
            }),
            other => other,
        };
        self.doc.items.extend(piece.items.into_iter().map(moved));
        self.doc
            .members
            .extend(piece.members.into_iter().map(|(name, v)| (name, moved(v))));
        moved(piece.root)
    }
}

impl<'de> TopPass<'de> for BuildTop<'de> {
    type Item = Piece<'de>;
    type Out = Json<'de>;
    fn whole(raw: &'de [u8]) -> Result<Json<'de>, Refusal> {
        read_whole::<Piece>(raw).map(|Piece(doc)| doc)
    }
    fn item(Piece(piece): Piece<'de>) -> Json<'de> {
        piece
    }
    fn array() -> Self {
        BuildTop::new(false)
    }
    fn element(&mut self, item: Piece<'de>) {
        let node = self.adopt(item);
        self.top_items.push(node);
    }
    fn object() -> Self {
        BuildTop::new(true)
    }
    fn name(&mut self, name: Cow<'de, str>) -> bool {
        // Repeats are found when the members are sorted (`finish`).
        self.pending = Some(name);
        true
    }
    fn value(&mut self, item: Piece<'de>) {
        let node = self.adopt(item);
        if let Some(name) = self.pending.take() {
            self.top_members.push((name, node));
        }
    }
    fn finish(mut self) -> Result<Json<'de>, Refusal> {
        let root = if self.object {
            self.doc.open_members = std::mem::take(&mut self.top_members);
            self.doc.close_object(0).ok_or(Refusal::Repeated)?
        } else {
            self.doc.open_items = std::mem::take(&mut self.top_items);
            self.doc.close_array(0)
        };
        Ok(self.doc.into_json(root))
    }
}

/// A member name, borrowed from the body unless it has escapes (serde's own `Cow<str>` would
/// copy every name into a `String`). Escaped or not, equal names compare equal.
struct MemberName;

impl<'de> serde::de::DeserializeSeed<'de> for MemberName {
    type Value = Cow<'de, str>;
    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(self)
    }
}

impl<'de> serde::de::Visitor<'de> for MemberName {
    type Value = Cow<'de, str>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a member name")
    }

    fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(v))
    }

    fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(v.to_owned()))
    }
}

/// A top-level member name, as [`MemberName`] reads it.
struct MemberNameOf<'de>(Cow<'de, str>);

impl<'de> serde::Deserialize<'de> for MemberNameOf<'de> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        serde::de::DeserializeSeed::deserialize(MemberName, d).map(MemberNameOf)
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::key::{JsonBody, KeyError};
    use bytes::Bytes;
    use proptest::prelude::*;
    use serde_json::Value;

    /// A document as serde_json's `Value`, to compare with what serde_json reads.
    pub(crate) fn to_value(doc: &Json<'_>) -> Value {
        node_value(doc, doc.root())
    }

    fn node_value(doc: &Json<'_>, node: &Node<'_>) -> Value {
        match node {
            Node::Null => Value::Null,
            Node::Bool(b) => Value::Bool(*b),
            Node::U64(n) => Value::Number((*n).into()),
            Node::I64(n) => Value::Number((*n).into()),
            Node::Number(n) => Value::Number(n.clone()),
            Node::Str(s) => Value::String(s.to_string()),
            Node::Array(span) => Value::Array(
                doc.items(*span)
                    .iter()
                    .map(|n| node_value(doc, n))
                    .collect(),
            ),
            Node::Object(span) => Value::Object(
                doc.members(*span)
                    .iter()
                    .map(|(k, v)| (k.to_string(), node_value(doc, v)))
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
                start: items.len() - 1,
                len: 1,
            });
        }
        Json {
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
            let at = |depth: usize| {
                Bytes::from(format!("{}0{}", open.repeat(depth), close.repeat(depth)))
            };
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
        (value, any::<u16>(), 0u8..6).prop_map(|(text, at, how)| {
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
        })
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
            // The top-level reader alone (which decides where serde_json refuses a text)
            // agrees too.
            let top = match read_top::<CheckTop>(&raw) {
                Ok(()) => Some(false),
                Err(Refusal::Repeated) => Some(true),
                Err(Refusal::NotJson) => None,
            };
            prop_assert_eq!(top, repeated);
            let top = read_top::<BuildTop>(&raw).ok().map(|doc| to_value(&doc));
            prop_assert_eq!(
                top,
                serde.clone().filter(|_| repeated == Some(false))
            );
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
}
