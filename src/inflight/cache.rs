//! A bounded in-memory cache of completed responses, so hot replays skip the store.
//!
//! Invariants:
//! - Only committed responses enter it, read back by a claim: a key enters on its first
//!   replay, so memory goes to keys that are actually retried, not to every completion.
//!   Nothing in flight, held or released is ever cached.
//! - An entry never outlives its row: its local expiry is computed from a clock reading taken
//!   before the store reported the row's remaining `ttl`, so it ends no later than the row
//!   does in database time.
//! - It is trusted only while the store's announcements flow ([`super::Wakeups`]): every
//!   announcement about a key (a completion, a release, an operator's delete) evicts that
//!   key, and when announcements stop (the listener is down) the whole cache is dropped and
//!   bypassed until they flow again. So an operator's `keys delete` on any instance is seen
//!   by every instance's cache: at once, or, by an instance whose listener connection froze
//!   without an error, when its next probe is not heard (within the listener's `REPROBE`
//!   plus up to 2 s to send its probe and 2 s to hear it, 9 s).
//! - It is bounded by bytes (`replay_cache.max_bytes`); the oldest entries go first.
//! - A hit requires the same fingerprint; anything else goes to the store, which decides
//!   (a different fingerprint is a 422 there).
//! - Only a body without a repeated JSON member name (or not JSON at all) enters it
//!   (`gateway/keyed.rs`, `KeyedRequest::work`): a hit skips the repeated-member check, which a raw
//!   fingerprint equal to the entry's (the same bytes) could not fail.
//! - A fill is conditional on the cache's epoch ([`ReplayCache::epoch`], read before the
//!   store read that produced the response), and the check and the insert happen under the
//!   same lock as every eviction, which bumps the epoch: a delete's eviction that lands
//!   between the store read and the fill always wins.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::replay::StoredResponse;

/// Per-entry overhead counted against the byte budget, besides the body and headers: the
/// map slot, the eviction queue slot, the shared id, the `Arc` and the header vector, with
/// allocator overhead (measured at about 400 bytes; rounded up).
const ENTRY_OVERHEAD: usize = 512;

struct Entry {
    fingerprint: Fingerprint,
    response: Arc<StoredResponse>,
    expires: Instant,
    size: usize,
    /// Distinguishes this entry from an older one under the same id in the eviction queue.
    generation: u64,
}

#[derive(Default)]
struct Inner {
    map: HashMap<String, Entry>,
    order: VecDeque<(String, u64)>,
    bytes: usize,
    generation: u64,
}

/// See the module docs. The default holds nothing (disabled).
#[derive(Default)]
pub struct ReplayCache {
    max_bytes: usize,
    inner: Mutex<Inner>,
    /// Replays answered from memory.
    pub hits: std::sync::atomic::AtomicU64,
    /// Bumped, under the `inner` lock, by every eviction and clear.
    epoch: std::sync::atomic::AtomicU64,
}

impl ReplayCache {
    /// A cache of at most `max_bytes`; 0 disables it.
    pub fn new(max_bytes: usize) -> ReplayCache {
        ReplayCache {
            max_bytes,
            inner: Mutex::default(),
            hits: Default::default(),
            epoch: Default::default(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.max_bytes > 0
    }

    /// The stored response for key `id` if it is cached, unexpired, with this fingerprint.
    pub fn get(&self, id: &str, fingerprint: &Fingerprint) -> Option<Arc<StoredResponse>> {
        if !self.enabled() {
            return None;
        }
        let mut inner = self.inner.lock().expect("cache lock");
        let entry = inner.map.get(id)?;
        if entry.expires <= Instant::now() {
            let size = entry.size;
            inner.map.remove(id);
            inner.bytes -= size;
            return None;
        }
        let hit = (entry.fingerprint == *fingerprint).then(|| Arc::clone(&entry.response));
        if hit.is_some() {
            self.hits.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        hit
    }

    /// The epoch to pass to [`ReplayCache::put`]: read it before the store read.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn bump(&self) {
        self.epoch.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// Caches a committed response until `expires`, unless an eviction happened since
    /// `epoch` was read (it may have been about this very key).
    pub fn put(
        &self,
        epoch: u64,
        id: String,
        fingerprint: Fingerprint,
        response: StoredResponse,
        expires: Instant,
    ) {
        let size = ENTRY_OVERHEAD
            + id.len()
            + response.body.len()
            + response
                .headers
                .iter()
                .map(|(n, v)| n.as_str().len() + v.len())
                .sum::<usize>();
        if !self.enabled() || size > self.max_bytes || expires <= Instant::now() {
            return;
        }
        let mut inner = self.inner.lock().expect("cache lock");
        if self.epoch() != epoch {
            return;
        }
        inner.generation += 1;
        let generation = inner.generation;
        if let Some(old) = inner.map.remove(&id) {
            inner.bytes -= old.size;
        }
        while inner.bytes + size > self.max_bytes {
            let Some((old_id, old_gen)) = inner.order.pop_front() else {
                break;
            };
            if inner
                .map
                .get(&old_id)
                .is_some_and(|e| e.generation == old_gen)
                && let Some(old) = inner.map.remove(&old_id)
            {
                inner.bytes -= old.size;
            }
        }
        inner.order.push_back((id.clone(), generation));
        inner.bytes += size;
        inner.map.insert(
            id,
            Entry {
                fingerprint,
                response: Arc::new(response),
                expires,
                size,
                generation,
            },
        );
        // The queue may hold ids of entries already replaced or evicted; keep it bounded.
        if inner.order.len() > 2 * inner.map.len() + 64 {
            let Inner { map, order, .. } = &mut *inner;
            order.retain(|(id, g)| map.get(id).is_some_and(|e| e.generation == *g));
        }
    }

    /// Evicts one key (an announcement about it arrived).
    pub fn invalidate(&self, id: &str) {
        let mut inner = self.inner.lock().expect("cache lock");
        self.bump();
        if let Some(old) = inner.map.remove(id) {
            inner.bytes -= old.size;
        }
    }

    /// Drops everything (announcements stopped: deletes may be missed).
    pub fn clear(&self) {
        let mut inner = self.inner.lock().expect("cache lock");
        self.bump();
        inner.map.clear();
        inner.order.clear();
        inner.bytes = 0;
    }

    /// Bytes in use.
    pub fn bytes(&self) -> usize {
        self.inner.lock().expect("cache lock").bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn resp(n: usize) -> StoredResponse {
        StoredResponse {
            status: 201,
            headers: vec![],
            body: bytes::Bytes::from(vec![b'x'; n]),
        }
    }

    #[tokio::test]
    async fn hits_need_the_same_fingerprint_and_an_unexpired_entry() {
        let c = ReplayCache::new(1 << 20);
        let later = Instant::now() + Duration::from_secs(60);
        c.put(c.epoch(), "k".into(), [1; 32], resp(10), later);
        assert!(c.get("k", &[1; 32]).is_some());
        assert!(c.get("k", &[2; 32]).is_none());
        c.put(c.epoch(), "gone".into(), [1; 32], resp(10), Instant::now());
        assert!(c.get("gone", &[1; 32]).is_none());
        c.invalidate("k");
        assert!(c.get("k", &[1; 32]).is_none());
    }

    #[tokio::test]
    async fn a_fill_read_before_an_eviction_is_dropped() {
        let c = ReplayCache::new(1 << 20);
        let later = Instant::now() + Duration::from_secs(60);
        let epoch = c.epoch();
        // An operator's delete of another or the same key lands after the store read.
        c.invalidate("k");
        c.put(epoch, "k".into(), [1; 32], resp(10), later);
        assert!(c.get("k", &[1; 32]).is_none(), "a stale fill never lands");
        c.put(c.epoch(), "k".into(), [1; 32], resp(10), later);
        assert!(c.get("k", &[1; 32]).is_some());
    }

    /// Fills racing evictions on threads, many rounds: each round a filler reads the epoch
    /// (as before a store read) before the round starts, then fills a key while another
    /// thread evicts that key, both started while the test holds the cache's lock: the
    /// eviction always comes after the epoch read, and which of the two takes the lock first
    /// varies. A fill read before the
    /// eviction never survives it, whichever goes first. It fails if `put` checked the epoch
    /// before taking the lock (a fill that passed the check could then land after the
    /// eviction). The yields while the lock is held only give both threads time to reach
    /// it; the assertion does not depend on them.
    #[test]
    fn a_fill_racing_an_eviction_never_outlives_it() {
        use std::sync::Barrier;
        let c = Arc::new(ReplayCache::new(1 << 20));
        let later = Instant::now() + Duration::from_secs(600);
        let rounds = 2_000;
        let start = Arc::new(Barrier::new(3));
        let done = Arc::new(Barrier::new(3));
        let racer = |fill: bool| {
            let (c, start, done) = (Arc::clone(&c), Arc::clone(&start), Arc::clone(&done));
            std::thread::spawn(move || {
                for i in 0..rounds {
                    let id = format!("k{i}");
                    // The filler's epoch is read before the round starts: before the eviction.
                    let epoch = c.epoch();
                    start.wait();
                    if fill {
                        c.put(epoch, id, [1; 32], resp(10), later);
                    } else {
                        c.invalidate(&id);
                    }
                    done.wait();
                }
            })
        };
        let (filler, evictor) = (racer(true), racer(false));
        let mut survived = 0;
        for i in 0..rounds {
            let held = c.inner.lock().unwrap();
            start.wait();
            for _ in 0..50 {
                std::thread::yield_now();
            }
            drop(held);
            done.wait();
            if c.get(&format!("k{i}"), &[1; 32]).is_some() {
                survived += 1;
            }
        }
        filler.join().unwrap();
        evictor.join().unwrap();
        assert_eq!(
            survived, 0,
            "fills read before an eviction that outlived it"
        );
    }

    #[tokio::test]
    async fn the_byte_budget_evicts_the_oldest() {
        let c = ReplayCache::new(3 * (ENTRY_OVERHEAD + 1 + 1000));
        let later = Instant::now() + Duration::from_secs(60);
        for k in ["a", "b", "c", "d"] {
            c.put(c.epoch(), k.into(), [1; 32], resp(1000), later);
        }
        assert!(c.get("a", &[1; 32]).is_none(), "the oldest went first");
        assert!(c.get("d", &[1; 32]).is_some());
        assert!(c.bytes() <= 3 * (ENTRY_OVERHEAD + 1 + 1000));
        let disabled = ReplayCache::new(0);
        disabled.put(0, "a".into(), [1; 32], resp(1), later);
        assert!(disabled.get("a", &[1; 32]).is_none());
    }
}
