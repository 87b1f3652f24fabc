//! Group commit for the Postgres store: the claims of new keys, and the completions, of
//! requests that are waiting at the same moment go to the database together, several keys
//! in one statement and one commit.
//!
//! This file owns the queueing: when a batch forms, how many run at once, and the bounds a
//! waiting request keeps. What a batch runs (the SQL and each key's answer) is in
//! [`super::postgres`], behind [`Item`].
//!
//! Invariants:
//! - A dispatcher task takes the first waiting request and a statement slot, and then
//!   whatever else is queued at that moment (up to `batch_keys`). When no other statement of
//!   its kind is running, that is the batch: a lone request goes straight through, so at low
//!   load every key has its own statement, as without batching. When another one is running,
//!   the batch keeps gathering until that statement ends, the batch is full, or its first
//!   request's `acquire_timeout` passes, whichever comes first. Without this, under load the
//!   free slot took whichever request came first, alone, and everything queued behind it
//!   went in the other: about two statements in three carried one key, each with its own commit
//!   (BENCHMARKS.md, "A batch gathers while the other runs"). The wait is never longer than
//!   a statement already in the database takes, which a one-slot queue would wait too. The
//!   batch's own task then takes a pooled connection, so a connection slow to come holds up
//!   that batch and its slot, never the dispatcher.
//! - At most [`STATEMENTS`] statements of each kind run at once. While they run, new requests
//!   queue, as they would for a pooled connection, and the next statement carries all of
//!   them: the busier the database, the larger the batches.
//! - Each request keeps the bounds of one call: its wait for a slot and a connection ends
//!   `acquire_timeout` after it was queued, and past that it is answered `AcquireTimeout`
//!   (nothing of it was sent). The first request of a batch bounds the wait for the slot; the
//!   connection is waited for until the youngest request's deadline, and the requests whose
//!   own deadline passed meanwhile are answered `AcquireTimeout` and left out. When no
//!   connection comes, every request of the batch gets the pool's answer. The statement runs
//!   within `statement_timeout`, with the same client-side bound, cancel and detach as every
//!   statement ([`super::postgres::Db::bounded`]). What a request does after its batch (a
//!   key that exists goes to the full claim) is a call of its own, with its own bounds.
//! - Every request is answered exactly once: by its batch; by the dropped answer channel when
//!   its batch panicked (a bug); or by the closed queue when the store is gone. The caller
//!   reports the last two as internal errors. Nobody hangs.
//! - A request whose caller stopped waiting still runs: a claim it made stays in flight until
//!   its lease expires, as when a lone statement's caller times out. The gateway runs claims
//!   and completions from spawned tasks, so a client's hang-up never drops one.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use deadpool_postgres::Object;
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio::time::Instant;

use super::StoreError;
use super::postgres::Db;

/// Statements of one kind (claims, completions) that run at once. Two: one in the database
/// while the next one's requests gather. Measured on two cores with 32 clients of new keys
/// (BENCHMARKS.md, "Two slots, measured"): one and two slots ran at about the same rate (one
/// slot's larger batches cost PostgreSQL 123-130 µs per key, two slots' 141-146); three, four
/// and eight slots made smaller batches, 174-314 µs. The rest of the pool serves everything
/// else.
pub(super) const STATEMENTS: usize = 2;

/// What one request asks of a batch, and how a batch of such asks runs.
pub(super) trait Item: Send + Sized + 'static {
    /// The operation label of the batch-size histogram.
    const OP: &'static str;
    /// What each request gets back.
    type Answer: Send + 'static;
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
/// each request `alone` when the statement could not tell (`None`); the error to all.
pub(super) fn answer_all<T: Item>(
    batch: Vec<Waiting<T>>,
    found: Result<Option<Vec<T::Answer>>, StoreError>,
    alone: impl Fn(Waiting<T>),
) {
    match found {
        Ok(Some(answers)) => {
            for (waiting, answer) in batch.into_iter().zip(answers) {
                waiting.answer(Ok(answer));
            }
        }
        Ok(None) => batch.into_iter().for_each(alone),
        Err(e) => fail_all(batch, &e),
    }
}

/// A queue and its dispatcher, started on first use (a store is built outside a runtime).
pub(super) struct Queue<T: Item> {
    db: Arc<Db>,
    batch_keys: usize,
    sender: OnceLock<mpsc::UnboundedSender<Waiting<T>>>,
}

impl<T: Item> Queue<T> {
    pub(super) fn new(db: Arc<Db>, batch_keys: usize) -> Queue<T> {
        Queue {
            db,
            batch_keys,
            sender: OnceLock::new(),
        }
    }

    /// Queues `ask` and waits for its answer. Must run inside a Tokio runtime. The
    /// dispatcher ends when the queue is dropped.
    pub(super) async fn ask(&self, ask: T) -> Result<T::Answer, StoreError> {
        let sender = self.sender.get_or_init(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(Arc::clone(&self.db), receiver, self.batch_keys));
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
    batch_keys: usize,
) {
    let slots = Arc::new(Semaphore::new(STATEMENTS));
    while let Some(first) = queue.recv().await {
        let deadline = first.queued + db.acquire_timeout;
        let Ok(Ok(slot)) =
            tokio::time::timeout_at(deadline, Arc::clone(&slots).acquire_owned()).await
        else {
            first.answer(Err(StoreError::AcquireTimeout));
            continue;
        };
        let mut batch = Vec::with_capacity(batch_keys.min(64));
        batch.push(first);
        take_queued(&mut queue, &mut batch, batch_keys);
        if batch.len() < batch_keys && slots.available_permits() + 1 < STATEMENTS {
            gather(&mut queue, &mut batch, batch_keys, &slots, deadline).await;
        }
        // The connection is taken in the batch's task: one slow to come (the database
        // restarting) holds up its batch and its slot, never the dispatcher.
        let db = Arc::clone(&db);
        tokio::spawn(async move {
            let youngest = batch
                .last()
                .map_or(deadline, |w| w.queued + db.acquire_timeout);
            match db.conn_by(youngest).await {
                Ok(obj) => {
                    let now = Instant::now();
                    let (late, batch): (Vec<_>, Vec<_>) = batch
                        .into_iter()
                        .partition(|w| w.queued + db.acquire_timeout < now);
                    fail_all(late, &StoreError::AcquireTimeout);
                    if batch.is_empty() {
                        drop(obj);
                    } else {
                        // Boxed: the spawned future is then the connection's wait alone.
                        Box::pin(T::run(db, obj, batch)).await;
                    }
                }
                Err(e) => fail_all(batch, &e),
            }
            drop(slot);
        });
    }
}

/// Moves what is queued now into `batch`, up to `batch_keys`.
fn take_queued<T: Item>(
    queue: &mut mpsc::UnboundedReceiver<Waiting<T>>,
    batch: &mut Vec<Waiting<T>>,
    batch_keys: usize,
) {
    while batch.len() < batch_keys {
        match queue.try_recv() {
            Ok(item) => batch.push(item),
            Err(_) => break,
        }
    }
}

/// While another statement of this kind runs (the caller holds one slot, another is taken),
/// adds requests to `batch` as they come, until a slot frees (a running statement ended),
/// the batch is full, or `deadline` (the first request's) passes. See the module docs.
async fn gather<T: Item>(
    queue: &mut mpsc::UnboundedReceiver<Waiting<T>>,
    batch: &mut Vec<Waiting<T>>,
    batch_keys: usize,
    slots: &Semaphore,
    deadline: Instant,
) {
    let ended = tokio::time::timeout_at(deadline, async {
        // Resolves when a running statement gives its slot back; the permit is returned at
        // once (the batch already holds its own).
        let _ = slots.acquire().await;
    });
    tokio::pin!(ended);
    while batch.len() < batch_keys {
        tokio::select! {
            biased;
            _ = &mut ended => break,
            item = queue.recv() => match item {
                Some(item) => batch.push(item),
                None => break,
            },
        }
    }
    // Whatever arrived with the statement's end rides along.
    take_queued(queue, batch, batch_keys);
}
