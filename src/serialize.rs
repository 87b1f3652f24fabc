//! `serialize`: at most `max_in_flight` keyed requests of one scope forwarded at once, across
//! every instance (docs/contract.md §4; docs/lab.md, step 5: backends that read, then write,
//! per account).
//!
//! The limit holds per route, also when routes with different limits share a scope: a
//! request of a route with limit L starts only when, counting itself, the scope's live slots
//! number at most L AND at most the limit of every live holder. So with route A (limit 1) and
//! route B (limit 3) on one scope, an A request runs alone in its scope, and B requests run
//! up to three at once while no A request runs; the limits never add up. Each slot row
//! records its holder's limit, and the store decides under a per-scope lock (one writer for
//! the embedded store), so takers on different instances cannot both count the other out.
//!
//! Two queues, in order:
//! 1. Local, per instance. A fair semaphore per scope and limit (`max_in_flight` permits)
//!    keeps requests of one route that could not get a slot anyway (this instance already
//!    holds L slots under limit L) from asking the store. Then a FIFO turn per scope, shared
//!    by every route: one request at a time asks the store for the scope, in arrival order,
//!    so a request of a strict route that waits for the scope to drain is not overtaken by
//!    later requests of a looser route of this instance. Neither ever admits a request the
//!    rule refuses: the store decides.
//! 2. Leased slot rows in the database (`idemgate_slots`): the request whose turn it is takes
//!    a slot in one statement, or waits for a release (woken by NOTIFY, or by polling when
//!    wake-ups are not flowing) until `wait_timeout`. Across instances, the first to ask
//!    after a release gets the slot; there is no queue across instances, so a strict route's
//!    request can wait out its `wait_timeout` (then 409 `in-flight`) while other instances
//!    keep a looser route's slots busy.
//!
//! No transaction or session lock is held across the upstream call: a slot is a row with a
//! lease, released (fenced by its token) when the forward's outcome is recorded, and freed by
//! its lease if the holder crashes (its limit ends with it).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::SerializeConfig;
use crate::inflight::Wakeups;
use crate::inflight::wait::Backoff;
use crate::key::KeyId;
use crate::store::{Slot, Store, StoreError};

type Queues = Arc<Mutex<HashMap<String, ScopeQueue>>>;

/// One scope's local queue.
struct ScopeQueue {
    /// Requests of this instance queued for or holding a slot of the scope.
    users: usize,
    /// Whose turn it is to ask the store: one request of the scope at a time, in arrival
    /// order (tokio's mutex is fair), whatever its route.
    turn: Arc<tokio::sync::Mutex<()>>,
    /// Per limit, a fair semaphore with that many permits: a reload or another route with
    /// another limit gets its own instead of inheriting the first one's size.
    limits: HashMap<u32, Arc<Semaphore>>,
}

/// The per-process local queues, by scope.
#[derive(Default)]
pub struct Serializer {
    queues: Queues,
}

/// A slot held for one forward; free it with [`Held::release`].
pub struct Held {
    pub slot: Slot,
    _permit: OwnedSemaphorePermit,
    _queue: QueueRef,
}

/// Keeps a scope's local queue alive; the last one out removes it.
struct QueueRef {
    queues: Queues,
    scope: String,
}

impl Drop for QueueRef {
    fn drop(&mut self) {
        let mut q = self.queues.lock().expect("queues lock");
        if let Some(entry) = q.get_mut(&self.scope) {
            entry.users -= 1;
            if entry.users == 0 {
                q.remove(&self.scope);
            }
        }
    }
}

impl Serializer {
    /// Waits for a slot of `scope` until `cfg.wait_timeout`, and never starts asking the
    /// store after `last_start` (past it, the key's lease could end before the forward and
    /// its recording do; the caller leaves room for one slot statement and one recording).
    /// `Ok(None)`: the wait ran out.
    pub async fn acquire(
        &self,
        store: &dyn Store,
        wakeups: &Wakeups,
        scope: &str,
        cfg: SerializeConfig,
        lease: Duration,
        last_start: Instant,
    ) -> Result<Option<Held>, StoreError> {
        let deadline = (Instant::now() + cfg.wait_timeout).min(last_start);
        let (queue, sem, turn) = {
            let mut q = self.queues.lock().expect("queues lock");
            let entry = q.entry(scope.to_string()).or_insert_with(|| ScopeQueue {
                users: 0,
                turn: Arc::default(),
                limits: HashMap::new(),
            });
            entry.users += 1;
            let sem = entry
                .limits
                .entry(cfg.max_in_flight)
                .or_insert_with(|| Arc::new(Semaphore::new(cfg.max_in_flight as usize)));
            (
                QueueRef {
                    queues: Arc::clone(&self.queues),
                    scope: scope.to_string(),
                },
                Arc::clone(sem),
                Arc::clone(&entry.turn),
            )
        };
        let Ok(permit) = tokio::time::timeout_at(deadline, sem.acquire_owned()).await else {
            return Ok(None);
        };
        let permit = permit.expect("the semaphore is never closed");
        // Held until we have a slot or give up; then the next local request of the scope asks.
        let Ok(_turn) = tokio::time::timeout_at(deadline, turn.lock()).await else {
            return Ok(None);
        };

        let sub = wakeups.subscribe_id(KeyId::slots(scope));
        let mut backoff = Backoff::default();
        loop {
            let woken = sub.next_wakeup();
            if Instant::now() >= deadline {
                return Ok(None);
            }
            // The store decides under its per-scope lock: a refusal means the scope is full
            // for this route now, not that a race was lost, so wait for a release.
            if let Some(slot) = store.acquire_slot(scope, cfg.max_in_flight, lease).await? {
                return Ok(Some(Held {
                    slot,
                    _permit: permit,
                    _queue: queue,
                }));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let nap = backoff.next(wakeups.healthy());
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep(nap.min(deadline - now)) => {}
            }
        }
    }
}

impl Held {
    /// Frees the slot in the store (waking waiters everywhere), then the local permit.
    pub async fn release(self, store: &dyn Store) {
        match store.release_slot(&self.slot).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::warn!("serialize slot was taken over before release (its lease ended)")
            }
            Err(e) => {
                tracing::warn!(error = %e, "releasing a serialize slot failed; it frees itself when its lease ends")
            }
        }
    }
}
