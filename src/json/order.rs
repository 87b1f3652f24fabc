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

/// The key of a name.
pub(super) fn key(name: &[u8], index: usize) -> Key {
    let mut p = [0u8; 8];
    let n = name.len().min(8);
    p[..n].copy_from_slice(&name[..n]);
    (u64::from_be_bytes(p), index)
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

/// Sorts `keys` by their first number, stably: a pass per byte, the least significant
/// first, but for bytes that all keys share.
fn radix(keys: &mut Vec<Key>, spare: &mut Vec<Key>) {
    let mut counts = vec![[0usize; 256]; 8];
    for &(k, _) in keys.iter() {
        for (byte, count) in counts.iter_mut().enumerate() {
            count[(k >> (8 * byte)) as usize & 0xff] += 1;
        }
    }
    for (byte, count) in counts.iter_mut().enumerate() {
        if count.contains(&keys.len()) {
            continue; // every key has the same byte here
        }
        let mut at = 0;
        for c in count.iter_mut() {
            let n = *c;
            *c = at;
            at += n;
        }
        spare.clear();
        spare.resize(keys.len(), (0, 0));
        for &key in keys.iter() {
            let digit = (key.0 >> (8 * byte)) as usize & 0xff;
            spare[count[digit]] = key;
            count[digit] += 1;
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sorted(names: &[Vec<u8>]) -> Vec<usize> {
        let mut keys: Vec<Key> = names.iter().enumerate().map(|(i, n)| key(n, i)).collect();
        sort(&mut keys, &mut Vec::new(), |i| &names[i]);
        keys.into_iter().map(|(_, i)| i).collect()
    }

    proptest! {
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
