//! The canonical order of a large object's members (by the bytes of their names) when they
//! do not come in it, in time linear in their number for the orders bodies come in:
//!
//! - nearly sorted (a few runs in order, one of them holding nearly every name): the others
//!   sorted, then merged with the longest run in one pass;
//! - any other: a radix sort (least significant byte first, stable) of the names' first 8
//!   bytes, skipping the bytes that all names share, then the names whose first 8 bytes are
//!   equal sorted among themselves by comparison (few, unless many names share a long
//!   prefix: then `n log n` comparisons at most, as any sort of them takes).
//!
//! Each name is a key: its first 8 bytes, zero-padded, as a big-endian number (keys order as
//! the names do, but for names equal in those 8 bytes), and its index in the object.

use std::cmp::Ordering;

/// A name's first 8 bytes as a big-endian number, and its index.
pub(super) type Key = (u64, usize);

/// The key of a name. A name shorter than 8 bytes is read in two overlapping loads (of 4
/// bytes, or 1 and 2) rather than copied into a zeroed word: a copy of a length known only
/// at run time is a call, and reading the word back stalls on the bytes just stored.
#[inline]
pub(super) fn key(name: &[u8], index: usize) -> Key {
    let n = name.len();
    let word = if n >= 8 {
        be_word(&name[..8])
    } else if n >= 4 {
        // The first 4 bytes at the top, the last 4 just below where they end in the word;
        // where the two overlap, they hold the same bytes.
        let first = u64::from(be_u32(&name[..4])) << 32;
        let last = u64::from(be_u32(&name[n - 4..])) << (8 * (8 - n));
        first | last
    } else if n > 0 {
        // The first byte, the middle one (the first again for 1 or 2 bytes) and the last.
        let at = |i: usize| u64::from(name[i]) << (8 * (7 - i));
        at(0) | at(n / 2) | at(n - 1)
    } else {
        0
    };
    (word, index)
}

/// At most this many runs (less one) count as nearly sorted.
const FEW_RUNS: usize = 8;

/// Sorts `keys` into the order of their names' bytes (`name(i)` is name `i`'s text), names
/// that are equal side by side; `spare` is a buffer to work in.
pub(super) fn sort<'n>(
    keys: &mut Vec<Key>,
    spare: &mut Vec<Key>,
    name: impl Fn(usize) -> &'n [u8],
) {
    let cmp = |a: &Key, b: &Key| a.0.cmp(&b.0).then_with(|| name(a.1).cmp(name(b.1)));
    // The runs in order: where each starts after the first.
    let mut breaks = Vec::new();
    for i in 1..keys.len() {
        if cmp(&keys[i - 1], &keys[i]) == Ordering::Greater {
            breaks.push(i);
            if breaks.len() > FEW_RUNS {
                break;
            }
        }
    }
    if breaks.is_empty() {
        return;
    }
    if breaks.len() <= FEW_RUNS {
        let mut longest = (0, 0);
        let mut start = 0;
        for &end in breaks.iter().chain([&keys.len()]) {
            if end - start > longest.1 - longest.0 {
                longest = (start, end);
            }
            start = end;
        }
        let (run_start, run_end) = longest;
        if (keys.len() - (run_end - run_start)) * 8 <= keys.len() {
            let mut others: Vec<Key> = keys[..run_start]
                .iter()
                .chain(&keys[run_end..])
                .copied()
                .collect();
            others.sort_unstable_by(cmp);
            merge(&keys[run_start..run_end], &others, spare, cmp);
            std::mem::swap(keys, spare);
            return;
        }
    }
    radix(keys, spare);
    // Keys equal in their first 8 bytes, by their whole names.
    let mut i = 0;
    while i < keys.len() {
        let mut j = i + 1;
        while j < keys.len() && keys[j].0 == keys[i].0 {
            j += 1;
        }
        if j - i > 1 {
            keys[i..j].sort_unstable_by(cmp);
        }
        i = j;
    }
}

/// `a` and `b`, each sorted, merged into `out`.
fn merge(a: &[Key], b: &[Key], out: &mut Vec<Key>, cmp: impl Fn(&Key, &Key) -> Ordering) {
    out.clear();
    out.reserve(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        if cmp(&b[j], &a[i]) == Ordering::Less {
            out.push(b[j]);
            j += 1;
        } else {
            out.push(a[i]);
            i += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
}

/// Sorts `keys` by their first number, stably: a pass per digit, the least significant
/// first, but for digits that all keys share. Digits are a byte wide, or 11 bits for many
/// keys: 6 passes at most instead of 8, whose larger counts (2,048 to a digit) cost less than
/// the passes they save once there are many keys to move.
fn radix(keys: &mut Vec<Key>, spare: &mut Vec<Key>) {
    if keys.len() >= 1 << 14 {
        radix_by::<11>(keys, spare)
    } else {
        radix_by::<8>(keys, spare)
    }
}

fn radix_by<const BITS: u32>(keys: &mut Vec<Key>, spare: &mut Vec<Key>) {
    let radix = 1usize << BITS;
    let digits = 64u32.div_ceil(BITS);
    let digit = |k: u64, d: u32| ((k >> (BITS * d)) as usize) & (radix - 1);
    let mut counts = vec![0usize; digits as usize * radix];
    for &(k, _) in keys.iter() {
        for d in 0..digits {
            counts[d as usize * radix + digit(k, d)] += 1;
        }
    }
    // Every place is written in each pass: no need to clear it first.
    spare.resize(keys.len(), (0, 0));
    for (d, count) in (0..digits).zip(counts.chunks_exact_mut(radix)) {
        if count.contains(&keys.len()) {
            continue; // every key has the same digit here
        }
        let mut at = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = at;
            at += n;
        }
        for &key in keys.iter() {
            let i = digit(key.0, d);
            spare[count[i]] = key;
            count[i] += 1;
        }
        std::mem::swap(keys, spare);
    }
}

/// Whether two names are the same.
#[inline(always)]
pub(super) fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && compare(a, b).is_eq()
}

/// Two names in the order of their bytes, 8 at a time (short names are most names, and a
/// call to `memcmp` costs more than comparing them).
#[inline(always)]
pub(super) fn compare(a: &[u8], b: &[u8]) -> Ordering {
    let n = a.len().min(b.len());
    let (mut a8, mut b8) = (a[..n].chunks_exact(8), b[..n].chunks_exact(8));
    for (x, y) in (&mut a8).zip(&mut b8) {
        let (x, y) = (be_word(x), be_word(y));
        if x != y {
            return x.cmp(&y);
        }
    }
    for (x, y) in a8.remainder().iter().zip(b8.remainder()) {
        if x != y {
            return x.cmp(y);
        }
    }
    a.len().cmp(&b.len())
}

#[inline(always)]
fn be_word(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(b);
    u64::from_be_bytes(w)
}

#[inline(always)]
fn be_u32(b: &[u8]) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(b);
    u32::from_be_bytes(w)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sorted(names: &[Vec<u8>]) -> Vec<usize> {
        let mut keys: Vec<Key> = names.iter().enumerate().map(|(i, n)| key(n, i)).collect();
        sort(&mut keys, &mut Vec::new(), |i| &names[i]);
        keys.into_iter().map(|(_, i)| i).collect()
    }

    #[test]
    fn many_names_sort_as_their_bytes() {
        // Enough names for the wide digits, of every length up to 12 and few byte values,
        // so that many share their first 8 bytes; some repeat.
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let names: Vec<Vec<u8>> = (0..40_000)
            .map(|_| {
                let len = (next() % 13) as usize;
                (0..len)
                    .map(|_| b"az\0\xff"[(next() % 4) as usize])
                    .collect()
            })
            .collect();
        let got: Vec<&Vec<u8>> = sorted(&names).iter().map(|&i| &names[i]).collect();
        let mut want: Vec<&Vec<u8>> = names.iter().collect();
        want.sort();
        assert!(got == want, "40,000 names out of their bytes' order");
    }

    proptest! {
        #[test]
        fn a_key_is_the_first_8_bytes_zero_padded(name in prop::collection::vec(any::<u8>(), 0..12)) {
            let mut padded = [0u8; 8];
            let n = name.len().min(8);
            padded[..n].copy_from_slice(&name[..n]);
            prop_assert_eq!(key(&name, 7), (u64::from_be_bytes(padded), 7));
        }

        #[test]
        fn names_sort_as_their_bytes(
            mut names in prop::collection::vec(prop::collection::vec(0u8..4, 0..12), 0..300),
            nearly in 0u8..3,
        ) {
            if nearly > 0 {
                // Sorted but for a few moved to the front (or one, at the end).
                let moved = names.len() / 20;
                names.sort();
                names.rotate_right(moved);
                if nearly == 2 && names.len() > 1 {
                    let last = names.len() - 1;
                    names.swap(0, last);
                }
            }
            let order = sorted(&names);
            let got: Vec<&Vec<u8>> = order.iter().map(|&i| &names[i]).collect();
            let mut want: Vec<&Vec<u8>> = names.iter().collect();
            want.sort();
            prop_assert_eq!(got, want);
        }
    }
}
