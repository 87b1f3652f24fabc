//! The repeated-member check: the [`Sink`] that builds nothing and remembers the member names
//! of the objects still open, each name compared by its text (escapes decoded).
//!
//! An object's names wait on one stack, each as where its text lies (in the body, or, where
//! it had escapes, in a buffer of decoded names). A small object (up to [`SMALL_OBJECT`]
//! names) looks for a repeat by comparing each new name with the others. A wider one compares
//! each new name with the one before only (the same name is a repeat), counting the names
//! that go down, and looks for repeats among all its names when it closes: none if they
//! came in order, a binary search of the longest run in order for each other name if they
//! came nearly in order, else by hash (`hashed.rs`). Linear time, whatever the names.
//!
//! Looking later finds the same repeats: should the text stop being JSON before a wide
//! object closes, its names read so far are looked at then ([`Sink::refused`]), so that a
//! text that repeats a name before it stops being JSON is "repeated", as when each name is
//! looked up as it comes.

use std::cmp::Ordering;

use super::Refusal;
use super::hashed::{self, Scratch};
use super::order::{compare, same};
use super::parse::{Literal, Mark, Num, Sink, Str};

/// Objects with up to this many members look for a repeated name by comparing it with each;
/// a larger one hashes its names.
pub(super) const SMALL_OBJECT: usize = 16;

/// Where a name's text lies: in the body, or (with [`Name::DECODED`] in `len`) in
/// [`Names::decoded`].
#[derive(Clone, Copy)]
struct Name {
    start: usize,
    len: usize,
}

impl Name {
    const DECODED: usize = 1 << (usize::BITS - 1);
}

/// An open wide object (one with more than [`SMALL_OBJECT`] names so far, its repeats
/// looked for as it closes).
struct Wide {
    /// Which open object it is (an index in [`Names::objects`]).
    object: usize,
    /// How many of its names are less than the name before, and where the first few of
    /// those are kept on [`Names::descents`].
    descents: usize,
    descents_at: usize,
}

/// The check in progress.
pub(super) struct Names<'a> {
    body: &'a [u8],
    /// The names of the open objects, innermost last.
    names: Vec<Name>,
    /// The text of the names read so far that had escapes (kept until the check ends: it is
    /// never longer than the body, and an object's end then has nothing of it to give back).
    decoded: Vec<u8>,
    /// Where each open object's names start on `names`, innermost last, and where the
    /// innermost's do (kept apart: it is read for every name).
    objects: Vec<usize>,
    base: usize,
    /// The open objects that are wide, innermost last.
    wide: Vec<Wide>,
    /// Where names of the open wide objects are less than the name before (the first
    /// [`FEW_RUNS`] of each), innermost last.
    descents: Vec<usize>,
    scratch: Scratch,
}

/// The most names a wide object has (their indices fit the low half of a slot); an object
/// with more (a body of 16 GiB at least) is not read.
const MAX_NAMES: usize = u32::MAX as usize - 1;

impl<'a> Names<'a> {
    pub fn new(body: &'a [u8]) -> Names<'a> {
        Names {
            body,
            names: Vec::new(),
            decoded: Vec::new(),
            objects: Vec::new(),
            base: 0,
            wide: Vec::new(),
            descents: Vec::new(),
            scratch: Scratch::default(),
        }
    }

    #[inline(always)]
    fn text(&self, name: Name) -> &[u8] {
        let (whole, len) = if name.len & Name::DECODED == 0 {
            (self.body, name.len)
        } else {
            (self.decoded.as_slice(), name.len & !Name::DECODED)
        };
        &whole[name.start..name.start + len]
    }

    /// Where a name's text lies.
    #[inline]
    fn name_of(&mut self, s: Str<'a>) -> Name {
        if !s.escaped {
            return Name {
                start: s.start,
                len: s.raw.len(),
            };
        }
        // Decoded by the reader as it read it (`Sink::DECODE_NAMES`).
        debug_assert!(s.decoded.is_some());
        let start = s.decoded.unwrap_or(self.decoded.len());
        Name {
            start,
            len: (self.decoded.len() - start) | Name::DECODED,
        }
    }

    /// The innermost object's next name but the first [`SMALL_OBJECT`] of a wide object:
    /// compared with each of the others in a small object, with the one before in a wide one
    /// (see `repeats`).
    #[inline(always)]
    fn add(&mut self, name: Name) -> Result<(), Refusal> {
        let text = self.text(name);
        let known = &self.names[self.base..];
        if let Some(&last) = known.get(SMALL_OBJECT..).and_then(|wide| wide.last()) {
            // Past a few runs, the names are hashed when the object closes: no more to count.
            if self.wide.last().is_some_and(|w| w.descents <= FEW_RUNS) {
                match compare(text, self.text(last)) {
                    Ordering::Equal => return Err(Refusal::Repeated),
                    Ordering::Less => self.descent(self.names.len()),
                    Ordering::Greater => {}
                }
            }
        } else if known.iter().any(|&n| same(self.text(n), text)) {
            return Err(Refusal::Repeated);
        }
        self.names.push(name);
        Ok(())
    }

    /// A name with escapes, the name that makes its object wide, or one of an object with
    /// too many.
    #[inline(never)]
    fn other_name(&mut self, s: Str<'a>) -> Result<(), Refusal> {
        let base = self.base;
        let Some(object) = self.objects.len().checked_sub(1) else {
            return Err(Refusal::NotJson);
        };
        let count = self.names.len() - base;
        if count >= MAX_NAMES {
            return Err(Refusal::NotJson);
        }
        let name = self.name_of(s);
        if count != SMALL_OBJECT {
            return self.add(name);
        }
        let text = self.text(name);
        if self.names[base..].iter().any(|&n| same(self.text(n), text)) {
            return Err(Refusal::Repeated);
        }
        // Wide from this name on: where its names so far go down.
        self.wide.push(Wide {
            object,
            descents: 0,
            descents_at: self.descents.len(),
        });
        self.names.push(name);
        for i in base + 1..self.names.len() {
            if compare(self.text(self.names[i]), self.text(self.names[i - 1])).is_lt() {
                self.descent(i);
            }
        }
        Ok(())
    }

    /// The innermost (wide) object's name at `at` (on [`Names::names`]) is less than the one
    /// before it: counted, and where it is kept while there are few.
    fn descent(&mut self, at: usize) {
        if let Some(wide) = self.wide.last_mut() {
            wide.descents += 1;
            if wide.descents <= FEW_RUNS {
                self.descents.push(at);
            }
        }
    }

    /// [`Sink::end_object`] of a wide object: `object` (which it was of the open objects) with
    /// its names from `base` on.
    #[inline(never)]
    fn end_wide_object(&mut self, object: usize, base: usize) -> Result<(), Refusal> {
        if let Some(wide) = self.wide.pop_if(|w| w.object == object) {
            if self.repeats(base, self.names.len(), wide.descents, wide.descents_at) {
                return Err(Refusal::Repeated);
            }
            self.descents.truncate(wide.descents_at);
        }
        self.names.truncate(base);
        Ok(())
    }

    /// Whether two of the names at `from..to` are equal, `descents` of them being less than
    /// the name before (never equal to it), the first few of those kept on
    /// [`Names::descents`] from `descents_at`. Names that come sorted have no repeats, and
    /// names that come nearly sorted (a few runs, one holding nearly all of them) are looked
    /// up in the longest run, each by a binary search (the others' own repeats as below).
    /// Otherwise, by hash: [`Names::hashed_repeats`].
    fn repeats(&mut self, from: usize, to: usize, descents: usize, descents_at: usize) -> bool {
        let n = to - from;
        if descents == 0 {
            return false;
        }
        if descents <= FEW_RUNS {
            // The runs, and the longest.
            let mut longest = (from, from);
            let mut start = from;
            let ends = self.descents[descents_at..descents_at + descents].iter();
            for &end in ends.chain([&to]) {
                if end - start > longest.1 - longest.0 {
                    longest = (start, end);
                }
                start = end;
            }
            let run = &self.names[longest.0..longest.1];
            let others: Vec<Name> = self.names[from..longest.0]
                .iter()
                .chain(&self.names[longest.1..to])
                .copied()
                .collect();
            if others.len() * 8 <= n {
                let found = |&other: &Name| {
                    let text = self.text(other);
                    run.binary_search_by(|&n| compare(self.text(n), text))
                        .is_ok()
                };
                if others.iter().any(found) {
                    return true;
                }
                return self.hashed_repeats(&others);
            }
        }
        let names = std::mem::take(&mut self.names);
        let repeated = self.hashed_repeats(&names[from..to]);
        self.names = names;
        repeated
    }

    /// Whether two of `names` are equal, by their hashes (`hashed.rs`).
    fn hashed_repeats(&mut self, names: &[Name]) -> bool {
        let mut scratch = std::mem::take(&mut self.scratch);
        let repeated = hashed::repeats(names.len(), |i| self.text(names[i]), &mut scratch);
        self.scratch = scratch;
        repeated
    }
}

/// The most runs of names in order (less one) an object is looked at run by run.
const FEW_RUNS: usize = 8;

impl<'a> Sink<'a> for Names<'a> {
    type Value = ();
    const NUMBER_FORM: bool = false;
    const DECODE_NAMES: bool = true;
    const DECODE_VALUES: bool = false;

    fn decoded(&mut self) -> &mut Vec<u8> {
        &mut self.decoded
    }

    #[inline]
    fn string(&mut self, _: Str<'a>) {}
    #[inline]
    fn number(&mut self, _: Num<'a>) {}
    #[inline]
    fn literal(&mut self, _: Literal) {}
    fn number_form(&mut self, _: String) {}
    #[inline]
    fn begin_array(&mut self, _: Mark) {}
    #[inline]
    fn element(&mut self, _: ()) {}
    #[inline]
    fn end_array(&mut self, _: Option<()>, _: Mark) {}
    #[inline]
    fn member_value(&mut self, _: ()) {}

    #[inline(always)]
    fn begin_object(&mut self, _: Mark) {
        self.base = self.names.len();
        self.objects.push(self.base);
    }

    #[inline(always)]
    fn name(&mut self, s: Str<'a>) -> Result<(), Refusal> {
        let count = self.names.len() - self.base;
        if s.escaped || count == SMALL_OBJECT || count >= MAX_NAMES {
            return self.other_name(s);
        }
        // The common case, inlined: a name as written.
        self.add(Name {
            start: s.start,
            len: s.raw.len(),
        })
    }

    #[inline(always)]
    fn end_object(&mut self, _: Option<()>, _: Mark) -> Result<(), Refusal> {
        let base = self.base;
        if self.objects.pop().is_none() {
            return Ok(());
        }
        self.base = self.objects.last().copied().unwrap_or(0);
        let object = self.objects.len();
        if self.names.len() - base > SMALL_OBJECT {
            return self.end_wide_object(object, base);
        }
        self.names.truncate(base);
        Ok(())
    }

    /// The wide objects still open may repeat a name read before the text stopped being
    /// JSON (a small one would have said so as it came).
    #[cold]
    fn refused(&mut self) -> Refusal {
        for i in 0..self.wide.len() {
            let Wide {
                object,
                descents,
                descents_at,
            } = self.wide[i];
            let from = self.objects[object];
            let to = self
                .objects
                .get(object + 1)
                .map_or(self.names.len(), |&next| next);
            if self.repeats(from, to, descents, descents_at) {
                return Refusal::Repeated;
            }
        }
        Refusal::NotJson
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::json::{MAX_DEPTH, has_duplicate_member, is_ambiguous};

    /// A body too deep to read whole is refused by the check alone too: a repeat may lie past the
    /// deep part, where the check no longer reads. Not JSON in other ways, it is not refused.
    #[test]
    fn a_body_too_deep_to_check_is_ambiguous() {
        let deep = |depth: usize| format!("{}1{}", "[".repeat(depth), "]".repeat(depth));
        let body = |depth: usize| format!(r#"{{"pad":{},"amount":1,"amount":1000}}"#, deep(depth));
        // Within the bound, the repeat after the deep part is found.
        assert_eq!(
            has_duplicate_member(body(MAX_DEPTH - 1).as_bytes()),
            Some(true)
        );
        assert!(is_ambiguous(body(MAX_DEPTH - 1).as_bytes()));
        // Past it, the check stops before the repeat: refused for the depth.
        assert_eq!(has_duplicate_member(body(MAX_DEPTH).as_bytes()), None);
        assert!(is_ambiguous(body(MAX_DEPTH).as_bytes()));
        let clean = format!(r#"{{"pad":{},"amount":1}}"#, deep(MAX_DEPTH));
        assert!(is_ambiguous(clean.as_bytes()), "too deep, repeat or not");
        let fine = format!(r#"{{"pad":{},"amount":1}}"#, deep(MAX_DEPTH - 1));
        assert!(!is_ambiguous(fine.as_bytes()));
        // Not JSON, but not deep: the upstream answers it.
        for text in ["not json", "{\"a\":", "[1,]", ""] {
            assert!(!is_ambiguous(text.as_bytes()), "{text}");
        }
        // Not JSON before it goes deep: not JSON (an error first in the text wins).
        assert!(!is_ambiguous(
            format!("[x,{}]", deep(MAX_DEPTH + 1)).as_bytes()
        ));
        // A repeat before the deep part: repeated.
        let first = format!(r#"{{"a":1,"a":2,"pad":{}}}"#, deep(MAX_DEPTH + 5));
        assert_eq!(has_duplicate_member(first.as_bytes()), Some(true));
    }

    #[test]
    fn names_compare_as_their_bytes() {
        let texts: [&[u8]; 7] = [
            b"",
            b"a",
            b"ab",
            b"abcdefgh",
            b"abcdefghi",
            b"abcdefgi",
            b"b",
        ];
        for a in texts {
            for b in texts {
                assert_eq!(compare(a, b), a.cmp(b));
                assert_eq!(same(a, b), a == b);
            }
        }
    }
}
