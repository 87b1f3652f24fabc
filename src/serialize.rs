//! `serialize`: at most `max_in_flight` keyed requests of one scope forwarded at once, across
//! every instance (SPEC section 4; LAB.md part 5: backends that read, then write, per account).
//!
//! Two queues, in order:
//! 1. A local FIFO per scope (a fair `tokio::sync::Semaphore` with `max_in_flight` permits):
//!    requests of one instance get slots in arrival order.
//! 2. Leased slot rows in the database (`idemgate_slots`): a request holding a local permit
//!    takes a free slot in one statement, or waits for a release (woken by NOTIFY, or by
//!    polling when wake-ups are not flowing) until `wait_timeout`. Across instances, the
//!    first to ask after a release gets the slot.
//!
//! No transaction or session lock is held across the upstream call: a slot is a row with a
//! lease, released (fenced by its token) when the forward's outcome is recorded, and freed by
//! its lease if the holder crashes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::config::SerializeConfig;
use crate::store::{Slot, Store, StoreError};
use crate::wait::{self, slot_id};

type Queues = Arc<Mutex<HashMap<String, (usize, Arc<Semaphore>)>>>;

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
            entry.0 -= 1;
            if entry.0 == 0 {
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
        scope: &str,
        cfg: SerializeConfig,
        lease: Duration,
        last_start: Instant,
    ) -> Result<Option<Held>, StoreError> {
        let deadline = (Instant::now() + cfg.wait_timeout).min(last_start);
        // One local queue per scope and limit: a reload or another route with another limit
        // gets its own semaphore instead of inheriting the first one's size.
        let queue_key = format!("{}\0{scope}", cfg.max_in_flight);
        let (queue, sem) = {
            let mut q = self.queues.lock().expect("queues lock");
            let entry = q
                .entry(queue_key.clone())
                .or_insert_with(|| (0, Arc::new(Semaphore::new(cfg.max_in_flight as usize))));
            entry.0 += 1;
            (
                QueueRef {
                    queues: Arc::clone(&self.queues),
                    scope: queue_key,
                },
                Arc::clone(&entry.1),
            )
        };
        let Ok(permit) = tokio::time::timeout_at(deadline, sem.acquire_owned()).await else {
            return Ok(None);
        };
        let permit = permit.expect("the semaphore is never closed");

        let wakeups = store.wakeups();
        let sub = wakeups.subscribe_id(slot_id(scope));
        let mut pause = wait::POLL_MIN;
        loop {
            let woken = sub.next_wakeup();
            // Losing a race for one slot says nothing about the others: try again at once,
            // up to once per slot, before sleeping.
            for _ in 0..cfg.max_in_flight.max(1) {
                if Instant::now() >= deadline {
                    return Ok(None);
                }
                if let Some(slot) = store.acquire_slot(scope, cfg.max_in_flight, lease).await? {
                    return Ok(Some(Held {
                        slot,
                        _permit: permit,
                        _queue: queue,
                    }));
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            let nap = if wakeups.healthy() {
                wait::SAFETY_POLL
            } else {
                let p = pause;
                pause = (pause * 2).min(wait::POLL_MAX);
                p
            };
            tokio::select! {
                () = woken => {}
                () = tokio::time::sleep(nap.min(deadline - now)) => {}
            }
        }
    }

    /// Scopes with local requests queued or holding slots.
    pub fn active_scopes(&self) -> usize {
        self.queues.lock().expect("queues lock").len()
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
