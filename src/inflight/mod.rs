//! In-flight keys: who waits for which key, the announcements that wake them, the shared
//! lookups, and the replay cache that those announcements keep honest. The stores only
//! announce (the [`Announce`] trait, which [`Wakeups`] implements); everything that waits is
//! here, and the waiting loop itself is `wait.rs`.
//!
//! A request that finds its key in flight subscribes to the key in [`Wakeups`] and waits.
//! Whoever finishes a key (completes, releases or holds it) makes the store announce it: the
//! Postgres store sends `NOTIFY` in the same statement as the write, when a waiter has asked
//! for it ([`Store::watch`] marks the row), and its listener connection announces what it
//! hears in every instance; an embedded store announces directly. A woken waiter looks the key
//! up again through [`Subscription::lookup`], which runs ONE claim statement for all local
//! waiters with the same fingerprint that woke for the same event, and shares its answer:
//! thirty local duplicates cost one query per wake-up, not thirty.
//!
//! Invariants:
//! - A waiter subscribes before its second look at the row, so a finish between the two
//!   looks cannot be missed.
//! - A shared answer is reused only if its query started after the waiter woke, so it
//!   reflects every write that caused the wake-up.
//! - Only the waiter whose own query claimed the key gets [`Claim::Acquired`]; the others see
//!   [`Claim::InFlight`] (a local request owns it now) and keep waiting.
//! - When announcements are not flowing ([`Wakeups::healthy`] is false: the listener is down,
//!   or a pooler in transaction mode swallows notifications), waiters poll with a bounded
//!   backoff; when they are, they still re-check at least every `SAFETY_POLL` (`wait.rs`) and when the
//!   holder's lease ends, so a lost notification costs latency, never correctness.
//! - The replay cache is trusted only while announcements flow: every announcement evicts its
//!   key, and the whole cache is dropped when they stop (`cache.rs`).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::key::KeyId;
use crate::store::{Announce, Claim, ClaimRequest, Store, StoreError};

mod cache;
pub mod wait;

pub use cache::ReplayCache;

/// Counters for tests and metrics.
#[derive(Debug, Default)]
pub struct WaitStats {
    /// Wake-ups delivered to a subscribed key.
    pub woken: AtomicU64,
    /// Claim statements run on behalf of waiters.
    pub lookups: AtomicU64,
    /// Lookups answered from another waiter's statement.
    pub shared: AtomicU64,
    /// Listener sessions established (1 + reconnects).
    pub listener_sessions: AtomicU64,
    /// Listener connections replaced because a probe sent through the pool was not heard.
    pub listener_replaced: AtomicU64,
}

/// The per-process registry of keys that local requests wait for, and the replay cache.
#[derive(Default)]
pub struct Wakeups {
    /// The replay cache: every announcement evicts its key, and the whole cache is dropped
    /// when announcements stop flowing (see `cache.rs`).
    cache: ReplayCache,
    /// Waited-for keys and how many subscriptions each has (counted under this lock, so the
    /// last one out always removes the entry).
    keys: Mutex<HashMap<String, (usize, Arc<KeyWait>)>>,
    healthy: AtomicBool,
    pub stats: WaitStats,
}

/// One waited-for key.
pub struct KeyWait {
    notify: Notify,
    /// The last lookup per fingerprint: when its statement started, and what it found.
    last: tokio::sync::Mutex<HashMap<Fingerprint, (Instant, Claim)>>,
}

/// A waiter's interest in one key; leaving drops the registry entry with the last waiter.
pub struct Subscription<'a> {
    wakeups: &'a Wakeups,
    id: String,
    wait: Arc<KeyWait>,
}

impl Wakeups {
    /// A registry whose replay cache holds up to `cache_bytes` (0: no cache).
    pub fn new(cache_bytes: usize) -> Wakeups {
        Wakeups {
            cache: ReplayCache::new(cache_bytes),
            ..Wakeups::default()
        }
    }

    /// Subscribes to wake-ups for `(scope, key)`.
    pub fn subscribe(&self, scope: &str, key: &str) -> Subscription<'_> {
        self.subscribe_id(KeyId::of(scope, key))
    }

    /// Subscribes to wake-ups for an id (a key's, or a scope's slots': [`KeyId::slots`]).
    pub fn subscribe_id(&self, id: KeyId) -> Subscription<'_> {
        let id = String::from(id);
        let wait = {
            let mut keys = self.keys.lock().expect("wakeups lock");
            let entry = keys.entry(id.clone()).or_insert_with(|| {
                (
                    0,
                    Arc::new(KeyWait {
                        notify: Notify::new(),
                        last: tokio::sync::Mutex::new(HashMap::new()),
                    }),
                )
            });
            entry.0 += 1;
            Arc::clone(&entry.1)
        };
        Subscription {
            wakeups: self,
            id,
            wait,
        }
    }

    /// Bytes held by the replay cache.
    pub fn cache_bytes(&self) -> usize {
        self.cache.bytes()
    }

    /// The replay cache and the current epoch, if enabled and trustworthy now
    /// (announcements are flowing). Read the store after this call; fill the cache with
    /// [`Wakeups::cache_fill`] and this epoch.
    pub fn trusted_cache(&self) -> Option<(&ReplayCache, u64)> {
        (self.cache.enabled() && self.healthy()).then(|| (&self.cache, self.cache.epoch()))
    }

    /// Fills the cache with what the store said, unless announcements changed regime since
    /// `epoch` (an eviction may have been missed in between).
    pub fn cache_fill(
        &self,
        epoch: u64,
        id: KeyId,
        fingerprint: Fingerprint,
        response: crate::replay::StoredResponse,
        expires: Instant,
    ) {
        if self.healthy() {
            self.cache
                .put(epoch, String::from(id), fingerprint, response, expires);
        }
    }

    /// Wakes every local waiter of the key with this id (a NOTIFY payload).
    pub fn wake(&self, id: &str) {
        self.cache.invalidate(id);
        let wait = self
            .keys
            .lock()
            .expect("wakeups lock")
            .get(id)
            .map(|(_, w)| Arc::clone(w));
        if let Some(wait) = wait {
            self.stats.woken.fetch_add(1, Ordering::Relaxed);
            wait.notify.notify_waiters();
        }
    }

    /// Wakes every local waiter (after a listener reconnect, when notifications may have
    /// been missed).
    pub fn wake_all(&self) {
        let all: Vec<Arc<KeyWait>> = self
            .keys
            .lock()
            .expect("wakeups lock")
            .values()
            .map(|(_, w)| Arc::clone(w))
            .collect();
        for wait in all {
            wait.notify.notify_waiters();
        }
    }

    /// Whether wake-ups are known to flow (the listener is up and its probe came back).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    pub fn set_healthy(&self, healthy: bool) {
        let was = self.healthy.swap(healthy, Ordering::SeqCst);
        if was != healthy {
            self.cache.clear();
            if healthy {
                tracing::info!("wake-ups for in-flight keys are flowing");
            } else {
                tracing::warn!("wake-ups for in-flight keys are not flowing; waiters poll");
            }
            // Either way, waiters should look again under the new regime.
            self.wake_all();
        }
    }

    /// Keys with local waiters right now.
    pub fn waited_keys(&self) -> usize {
        self.keys.lock().expect("wakeups lock").len()
    }
}

/// What the stores announce reaches the waiters here.
impl Announce for Wakeups {
    fn wake(&self, id: &str) {
        Wakeups::wake(self, id);
    }

    fn wake_all(&self) {
        Wakeups::wake_all(self);
    }

    fn set_healthy(&self, healthy: bool) {
        Wakeups::set_healthy(self, healthy);
    }

    fn healthy(&self) -> bool {
        Wakeups::healthy(self)
    }

    fn listener_session(&self) {
        self.stats.listener_sessions.fetch_add(1, Ordering::Relaxed);
    }

    fn listener_replaced(&self) {
        self.stats.listener_replaced.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Subscription<'_> {
    fn drop(&mut self) {
        let mut keys = self.wakeups.keys.lock().expect("wakeups lock");
        if let Some(entry) = keys.get_mut(&self.id) {
            entry.0 -= 1;
            if entry.0 == 0 {
                keys.remove(&self.id);
            }
        }
    }
}

impl Subscription<'_> {
    /// A future that resolves at the next wake-up of this key; enabled at once, so a wake-up
    /// between now and the first poll is not lost.
    pub fn next_wakeup(&self) -> std::pin::Pin<Box<tokio::sync::futures::Notified<'_>>> {
        let mut notified = Box::pin(self.wait.notify.notified());
        notified.as_mut().enable();
        notified
    }

    /// Looks the key up again, sharing one statement among local waiters with the same
    /// fingerprint: an answer whose statement started at or after `since` is reused.
    /// `Ok(None)`: `deadline` passed while queued behind other waiters' statements (a
    /// statement already started is never abandoned: it may have claimed the key).
    pub async fn lookup(
        &self,
        store: &dyn Store,
        req: ClaimRequest<'_>,
        since: Instant,
        deadline: Instant,
    ) -> Result<Option<Claim>, StoreError> {
        let Ok(mut last) = tokio::time::timeout_at(deadline, self.wait.last.lock()).await else {
            return Ok(None);
        };
        if let Some((started, claim)) = last.get(req.fingerprint)
            && *started >= since
        {
            self.wakeups.stats.shared.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(match claim {
                // Someone else's statement claimed the key: a local request owns it now.
                Claim::Acquired { .. } => Claim::InFlight {
                    lease_remaining: Duration::ZERO,
                },
                other => other.clone(),
            }));
        }
        let started = Instant::now();
        self.wakeups.stats.lookups.fetch_add(1, Ordering::Relaxed);
        let mut claim = store.claim(req).await?;
        // Still in flight: ask to be announced to. If the key stopped being in flight in
        // between (the watch found no in-flight row), look again at once.
        for _ in 0..3 {
            if !matches!(claim, Claim::InFlight { .. }) || store.watch(req.scope, req.key).await? {
                break;
            }
            claim = store.claim(req).await?;
        }
        // Kept (a stored body is a cheap `Bytes` clone) until the last waiter leaves.
        last.insert(*req.fingerprint, (started, claim.clone()));
        Ok(Some(claim))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_last_subscriber_removes_the_entry() {
        let w = Wakeups::default();
        let a = w.subscribe("s", "k");
        let b = w.subscribe("s", "k");
        assert_eq!(w.waited_keys(), 1);
        drop(a);
        assert_eq!(w.waited_keys(), 1);
        drop(b);
        assert_eq!(w.waited_keys(), 0);
    }

    #[tokio::test]
    async fn a_wake_reaches_an_enabled_waiter() {
        let w = Wakeups::default();
        let s = w.subscribe("s", "k");
        let next = s.next_wakeup();
        w.wake(KeyId::of("s", "k").as_str());
        tokio::time::timeout(Duration::from_secs(5), next)
            .await
            .expect("woken");
    }
}
