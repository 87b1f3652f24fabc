//! The document builder: the [`Sink`] that turns what the reader reads into a [`Json`].
//!
//! Values of the arrays and objects still open wait on two stacks (innermost last) and move
//! into the document's flat vectors as their container closes, so that each container's
//! values lie side by side. An object's members move in the order of their names' bytes: as
//! they are when they come sorted (one pass finds that), else sorted in place (a small
//! object) or by a sort of their keys (`order.rs`: the members themselves move once); equal
//! names end up side by side, and the object is refused.
//!
//! A container written in the body as its canonical form would write it (no white space,
//! names sorted, no escapes, numbers spelled as serde_json keeps them, and so all the way
//! down) keeps where its text lies ([`Json::verbatim`]), so that the canonical form copies it
//! rather than walking it. Only the outermost such containers keep it: a container's own
//! record goes when its parent turns out verbatim too, so the records stay few.

use super::parse::{Literal, Mark, Num, Sink, Str};
use super::{Json, Member, Node, Refusal, Span, Text, order, spare};

/// Objects with up to this many members that come unsorted are sorted in place; a larger
/// one by its members' indices.
const SORT_IN_PLACE: usize = 32;

/// A document being built.
pub(super) struct Tape<'a> {
    /// The body as far as it is UTF-8 (all of it, once it is read): where strings lie.
    body: &'a str,
    /// The text of strings with escapes (decoded by the reader) and of respelled numbers.
    decoded: Vec<u8>,
    items: Vec<Node>,
    members: Vec<Member>,
    open_items: Vec<Node>,
    open_members: Vec<Member>,
    /// The open containers, innermost last.
    frames: Vec<Frame>,
    /// Where the outermost verbatim containers so far lie in the body: start and length.
    verbatim: Vec<(u32, u32)>,
    /// An unsorted object's sort (`order.rs`): a key for each member, and a buffer.
    order: Vec<order::Key>,
    order_spare: Vec<order::Key>,
}

/// An open container. Its numbers are offsets and counts within one document, which is
/// shorter than 2^31 bytes ([`super::MAX_DOCUMENT`]): 32 bits hold them, and a frame is 20
/// bytes rather than 40 (one is pushed and popped for every container).
struct Frame {
    /// Where its values start on their stack.
    mark: u32,
    /// Where it starts in the body, and the white space skipped before.
    pos: u32,
    spaces: u32,
    /// Where the verbatim records of its values start.
    verbatim: u32,
    /// Whether its values so far are written as the canonical form writes them.
    canonical: bool,
}

impl Frame {
    #[inline(always)]
    fn new(mark: usize, at: Mark, verbatim: usize) -> Frame {
        Frame {
            mark: mark as u32,
            pos: at.pos as u32,
            spaces: at.spaces as u32,
            verbatim: verbatim as u32,
            canonical: true,
        }
    }
}

impl<'a> Tape<'a> {
    /// A document of `body`, built in the buffers of one read before (`spare.rs`).
    pub fn new(body: &'a str) -> Tape<'a> {
        let spare = spare::take(body.len());
        Tape {
            body,
            decoded: spare.decoded,
            items: spare.items,
            members: spare.members,
            open_items: spare.open_items,
            open_members: spare.open_members,
            frames: Vec::new(),
            verbatim: spare.verbatim,
            order: spare.order,
            order_spare: spare.order_spare,
        }
    }

    /// The document; the buffers only the building used are kept for the next.
    pub fn into_json(mut self, root: Node) -> Json<'a> {
        spare::keep(self.body.len(), |kept| {
            kept.open_items = std::mem::take(&mut self.open_items);
            kept.open_members = std::mem::take(&mut self.open_members);
            kept.order = std::mem::take(&mut self.order);
            kept.order_spare = std::mem::take(&mut self.order_spare);
        });
        // Decoded escapes, runs of the body's UTF-8 (the reader refused any string past
        // it), and respelled numbers: UTF-8, which this one pass over the decoded text (not
        // the body) checks, as safe code must.
        let decoded = String::from_utf8(self.decoded)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        Json {
            body: self.body,
            decoded,
            root,
            items: self.items,
            members: self.members,
            verbatim: self.verbatim,
        }
    }

    /// Keeps the buffers of a document that is not to be (a body refused) for the next.
    pub fn discard(mut self) {
        spare::keep(self.body.len(), |kept| {
            kept.items = std::mem::take(&mut self.items);
            kept.members = std::mem::take(&mut self.members);
            kept.decoded = std::mem::take(&mut self.decoded);
            kept.verbatim = std::mem::take(&mut self.verbatim);
            kept.open_items = std::mem::take(&mut self.open_items);
            kept.open_members = std::mem::take(&mut self.open_members);
            kept.order = std::mem::take(&mut self.order);
            kept.order_spare = std::mem::take(&mut self.order_spare);
        });
    }

    /// A string's [`Text`], its escapes decoded into the document's own text.
    #[inline]
    fn text(&mut self, s: Str<'a>) -> Text {
        if !s.escaped {
            return Text {
                start: s.start as u32,
                len: s.raw.len() as u32,
            };
        }
        // Decoded by the reader as it read it (`Sink::DECODE_NAMES`, `DECODE_VALUES`).
        debug_assert!(s.decoded.is_some());
        self.decoded_text(s.decoded.unwrap_or(self.decoded.len()))
    }

    /// The document's own text from `start` on.
    fn decoded_text(&self, start: usize) -> Text {
        Text {
            start: start as u32,
            len: (self.decoded.len() - start) as u32 | Text::DECODED,
        }
    }

    /// The innermost open container takes a value (or a name) written as `canonical` says.
    #[inline]
    fn take(&mut self, canonical: bool) {
        if let Some(frame) = self.frames.last_mut() {
            frame.canonical &= canonical;
        }
    }

    /// The span of the container that closes at `end`, whose values are now at `start` of
    /// the document's vectors (its members if `object`): verbatim if it is written as
    /// canonical (its values then lose their own records, which its own replaces).
    #[inline(always)]
    fn close(&mut self, frame: Frame, end: Mark, start: usize, len: usize, object: bool) -> Span {
        let mut span = Span {
            start: start as u32,
            len: len as u32,
            verbatim: 0,
        };
        if frame.canonical && end.spaces == frame.spaces as usize {
            if self.verbatim.len() > frame.verbatim as usize {
                self.verbatim.truncate(frame.verbatim as usize);
                forget_verbatim(&mut self.items, &mut self.members, span, object);
            }
            self.verbatim.push((frame.pos, end.pos as u32 - frame.pos));
            span.verbatim = self.verbatim.len() as u32;
        }
        span
    }
}

/// The bytes of `t`, in the body or among the decoded.
#[inline]
fn bytes_of<'t>(body: &'t [u8], decoded: &'t [u8], t: Text) -> &'t [u8] {
    let start = t.start as usize;
    let len = (t.len & !Text::DECODED) as usize;
    let whole = if t.is_decoded() { decoded } else { body };
    &whole[start..start + len]
}

/// Whether a value is written in the body as the canonical form writes it.
fn is_canonical(v: &Node) -> bool {
    match v {
        Node::Str(t) | Node::Number(t) => !t.is_decoded(),
        Node::Array(s) | Node::Object(s) => s.verbatim != 0,
        _ => true,
    }
}

/// Drops the verbatim records of a container's values (of the array's items, or the
/// object's members, at `span`).
fn forget_verbatim(items: &mut [Node], members: &mut [Member], span: Span, object: bool) {
    let forget = |v: &mut Node| {
        if let Node::Array(s) | Node::Object(s) = v {
            s.verbatim = 0;
        }
    };
    if object {
        members[span.range()]
            .iter_mut()
            .for_each(|m| forget(&mut m.value));
    } else {
        items[span.range()].iter_mut().for_each(forget);
    }
}

impl<'a> Sink<'a> for Tape<'a> {
    type Value = Node;
    const NUMBER_FORM: bool = true;
    const DECODE_NAMES: bool = true;
    const DECODE_VALUES: bool = true;

    fn decoded(&mut self) -> &mut Vec<u8> {
        &mut self.decoded
    }

    #[inline]
    fn string(&mut self, s: Str<'a>) -> Node {
        Node::Str(self.text(s))
    }

    #[inline]
    fn number(&mut self, n: Num<'a>) -> Node {
        // As serde_json's `arbitrary_precision` reads numbers: an integer that fits 64 bits
        // (but `-0`) is one, any other number keeps its text.
        if n.integer
            && let Some(m) = n.magnitude
        {
            if !n.negative {
                return Node::U64(m);
            }
            if m != 0 && m <= 1 << 63 {
                return Node::I64((m as i64).wrapping_neg());
            }
        }
        if n.normal {
            return Node::Number(Text {
                start: n.start as u32,
                len: n.text.len() as u32,
            });
        }
        let start = self.decoded.len();
        n.respell_into(&mut self.decoded);
        Node::Number(self.decoded_text(start))
    }

    #[inline]
    fn literal(&mut self, lit: Literal) -> Node {
        match lit {
            Literal::Null => Node::Null,
            Literal::True => Node::Bool(true),
            Literal::False => Node::Bool(false),
        }
    }

    fn number_form(&mut self, text: String) -> Node {
        let start = self.decoded.len();
        self.decoded.extend_from_slice(text.as_bytes());
        Node::Number(self.decoded_text(start))
    }

    #[inline]
    fn begin_array(&mut self, at: Mark) {
        self.frames
            .push(Frame::new(self.open_items.len(), at, self.verbatim.len()));
    }

    #[inline]
    fn element(&mut self, v: Node) {
        self.take(is_canonical(&v));
        self.open_items.push(v);
    }

    #[inline(always)]
    fn end_array(&mut self, last: Option<Node>, end: Mark) -> Node {
        let Some(mut frame) = self.frames.pop() else {
            return Node::Null;
        };
        let start = self.items.len();
        if let Some(v) = last {
            frame.canonical &= is_canonical(&v);
            // One element (a wrapper) needs no drain.
            if self.open_items.len() > frame.mark as usize {
                self.items
                    .extend(self.open_items.drain(frame.mark as usize..));
            }
            self.items.push(v);
        }
        let len = self.items.len() - start;
        Node::Array(self.close(frame, end, start, len, false))
    }

    #[inline]
    fn begin_object(&mut self, at: Mark) {
        self.frames
            .push(Frame::new(self.open_members.len(), at, self.verbatim.len()));
    }

    #[inline]
    fn name(&mut self, name: Str<'a>) -> Result<(), Refusal> {
        // Its value comes next (`member_value`); repeats are found as the object closes.
        let name = self.text(name);
        self.take(!name.is_decoded());
        self.open_members.push(Member {
            name,
            value: Node::Null,
        });
        Ok(())
    }

    #[inline]
    fn member_value(&mut self, v: Node) {
        self.take(is_canonical(&v));
        if let Some(last) = self.open_members.last_mut() {
            last.value = v;
        }
    }

    #[inline(always)]
    fn end_object(&mut self, last: Option<Node>, end: Mark) -> Result<Node, Refusal> {
        let Some(mut frame) = self.frames.pop() else {
            return Ok(Node::Null);
        };
        if let Some(v) = last {
            frame.canonical &= is_canonical(&v);
            if self.open_members.len() == frame.mark as usize + 1
                && let Some(mut m) = self.open_members.pop()
            {
                // One member (a wrapper): nothing to compare.
                m.value = v;
                let start = self.members.len();
                self.members.push(m);
                return Ok(Node::Object(self.close(frame, end, start, 1, true)));
            }
            if let Some(m) = self.open_members.last_mut() {
                m.value = v;
            }
        }
        self.end_wider_object(frame, end)
    }
}

impl<'a> Tape<'a> {
    /// [`Sink::end_object`] of an object of no member or more than one.
    #[inline(never)]
    fn end_wider_object(&mut self, mut frame: Frame, end: Mark) -> Result<Node, Refusal> {
        let mark = frame.mark as usize;
        let start = self.members.len();
        let (body, decoded) = (self.body.as_bytes(), self.decoded.as_slice());
        let name = |m: &Member| bytes_of(body, decoded, m.name);
        let open = &mut self.open_members[mark..];
        let len = open.len();
        let sorted = open.windows(2).all(|w| name(&w[0]) < name(&w[1]));
        if sorted {
            self.members.extend(self.open_members.drain(mark..));
        } else if len <= SORT_IN_PLACE {
            open.sort_unstable_by(|a, b| name(a).cmp(name(b)));
            if open.windows(2).any(|w| name(&w[0]) == name(&w[1])) {
                return Err(Refusal::Repeated);
            }
            self.members.extend(self.open_members.drain(mark..));
        } else {
            let order = &mut self.order;
            order.clear();
            order.extend(open.iter().enumerate().map(|(i, m)| order::key(name(m), i)));
            let full = |i: usize| name(&open[i]);
            order::sort(order, &mut self.order_spare, full);
            if order
                .windows(2)
                .any(|w| w[0].0 == w[1].0 && full(w[0].1) == full(w[1].1))
            {
                return Err(Refusal::Repeated);
            }
            self.members.extend(order.iter().map(|&(_, i)| open[i]));
            self.open_members.truncate(mark);
        }
        frame.canonical &= sorted;
        Ok(Node::Object(self.close(frame, end, start, len, true)))
    }
}
