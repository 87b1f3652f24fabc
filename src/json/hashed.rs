//! Repeats among many names, by hash: linear in their number, whatever the names.
//!
//! Each name becomes an entry, the high 32 bits of its hash and 1 + its index. The entries
//! are split by the top bits of their hashes into parts of a few hundred (a counting sort:
//! two passes in order), and each part's entries go into a table of its own, small enough to
//! stay in the cache (linear probing, at most three quarters full, the next bits of the hash
//! picking the slot): one tight loop over a small table rather than a probe of a large one (a
//! cache miss) per name. Equal names have equal hashes, so they meet in one part and one
//! table; names are compared only where their hashes agree.
//!
//! The hash is a fast one keyed at random per process ([`fast_hash`]). Should the names still
//! make the probes long (names chosen to collide), they are hashed again with std's SipHash,
//! keyed at random too, so no list of names makes the search quadratic.

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::OnceLock;

use super::order::same;

/// Probes per name beyond which the fast hash is given up (with the tables at most three
/// quarters full, a random hash averages under 4).
const PROBE_LIMIT: usize = 8;

/// Buffers of [`repeats`], kept for the next names.
#[derive(Default)]
pub(super) struct Scratch {
    entries: Vec<u64>,
    parted: Vec<u64>,
    slots: Vec<u64>,
}

/// Whether two of `count` names are equal, `name(i)` being the text of name `i` (fewer than
/// 2^32 - 1 of them).
pub(super) fn repeats<'t>(
    count: usize,
    name: impl Fn(usize) -> &'t [u8],
    scratch: &mut Scratch,
) -> bool {
    let keys = keys();
    let fast = probe(count, &name, scratch, true, |t| fast_hash(t, keys));
    fast.unwrap_or_else(|| {
        let state = RandomState::new();
        let sip = probe(count, &name, scratch, false, |t| state.hash_one(t));
        sip.unwrap_or(true)
    })
}

/// [`repeats`] with the given hash: `None` if `budget` and it costs too many probes.
fn probe<'t>(
    n: usize,
    name: &impl Fn(usize) -> &'t [u8],
    scratch: &mut Scratch,
    budget: bool,
    hash: impl Fn(&[u8]) -> u64,
) -> Option<bool> {
    let Scratch {
        entries,
        parted,
        slots,
    } = scratch;
    // Parts of about 256 entries: a table of 512 slots, 4 KiB.
    let part_bits = (n >> 8).max(1).ilog2().min(12);
    let mut counts = vec![0usize; (1 << part_bits) + 1];
    entries.clear();
    entries.extend((0..n).map(|i| {
        let entry = (hash(name(i)) >> 32) << 32 | (i as u64 + 1);
        counts[part(entry, part_bits) + 1] += 1;
        entry
    }));
    for i in 1..counts.len() {
        counts[i] += counts[i - 1];
    }
    parted.clear();
    parted.resize(n, 0);
    let mut next = counts.clone();
    for &e in entries.iter() {
        let p = part(e, part_bits);
        parted[next[p]] = e;
        next[p] += 1;
    }
    let limit = if budget {
        PROBE_LIMIT * n + 64
    } else {
        usize::MAX
    };
    let mut probes = 0;
    let text = |entry: u64| name((entry as u32) as usize - 1);
    for p in 0..1 << part_bits {
        let part = &parted[counts[p]..counts[p + 1]];
        let m = part.len();
        let bits = (m + m / 3 + 1).next_power_of_two().trailing_zeros().max(4);
        slots.clear();
        slots.resize(1 << bits, 0);
        let mask = slots.len() - 1;
        for &e in part {
            // The hash's bits below those that chose the part.
            let mut at = ((e << part_bits) >> (64 - bits)) as usize;
            loop {
                let slot = slots[at];
                if slot == 0 {
                    break;
                }
                if slot >> 32 == e >> 32 && same(text(slot), text(e)) {
                    return Some(true);
                }
                probes += 1;
                if probes > limit {
                    return None;
                }
                at = (at + 1) & mask;
            }
            slots[at] = e;
        }
    }
    Some(false)
}

/// The part of an entry: the top `bits` bits of its hash.
#[inline]
fn part(entry: u64, bits: u32) -> usize {
    entry.checked_shr(64 - bits).unwrap_or(0) as usize
}

/// The fast hash's keys: random, once per process.
fn keys() -> [u64; 2] {
    static KEYS: OnceLock<[u64; 2]> = OnceLock::new();
    *KEYS.get_or_init(|| {
        let state = RandomState::new();
        [state.hash_one(1u64), state.hash_one(2u64) | 1]
    })
}

/// The 128-bit product of two words, folded to 64 bits.
#[inline]
fn fold(a: u64, b: u64) -> u64 {
    let p = (a as u128) * (b as u128);
    (p as u64) ^ ((p >> 64) as u64)
}

#[inline]
fn word(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

#[inline]
fn half(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w) as u64
}

/// A keyed hash of a name in the manner of wyhash and foldhash: 16 bytes at a time, each
/// pair of words mixed by a folded multiply with the keys.
#[inline]
fn fast_hash(b: &[u8], [k0, k1]: [u64; 2]) -> u64 {
    let len = b.len();
    let (mut lo, mut hi, mut acc) = (0, 0, k0 ^ len as u64);
    if len > 16 {
        let mut at = 0;
        while len - at > 16 {
            acc = fold(word(b, at) ^ k0 ^ acc, word(b, at + 8) ^ k1);
            at += 16;
        }
        lo = word(b, len - 16);
        hi = word(b, len - 8);
    } else if len >= 8 {
        lo = word(b, 0);
        hi = word(b, len - 8);
    } else if len >= 4 {
        lo = half(b, 0);
        hi = half(b, len - 4);
    } else if len > 0 {
        lo = (b[0] as u64) << 16 | (b[len / 2] as u64) << 8 | b[len - 1] as u64;
    }
    // The high bits of a folded product depend on every bit of both words: they are the
    // ones used (parts, slots and tags).
    fold(lo ^ acc, hi ^ k1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `count` distinct names of 8 bytes, laid end to end.
    fn body(count: usize) -> String {
        (0..count).map(|i| format!("k{i:07}")).collect()
    }

    #[test]
    fn names_that_collide_are_hashed_again() {
        let body = body(2000);
        let mut list: Vec<&[u8]> = body.as_bytes().chunks(8).collect();
        let mut scratch = Scratch::default();
        // Every name with one hash: past the budget of probes.
        let name = |i: usize| list[i];
        assert_eq!(probe(list.len(), &name, &mut scratch, true, |_| 7), None);
        // Without a budget (as SipHash is probed), still the right answer.
        assert_eq!(
            probe(list.len(), &name, &mut scratch, false, |_| 7),
            Some(false)
        );
        list.push(list[1234]);
        let name = |i: usize| list[i];
        assert_eq!(
            probe(list.len(), &name, &mut scratch, false, |_| 7),
            Some(true)
        );
        assert!(repeats(list.len(), name, &mut scratch));
        list.pop();
        assert!(!repeats(list.len(), |i| list[i], &mut scratch));
    }

    #[test]
    fn the_fast_hash_stays_within_its_budget() {
        let body = body(100_000);
        let list: Vec<&[u8]> = body.as_bytes().chunks(8).collect();
        let keys = keys();
        let name = |i: usize| list[i];
        let probed = probe(list.len(), &name, &mut Scratch::default(), true, |t| {
            fast_hash(t, keys)
        });
        assert_eq!(probed, Some(false));
    }
}
