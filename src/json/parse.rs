//! The one reader of JSON text: a single pass over the bytes, with an explicit stack (no
//! recursion), that hands what it reads to a [`Sink`]: the document builder (`tape.rs`) or
//! the repeated-member check (`names.rs`).
//!
//! It accepts exactly what serde_json's `from_slice` accepts (RFC 8259: white space, literals,
//! numbers, strings with their escapes, paired surrogates and valid UTF-8), but nests to
//! [`MAX_DEPTH`] containers where serde_json stops one short. Errors are found in the order of
//! the text, as serde_json finds them: a repeated name is reported when the name is read, so a
//! text that repeats a name before it stops being JSON is "repeated" to the check.
//!
//! Bytes are read once, plus one `str::from_utf8` over the whole body up front: strings are
//! then slices of a `&str` without a second look at their bytes. A body whose UTF-8 breaks
//! somewhere is still read in order up to the first string or token that reaches the break
//! (so the order of errors is the same).

use super::scan::{SHORT_ESCAPES, hex4, scan_run, scan_words};
use super::{MAX_DEPTH, NUMBER_TOKEN, Refusal};

/// What the reader hands its values to. `Value` is what a finished value is to the sink (a
/// node of the document, or nothing for the check).
pub(super) trait Sink<'a> {
    type Value;
    /// Whether an object whose first member is named [`NUMBER_TOKEN`] is a number, as
    /// serde_json's own `Value` reads it (see [`Reader::number_form`]).
    const NUMBER_FORM: bool;
    fn string(&mut self, s: Str<'a>) -> Self::Value;
    fn number(&mut self, n: Num<'a>) -> Self::Value;
    fn literal(&mut self, lit: Literal) -> Self::Value;
    /// Whether the reader decodes the names, and the string values, that have escapes, as
    /// it reads them, into [`Sink::decoded`].
    const DECODE_NAMES: bool;
    const DECODE_VALUES: bool;
    fn decoded(&mut self) -> &mut Vec<u8>;
    /// A number spelled as an object ([`Sink::NUMBER_FORM`]): its text, as serde_json keeps it.
    fn number_form(&mut self, text: String) -> Self::Value;
    /// An array opens at `at` (its `[`).
    fn begin_array(&mut self, at: Mark);
    /// The next element of the innermost open array, but its last.
    fn element(&mut self, v: Self::Value);
    /// The innermost open array ends at `end` (past its `]`); `last` is its last element
    /// (`None`: it has none).
    fn end_array(&mut self, last: Option<Self::Value>, end: Mark) -> Self::Value;
    fn begin_object(&mut self, at: Mark);
    /// The next member's name; refused if the check knows it repeats.
    fn name(&mut self, name: Str<'a>) -> Result<(), Refusal>;
    /// The value of the member just named, but the object's last.
    fn member_value(&mut self, v: Self::Value);
    /// The innermost open object ends at `end`; `last` is the value of its last member
    /// (`None`: it has none). Refused if a name repeats (the builder finds repeats here, as
    /// it sorts).
    fn end_object(&mut self, last: Option<Self::Value>, end: Mark) -> Result<Self::Value, Refusal>;
    /// The text is not JSON from here on: whether it repeated a name before.
    fn refused(&mut self) -> Refusal {
        Refusal::NotJson
    }
}

/// Where the reader is in the text: a byte offset, and how many bytes of white space it
/// skipped before it (a container without white space inside skips none between its ends).
#[derive(Debug, Clone, Copy)]
pub(super) struct Mark {
    pub pos: usize,
    pub spaces: usize,
}

/// A string as written between its quotes: valid UTF-8, escapes checked but not decoded.
#[derive(Debug, Clone, Copy)]
pub(super) struct Str<'a> {
    pub raw: &'a [u8],
    /// Where `raw` starts in the body.
    pub start: usize,
    pub escaped: bool,
    /// Where the reader decoded it (a string with escapes that the sink wants decoded): its
    /// text is the sink's [`Sink::decoded`] from there to the end.
    pub decoded: Option<usize>,
}

/// A number as written, checked against the grammar.
#[derive(Debug, Clone, Copy)]
pub(super) struct Num<'a> {
    pub text: &'a [u8],
    /// Where `text` starts in the body.
    pub start: usize,
    /// No fraction and no exponent.
    pub integer: bool,
    pub negative: bool,
    /// The value of the digits before any fraction, where it fits 64 bits.
    pub magnitude: Option<u64>,
    /// Spelled as serde_json keeps it: no `E`, and an exponent with its sign.
    pub normal: bool,
}

impl<'a> Num<'a> {
    /// The text serde_json's `arbitrary_precision` keeps for the number: as written, with `E`
    /// written `e` and an exponent's missing `+` added.
    /// Only for a number that is not [`Num::normal`].
    pub fn respell_into(self, out: &mut Vec<u8>) {
        let mut bytes = self.text.iter().copied().peekable();
        while let Some(b) = bytes.next() {
            if b == b'e' || b == b'E' {
                out.push(b'e');
                if !matches!(bytes.peek(), Some(b'+' | b'-')) {
                    out.push(b'+');
                }
            } else {
                out.push(b);
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Literal {
    Null,
    True,
    False,
}

/// The longest prefix of a body that is UTF-8: the body itself, if it is JSON.
pub(super) fn utf8_prefix(raw: &[u8]) -> &str {
    match std::str::from_utf8(raw) {
        Ok(text) => text,
        Err(e) => std::str::from_utf8(&raw[..e.valid_up_to()]).unwrap_or(""),
    }
}

/// Reads a whole JSON text into `sink`: its value, or why the text is refused. `text` is
/// [`utf8_prefix`] of `raw`: whatever reaches past it is refused when it is read, so errors
/// are found in the text's order.
pub(super) fn read<'a, S: Sink<'a>>(
    raw: &'a [u8],
    text: &'a str,
    sink: &mut S,
) -> Result<S::Value, Refusal> {
    let mut reader = Reader {
        raw,
        text,
        pos: 0,
        spaces: 0,
    };
    reader.run(sink).map_err(|e| match e {
        Refusal::NotJson => sink.refused(),
        // A repeat read before the text went too deep comes first, as errors do.
        Refusal::TooDeep => match sink.refused() {
            Refusal::Repeated => Refusal::Repeated,
            _ => Refusal::TooDeep,
        },
        Refusal::Repeated => Refusal::Repeated,
    })
}

/// Where the reader is: `text` is the longest valid UTF-8 prefix of `raw`.
struct Reader<'a> {
    raw: &'a [u8],
    text: &'a str,
    pos: usize,
    /// Bytes of white space skipped so far.
    spaces: usize,
}

impl<'a> Reader<'a> {
    /// The text's value. The stack of open containers is [`MAX_DEPTH`] flags at most (the
    /// sink keeps what else it needs of each).
    fn run<S: Sink<'a>>(&mut self, sink: &mut S) -> Result<S::Value, Refusal> {
        let mut depth = 0usize;
        // Whether each open container is an object (rather than an array), outermost first.
        let mut objects = [false; MAX_DEPTH];
        let root = 'text: loop {
            // A value starts here.
            let mut value = match self.peek()? {
                b'{' => {
                    if depth == MAX_DEPTH {
                        return Err(Refusal::TooDeep);
                    }
                    let open = self.mark();
                    self.pos += 1;
                    match self.peek()? {
                        b'}' => {
                            self.pos += 1;
                            sink.begin_object(open);
                            sink.end_object(None, self.mark())?
                        }
                        b'"' => {
                            let name = self.string(S::DECODE_NAMES.then(|| sink.decoded()))?;
                            if S::NUMBER_FORM && is_number_token(name, sink.decoded()) {
                                self.number_form(sink)?
                            } else {
                                objects[depth] = true;
                                depth += 1;
                                sink.begin_object(open);
                                sink.name(name)?;
                                self.colon()?;
                                continue 'text;
                            }
                        }
                        _ => return Err(Refusal::NotJson),
                    }
                }
                b'[' => {
                    if depth == MAX_DEPTH {
                        return Err(Refusal::TooDeep);
                    }
                    sink.begin_array(self.mark());
                    self.pos += 1;
                    if self.peek()? == b']' {
                        self.pos += 1;
                        sink.end_array(None, self.mark())
                    } else {
                        objects[depth] = false;
                        depth += 1;
                        continue 'text;
                    }
                }
                b'"' => {
                    let s = self.string(S::DECODE_VALUES.then(|| sink.decoded()))?;
                    sink.string(s)
                }
                b'-' | b'0'..=b'9' => {
                    let n = self.number()?;
                    sink.number(n)
                }
                b't' => sink.literal(self.literal(b"true", Literal::True)?),
                b'f' => sink.literal(self.literal(b"false", Literal::False)?),
                b'n' => sink.literal(self.literal(b"null", Literal::Null)?),
                _ => return Err(Refusal::NotJson),
            };
            // A value ended: it goes into its container, and the containers it ends close
            // (the last value of each goes with its end, not through the sink's stack).
            loop {
                if depth == 0 {
                    break 'text value;
                }
                let in_object = objects[depth - 1];
                match self.peek()? {
                    b',' => {
                        self.pos += 1;
                        if in_object {
                            sink.member_value(value);
                            if self.peek()? != b'"' {
                                return Err(Refusal::NotJson);
                            }
                            let name = self.string(S::DECODE_NAMES.then(|| sink.decoded()))?;
                            sink.name(name)?;
                            self.colon()?;
                        } else {
                            sink.element(value);
                        }
                        continue 'text;
                    }
                    b'}' if in_object => {
                        self.pos += 1;
                        depth -= 1;
                        value = sink.end_object(Some(value), self.mark())?;
                    }
                    b']' if !in_object => {
                        self.pos += 1;
                        depth -= 1;
                        value = sink.end_array(Some(value), self.mark());
                    }
                    _ => return Err(Refusal::NotJson),
                }
            }
        };
        // Only white space may follow.
        match self.peek() {
            Err(_) => Ok(root),
            Ok(_) => Err(Refusal::NotJson),
        }
    }

    fn mark(&self) -> Mark {
        Mark {
            pos: self.pos,
            spaces: self.spaces,
        }
    }

    /// Skips white space; the next byte, refused at the end of the text.
    #[inline]
    fn peek(&mut self) -> Result<u8, Refusal> {
        match self.raw.get(self.pos) {
            Some(&b) if b > b' ' => Ok(b),
            _ => self.skip_spaces(),
        }
    }

    fn skip_spaces(&mut self) -> Result<u8, Refusal> {
        while let Some(&b) = self.raw.get(self.pos) {
            if !matches!(b, b' ' | b'\n' | b'\t' | b'\r') {
                return Ok(b);
            }
            self.pos += 1;
            self.spaces += 1;
        }
        Err(Refusal::NotJson)
    }

    fn colon(&mut self) -> Result<(), Refusal> {
        if self.peek()? != b':' {
            return Err(Refusal::NotJson);
        }
        self.pos += 1;
        Ok(())
    }

    fn literal(&mut self, word: &[u8], lit: Literal) -> Result<Literal, Refusal> {
        if !self.raw[self.pos..].starts_with(word) {
            return Err(Refusal::NotJson);
        }
        self.pos += word.len();
        Ok(lit)
    }

    /// A string; the reader is at its opening quote. The common case (no escapes) is
    /// inlined into the reader's loop; escapes and errors are read apart, and decoded into
    /// `out` if given.
    #[inline(always)]
    fn string(&mut self, out: Option<&mut Vec<u8>>) -> Result<Str<'a>, Refusal> {
        let start = self.pos + 1;
        let raw = self.raw;
        let mut i = scan_run(raw, start);
        let escaped = raw.get(i) != Some(&b'"');
        let mut decoded = None;
        if escaped {
            decoded = out.as_ref().map(|out| out.len());
            // Only the end comes back (in a register, not through memory).
            i = self.escaped_string(start, i, out)?;
        }
        self.pos = i + 1;
        // Past the valid UTF-8 (`text`), it is not a string. Short of it, it is UTF-8: it
        // starts and ends at a quote, which is a character of its own.
        if i > self.text.len() {
            return Err(Refusal::NotJson);
        }
        Ok(Str {
            raw: &raw[start..i],
            start,
            escaped,
            decoded,
        })
    }

    /// Where a string that starts at `start` ends (its closing quote), read on from `i`,
    /// where its first escape (or an error) is; its text decoded into `out` if given.
    #[inline(never)]
    fn escaped_string(
        &self,
        start: usize,
        mut i: usize,
        mut out: Option<&mut Vec<u8>>,
    ) -> Result<usize, Refusal> {
        let raw = self.raw;
        let mut run = start;
        loop {
            // Runs start and end at ASCII bytes: whole characters (`string` refuses a string
            // that is not UTF-8).
            if let Some(out) = out.as_deref_mut()
                && run < i
            {
                append_run(out, raw, run, i);
            }
            match raw.get(i) {
                Some(b'"') => return Ok(i),
                Some(b'\\') => {
                    let (next, c) = self.escape(i)?;
                    if let Some(out) = out.as_deref_mut() {
                        if c.is_ascii() {
                            out.push(c as u8);
                        } else {
                            out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes());
                        }
                    }
                    i = next;
                }
                // A control character, or the end of the text.
                _ => return Err(Refusal::NotJson),
            }
            run = i;
            i = scan_words(raw, i);
        }
    }

    /// Reads the escape at `at` (a backslash): where the string goes on after it, and the
    /// character it stands for. A `\u` escape of a surrogate must be a leading one followed by
    /// a trailing one (serde_json reads strings as text, which has no lone surrogates).
    #[inline]
    fn escape(&self, at: usize) -> Result<(usize, char), Refusal> {
        let e = *self.raw.get(at + 1).ok_or(Refusal::NotJson)?;
        if e != b'u' {
            // One of the escapes of one letter (by table: no jump between eight cases).
            return match SHORT_ESCAPES[e as usize] {
                0 => Err(Refusal::NotJson),
                c => Ok((at + 2, c as char)),
            };
        }
        let n = hex4(self.raw, at + 2)?;
        let (c, len) = match n {
            0xDC00..=0xDFFF => return Err(Refusal::NotJson),
            0xD800..=0xDBFF => {
                let next = at + 6;
                if self.raw.get(next..next + 2) != Some(b"\\u") {
                    return Err(Refusal::NotJson);
                }
                match hex4(self.raw, next + 2)? {
                    low @ 0xDC00..=0xDFFF => (0x1_0000 + ((n - 0xD800) << 10) + (low - 0xDC00), 12),
                    _ => return Err(Refusal::NotJson),
                }
            }
            _ => (n, 6),
        };
        let c = char::from_u32(c).ok_or(Refusal::NotJson)?;
        Ok((at + len, c))
    }

    /// A number; the reader is at its first byte (`-` or a digit).
    #[inline(always)]
    fn number(&mut self) -> Result<Num<'a>, Refusal> {
        let raw = self.raw;
        let start = self.pos;
        let digit = |i: usize| raw.get(i).is_some_and(u8::is_ascii_digit);
        let digits = |mut i: usize| {
            while digit(i) {
                i += 1;
            }
            i
        };
        let mut i = start;
        let negative = raw[i] == b'-';
        if negative {
            i += 1;
        }
        // One leading zero, or digits from 1 on; a digit after a leading zero is refused
        // where the value is to end.
        let mut magnitude = Some(0u64);
        match raw.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                while let Some(&d @ b'0'..=b'9') = raw.get(i) {
                    magnitude = magnitude
                        .and_then(|m| m.checked_mul(10))
                        .and_then(|m| m.checked_add(u64::from(d - b'0')));
                    i += 1;
                }
            }
            _ => return Err(Refusal::NotJson),
        }
        let mut integer = true;
        let mut normal = true;
        if raw.get(i) == Some(&b'.') {
            integer = false;
            if !digit(i + 1) {
                return Err(Refusal::NotJson);
            }
            i = digits(i + 1);
        }
        if let Some(&e @ (b'e' | b'E')) = raw.get(i) {
            integer = false;
            normal &= e == b'e';
            i += 1;
            match raw.get(i) {
                Some(b'+' | b'-') => i += 1,
                _ => normal = false,
            }
            if !digit(i) {
                return Err(Refusal::NotJson);
            }
            i = digits(i + 1);
        }
        if i > self.text.len() {
            return Err(Refusal::NotJson);
        }
        let text = &raw[start..i];
        self.pos = i;
        Ok(Num {
            text,
            start,
            integer,
            negative,
            magnitude,
            normal,
        })
    }

    /// The rest of an object whose first name is [`NUMBER_TOKEN`], which serde_json's `Value`
    /// reads as a number: a string that is a number, then the object's end.
    #[cold]
    fn number_form<S: Sink<'a>>(&mut self, sink: &mut S) -> Result<S::Value, Refusal> {
        self.colon()?;
        if self.peek()? != b'"' {
            return Err(Refusal::NotJson);
        }
        let mut decoded = Vec::new();
        let s = self.string(Some(&mut decoded))?;
        let text = if s.escaped {
            String::from_utf8(decoded).map_err(|_| Refusal::NotJson)?
        } else {
            String::from_utf8(s.raw.to_vec()).map_err(|_| Refusal::NotJson)?
        };
        let number: serde_json::Number = text.parse().map_err(|_| Refusal::NotJson)?;
        if self.peek()? != b'}' {
            return Err(Refusal::NotJson);
        }
        self.pos += 1;
        Ok(sink.number_form(number.to_string()))
    }
}

/// Appends `raw[from..to]` to `out`. A run of up to 8 bytes (most runs between escapes) is
/// copied as one word where the body has 8 bytes from `from`, then cut to its length: a
/// call to `memcpy` costs more than such a run.
#[inline(always)]
fn append_run(out: &mut Vec<u8>, raw: &[u8], from: usize, to: usize) {
    let len = out.len();
    match raw[from..].first_chunk::<8>() {
        Some(word) if to - from <= 8 => {
            out.extend_from_slice(word);
            out.truncate(len + (to - from));
        }
        _ => out.extend_from_slice(&raw[from..to]),
    }
}

/// Whether a name is [`NUMBER_TOKEN`]; `decoded` holds its text if it had escapes.
fn is_number_token(name: Str<'_>, decoded: &[u8]) -> bool {
    match name.decoded {
        Some(from) => decoded.get(from..) == Some(NUMBER_TOKEN.as_bytes()),
        None => name.raw == NUMBER_TOKEN.as_bytes(),
    }
}
