//! The byte-level pieces of reading a JSON string: finding where a run of plain characters
//! ends (eight bytes at a time), the short escapes, and `\u` hex digits. Leaf functions
//! of the reader (`parse.rs`), kept apart so that the reader's file holds its grammar.

use super::Refusal;

/// Where the first byte from `i` on is one a string's scan stops at ([`STOP`]), or the end,
/// byte by byte: the last few bytes of a body, after [`scan_words`].
#[inline(always)]
fn scan(raw: &[u8], mut i: usize) -> usize {
    while i < raw.len() && !STOP[raw[i] as usize] {
        i += 1;
    }
    i
}

/// Where a run of plain characters ends (a string's, or one between its escapes), 8 bytes
/// at a time: none of a word's bytes is a [`STOP`] if the word has no byte equal to `"` or
/// `\` nor below 0x20, which a few operations on the word find at once (the lowest such byte
/// exactly, the one used). A name or short value ends within its first word: one branch,
/// where a byte-by-byte scan has one per byte and mispredicts the last wherever lengths vary
/// (measured: the check of 100,000 names of 1 to 5 bytes, 2.34 -> 2.09 ms).
#[inline]
pub(super) fn scan_words(raw: &[u8], i: usize) -> usize {
    // Escapes side by side leave runs of no byte: no word to read for those.
    if raw.get(i).is_none_or(|&b| STOP[b as usize]) {
        return i;
    }
    scan_run(raw, i)
}

/// [`scan_words`] without its first look at one byte: for where a string starts, which is
/// seldom where it ends.
#[inline(always)]
pub(super) fn scan_run(raw: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let below = |v: u64, n: u64| v.wrapping_sub(ONES * n) & !v & HIGH;
    while let Some(bytes) = raw.get(i..i + 8) {
        let mut w = [0u8; 8];
        w.copy_from_slice(bytes);
        let w = u64::from_le_bytes(w);
        let quote = below(w ^ (ONES * u64::from(b'"')), 1);
        let backslash = below(w ^ (ONES * u64::from(b'\\')), 1);
        let stop = quote | backslash | below(w, 0x20);
        if stop != 0 {
            return i + (stop.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    scan(raw, i)
}

/// Bytes a string's scan stops at: the quote, the backslash and control characters (which
/// JSON does not allow unescaped in a string).
static STOP: [bool; 256] = {
    let mut t = [false; 256];
    let mut i = 0;
    while i < 0x20 {
        t[i] = true;
        i += 1;
    }
    t[b'"' as usize] = true;
    t[b'\\' as usize] = true;
    t
};

/// What each letter after a backslash stands for, but `u` (0: not an escape).
pub(super) static SHORT_ESCAPES: [u8; 256] = {
    let mut t = [0u8; 256];
    t[b'"' as usize] = b'"';
    t[b'\\' as usize] = b'\\';
    t[b'/' as usize] = b'/';
    t[b'b' as usize] = 0x08;
    t[b'f' as usize] = 0x0c;
    t[b'n' as usize] = b'\n';
    t[b'r' as usize] = b'\r';
    t[b't' as usize] = b'\t';
    t
};

/// Four hex digits at `at`.
#[inline]
pub(super) fn hex4(raw: &[u8], at: usize) -> Result<u32, Refusal> {
    let digits = raw.get(at..at + 4).ok_or(Refusal::NotJson)?;
    let mut n = 0;
    let mut bad = 0;
    for &d in digits {
        let v = HEX[d as usize];
        bad |= v;
        n = n << 4 | u32::from(v & 0xf);
    }
    if bad & 0x10 != 0 {
        return Err(Refusal::NotJson);
    }
    Ok(n)
}

/// Each byte's value as a hex digit, or 0x10 if it is not one.
static HEX: [u8; 256] = {
    let mut t = [0x10u8; 256];
    let mut i = 0;
    while i < 10 {
        t[b'0' as usize + i] = i as u8;
        i += 1;
    }
    let mut i = 0;
    while i < 6 {
        t[b'a' as usize + i] = 10 + i as u8;
        t[b'A' as usize + i] = 10 + i as u8;
        i += 1;
    }
    t
};
