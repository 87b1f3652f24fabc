//! Group commit for the Postgres store: the claims of new keys, and the completions, of
//! requests that are waiting at the same moment go to the database together, several keys
//! in one statement and one commit.
//!
//! This file owns the queueing: when a batch forms, how many run at once, and the bounds a
//! waiting request keeps. What a batch runs (the SQL and each key's answer) is in
//! [`super::postgres`], behind [`Item`].
//!
//! Invariants (docs/guarantees.md, "Batches without shared fate"):
//! - A batch gathers only while every pooled connection is busy. The dispatcher takes the
//!   first waiting request and whatever else is queued at that moment (up to the limits),
//!   then asks the pool for a connection: when one is idle that is at once, and the batch
//!   goes as it is (a lone request at low load, as without batching); while none is, what
//!   arrives joins the batch until a connection comes or the batch is full (`batch_keys`
//!   keys, or `batch_bytes` of stored answers). So a request never waits for a batch to form
//!   while a connection could run it, and never waits behind another statement for anything
//!   but a connection, as it would without batching.
//! - Each request keeps the bounds of one call: its wait for a connection ends
//!   `acquire_timeout` after it was queued, and past that it is answered `AcquireTimeout`
//!   (nothing of it was sent); the others of its batch, still within their own bound, start
//!   the next batch. When the pool fails otherwise, every request of the batch gets the
//!   pool's answer. The statement runs within `statement_timeout`, with the same client-side
//!   bound, cancel and detach as every statement ([`super::session::Db::bounded`]).
//! - No shared fate: when a statement of several keys fails (a row held locked for more than
//!   the 100 ms a batched statement waits for one, a deadlock, an error), each of its keys
//!   runs again alone, with its own statement and bounds, before any of them is failed
//!   ([`answer_all`]); only a key that fails alone is answered the error, and a locked row
//!   delays the others of its batch by those 100 ms at most. What a request does after its
//!   batch (a key that exists goes to the full claim) is a call of its own, with its own
//!   bounds.
//! - Every request is answered exactly once: by its batch; by the dropped answer channel when
//!   its batch panicked (a bug); or by the closed queue when the store is gone. The caller
//!   reports the last two as internal errors. Nobody hangs.
//! - A request whose caller stopped waiting still runs: a claim it made stays in flight until
//!   its lease expires, as when a lone statement's caller times out. The gateway runs claims
//!   and completions from spawned tasks, so a client's hang-up never drops one.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use deadpool_postgres::Object;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::session::Db;
use crate::store::StoreError;

/// What one request asks of a batch, and how a batch of such asks runs.
pub(super) trait Item: Send + Sized + 'static {
    /// The operation label of the batch-size histogram.
    const OP: &'static str;
    /// What each request gets back.
    type Answer: Send + 'static;
    /// The stored answer this request carries, counted against `batch_bytes`.
    fn bytes(&self) -> usize {
        0
    }
    /// Runs a batch on `obj` and answers each request in it.
    fn run(db: Arc<Db>, obj: Object, batch: Vec<Waiting<Self>>) -> impl Future<Output = ()> + Send;
}

/// One request in a queue: what it asks, when it was queued, and where its answer goes.
pub(super) struct Waiting<T: Item> {
    pub(super) ask: T,
    queued: Instant,
    answer: oneshot::Sender<Result<T::Answer, StoreError>>,
}

impl<T: Item> Waiting<T> {
    /// Answers the request (a caller that stopped waiting is not told).
    pub(super) fn answer(self, answer: Result<T::Answer, StoreError>) {
        let _ = self.answer.send(answer);
    }

    /// Answers the request from what it asked (for an answer that hands the ask back).
    pub(super) fn answer_with(self, f: impl FnOnce(T) -> Result<T::Answer, StoreError>) {
        let _ = self.answer.send(f(self.ask));
    }
}

/// Answers every request of a batch with the same error.
pub(super) fn fail_all<T: Item>(batch: Vec<Waiting<T>>, e: &StoreError) {
    for waiting in batch {
        waiting.answer(Err(e.clone()));
    }
}

/// Answers a batch from what its statement found: each request its own answer, in order;
/// each request `alone` when the statement wrote nothing (`None`) or failed while it carried
/// several keys (one key's lock, timeout or error must not fail the others: each runs its
/// own statement, and fails only for a reason of its own); the error to a request that was
/// alone in its statement. `alone`'s flag: the statement failed, so it may have written
/// (a commit whose reply was lost).
pub(super) fn answer_all<T: Item>(
    batch: Vec<Waiting<T>>,
    found: Result<Option<Vec<T::Answer>>, StoreError>,
    alone: impl Fn(Waiting<T>, bool),
) {
    match found {
        Ok(Some(answers)) => {
            for (waiting, answer) in batch.into_iter().zip(answers) {
                waiting.answer(Ok(answer));
            }
        }
        Ok(None) => batch.into_iter().for_each(|w| alone(w, false)),
        Err(_) if batch.len() > 1 => batch.into_iter().for_each(|w| alone(w, true)),
        Err(e) => fail_all(batch, &e),
    }
}

/// A queue and its dispatcher, started on first use (a store is built outside a runtime).
pub(super) struct Queue<T: Item> {
    db: Arc<Db>,
    limits: Limits,
    sender: OnceLock<mpsc::UnboundedSender<Waiting<T>>>,
}

impl<T: Item> Queue<T> {
    pub(super) fn new(db: Arc<Db>, limits: Limits) -> Queue<T> {
        Queue {
            db,
            limits,
            sender: OnceLock::new(),
        }
    }

    /// Queues `ask` and waits for its answer. Must run inside a Tokio runtime. The
    /// dispatcher ends when the queue is dropped.
    pub(super) async fn ask(&self, ask: T) -> Result<T::Answer, StoreError> {
        let sender = self.sender.get_or_init(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(Arc::clone(&self.db), receiver, self.limits));
            sender
        });
        let (answer, answered) = oneshot::channel();
        let waiting = Waiting {
            ask,
            queued: Instant::now(),
            answer,
        };
        if sender.send(waiting).is_err() {
            return Err(StoreError::Internal(format!(
                "the {} queue has stopped",
                T::OP
            )));
        }
        // Dropped unanswered: its batch panicked (a bug), or the store is gone.
        answered.await.unwrap_or_else(|_| {
            Err(StoreError::Internal(format!(
                "a batched {} ended without an answer",
                T::OP
            )))
        })
    }
}

async fn dispatch<T: Item>(
    db: Arc<Db>,
    mut queue: mpsc::UnboundedReceiver<Waiting<T>>,
    limits: Limits,
) {
    // Requests that were waiting for a connection when the oldest of their batch ran out of
    // time: they start the next batch.
    let mut carried: Vec<Waiting<T>> = Vec::new();
    let mut open = true;
    loop {
        if carried.is_empty() {
            match queue.recv().await {
                Some(first) => carried.push(first),
                None => return,
            }
        }
        // The carried requests first, as many as the limits take; the rest wait for the next.
        let mut batch = Batch::new(&mut carried, limits);
        batch.take_queued(&mut queue);
        let oldest = batch
            .items
            .iter()
            .map(|w| w.queued)
            .min()
            .expect("a batch is never empty");
        let deadline = oldest + db.acquire_timeout;
        // A connection now when one is idle; while none is, what arrives joins the batch.
        let got = {
            let conn = db.conn_by(deadline);
            tokio::pin!(conn);
            loop {
                tokio::select! {
                    biased;
                    got = &mut conn => break got,
                    item = queue.recv(), if open && !batch.full() => match item {
                        Some(item) => batch.push(item),
                        None => open = false,
                    },
                }
            }
        };
        carried.extend(batch.overflow.take());
        let now = Instant::now();
        let (late, batch): (Vec<_>, Vec<_>) = batch
            .items
            .into_iter()
            .partition(|w| w.queued + db.acquire_timeout <= now);
        match got {
            Ok(obj) => {
                fail_all(late, &StoreError::AcquireTimeout);
                if batch.is_empty() {
                    continue;
                }
                let db = Arc::clone(&db);
                // Boxed: the spawned future is then the statement's alone.
                tokio::spawn(Box::pin(T::run(db, obj, batch)));
            }
            // No connection came in time for the oldest: it and any other whose own bound
            // passed are answered; the rest still have time, and start the next batch.
            Err(StoreError::AcquireTimeout) => {
                fail_all(late, &StoreError::AcquireTimeout);
                let overflow = std::mem::replace(&mut carried, batch);
                carried.extend(overflow);
            }
            Err(e) => {
                fail_all(late, &e);
                fail_all(batch, &e);
            }
        }
        if !open && carried.is_empty() {
            // The store is gone: answer what is still queued.
            while let Ok(item) = queue.try_recv() {
                item.answer(Err(StoreError::Internal(format!(
                    "the {} queue has stopped",
                    T::OP
                ))));
            }
            return;
        }
    }
}

/// How large one batch may grow.
#[derive(Clone, Copy)]
pub(super) struct Limits {
    /// `store.postgres.batch_keys`.
    pub(super) keys: usize,
    /// `store.postgres.batch_bytes`: the stored answers one batch carries.
    pub(super) bytes: usize,
}

/// A batch as it gathers, within its [`Limits`] (a first request is always taken, whatever
/// its size).
struct Batch<T: Item> {
    items: Vec<Waiting<T>>,
    bytes: usize,
    limits: Limits,
    /// A request that did not fit in `bytes`: it starts the next batch.
    overflow: Option<Waiting<T>>,
    /// Requests carried from an earlier batch are left for the next: nothing newer joins.
    closed: bool,
}

impl<T: Item> Batch<T> {
    /// A batch of the `carried` requests, in order, as many as the limits take; those left
    /// over stay in `carried`, in order, and the batch takes nothing more (they are older
    /// than anything queued).
    fn new(carried: &mut Vec<Waiting<T>>, limits: Limits) -> Batch<T> {
        let mut batch = Batch {
            items: Vec::new(),
            bytes: 0,
            limits,
            overflow: None,
            closed: false,
        };
        let mut rest = std::mem::take(carried).into_iter();
        for item in rest.by_ref() {
            batch.push(item);
            if batch.full() {
                break;
            }
        }
        carried.extend(batch.overflow.take());
        carried.extend(rest);
        batch.closed = !carried.is_empty();
        batch
    }

    fn full(&self) -> bool {
        self.closed
            || self.items.len() >= self.limits.keys
            || self.bytes >= self.limits.bytes
            || self.overflow.is_some()
    }

    /// Adds a request. One that would take the batch past `bytes` still joins an empty batch,
    /// and otherwise fills it: nothing more is gathered.
    fn push(&mut self, item: Waiting<T>) {
        let n = item.ask.bytes();
        if !self.items.is_empty() && self.bytes + n > self.limits.bytes {
            self.overflow = Some(item);
            return;
        }
        self.bytes += n;
        self.items.push(item);
    }

    /// Moves what is queued now into the batch, until it is full.
    fn take_queued(&mut self, queue: &mut mpsc::UnboundedReceiver<Waiting<T>>) {
        while !self.full() {
            match queue.try_recv() {
                Ok(item) => self.push(item),
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request carrying `0` bytes of stored answer, or as many as it says.
    struct Ask(usize);

    impl Item for Ask {
        const OP: &'static str = "test";
        type Answer = ();
        fn bytes(&self) -> usize {
            self.0
        }
        async fn run(_: Arc<Db>, _: Object, _: Vec<Waiting<Ask>>) {}
    }

    fn waiting(bytes: usize) -> Waiting<Ask> {
        Waiting {
            ask: Ask(bytes),
            queued: Instant::now(),
            answer: oneshot::channel().0,
        }
    }

    fn sizes(items: &[Waiting<Ask>]) -> Vec<usize> {
        items.iter().map(|w| w.ask.0).collect()
    }

    /// Requests carried over from a batch that found no connection in time (its own, and
    /// one that overflowed it) start the next batch within the same limits, oldest first; the
    /// rest wait for the one after, and nothing newer is let in ahead of them.
    #[test]
    fn carried_requests_start_the_next_batch_within_its_limits() {
        let limits = Limits {
            keys: 3,
            bytes: 1000,
        };
        // By bytes: 400 + 400 fit, 400 more would pass 1000.
        let mut carried: Vec<_> = [400, 400, 400, 10].into_iter().map(waiting).collect();
        let batch = Batch::new(&mut carried, limits);
        assert_eq!(sizes(&batch.items), [400, 400]);
        assert_eq!(batch.bytes, 800);
        assert_eq!(sizes(&carried), [400, 10]);
        assert!(
            batch.full(),
            "closed: the carried ones are older than what is queued"
        );
        // By keys.
        let mut carried: Vec<_> = [1, 2, 3, 4, 5].into_iter().map(waiting).collect();
        let batch = Batch::new(&mut carried, limits);
        assert_eq!(sizes(&batch.items), [1, 2, 3]);
        assert_eq!(sizes(&carried), [4, 5]);
        // All of them fit: the batch may still gather.
        let mut carried: Vec<_> = [1, 2].into_iter().map(waiting).collect();
        let batch = Batch::new(&mut carried, limits);
        assert_eq!(sizes(&batch.items), [1, 2]);
        assert!(carried.is_empty());
        assert!(!batch.full());
        // A first request larger than the limit goes alone.
        let mut carried: Vec<_> = [5000, 1].into_iter().map(waiting).collect();
        let batch = Batch::new(&mut carried, limits);
        assert_eq!(sizes(&batch.items), [5000]);
        assert_eq!(sizes(&carried), [1]);
    }
}
