//! Per-thread shards of state that every request writes (idle upstream connections, request
//! counters, latency histograms).
//!
//! Memory that both of the runtime's workers write at every request moves between their
//! cores' caches each time, which costs more than the write itself. Written per shard, each
//! worker writes its own; readers (a scrape, a thread whose own list is empty) visit them all.
//!
//! Invariant: [`own`] is fixed for a thread's life; the first [`SHARDS`] threads to ask get
//! distinct shards, later ones share (correct, only slower).

use std::sync::atomic::{AtomicUsize, Ordering};

/// Shards of each sharded value.
pub const SHARDS: usize = 8;

/// The calling thread's shard: threads are numbered in the order they first ask.
pub fn own() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static OWN: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    OWN.with(|own| *own)
}

/// A value aligned apart from its neighbours, so that two shards never share a cache line.
#[repr(align(128))]
#[derive(Debug, Default)]
pub struct Padded<T>(pub T);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_keeps_its_shard_and_every_shard_is_in_range() {
        let mine = own();
        assert_eq!(own(), mine);
        assert!(mine < SHARDS);
        assert_eq!(std::mem::align_of::<Padded<u8>>(), 128);
        // Other threads get shards of their own numbering, each fixed for its life.
        for _ in 0..2 * SHARDS {
            let (first, again) = std::thread::spawn(|| (own(), own())).join().unwrap();
            assert!(first < SHARDS);
            assert_eq!(first, again);
        }
    }
}
