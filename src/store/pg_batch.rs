//! Group commit for the Postgres store: the claims of new keys, and the completions, of
//! requests that are waiting at the same moment go to the database together, several keys
//! in one statement and one commit.
//!
//! This file owns the queueing: when a batch forms, how many run at once, and the bounds a
//! waiting request keeps. What a batch runs (the SQL and each key's answer) is in
//! [`super::postgres`], behind [`Item`].
//!
//! Invariants:
//! - A batch forms only from requests already waiting. A dispatcher task takes the first
//!   waiting item and a statement slot, and then whatever else is queued at that moment (up
//!   to `batch_keys`); it never waits for company. The batch's own task then takes a pooled
//!   connection, so a connection slow to come holds up that batch only. A lone request goes
//!   straight through, so at low load every key has its own statement, as without batching.
//! - At most [`STATEMENTS`] statements of each kind run at once. While they run, new requests
//!   queue, as they would for a pooled connection, and the next statement carries all of
//!   them: the busier the database, the larger the batches.
//! - The bounds are those of one lone call. The first item of a batch waits for a slot and
//!   a connection until `acquire_timeout` after it was queued, and is answered
//!   `AcquireTimeout` (nothing written) past it; the items taken with it were queued after it
//!   and share its deadline. When no connection comes, every item of the batch gets the
//!   pool's answer.
//!   The statement runs within `statement_timeout`, with the same client-side bound, cancel
//!   and detach as every statement ([`super::postgres::Db::bounded`]).
//! - Every item is answered exactly once: by its batch, or, when the dispatcher is gone (the
//!   store was dropped, or a batch panicked), by the closed channel, which its caller reports
//!   as an internal error. Nobody hangs.
//! - An item whose caller stopped waiting still runs: a claim it made stays in flight until
//!   its lease expires, as when a lone statement's caller times out. The gateway runs claims
//!   and completions from spawned tasks, so a client's hang-up never drops one.

use std::future::Future;
use std::sync::{Arc, OnceLock};

use deadpool_postgres::Object;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;

use super::StoreError;
use super::postgres::Db;

/// Statements of one kind (claims, completions) that run at once. Two: one in the database
/// while the next one's requests gather, and the database's CPUs kept busy on a small
/// machine. The rest of the pool serves everything else.
pub(super) const STATEMENTS: usize = 2;

/// One request's part of a batch, and how a batch of them runs.
pub(super) trait Item: Send + Sized + 'static {
    /// The operation label of the batch-size histogram.
    const OP: &'static str;
    /// When the item was queued.
    fn queued(&self) -> Instant;
    /// Answers the item with an error; nothing of it was sent.
    fn fail(self, e: StoreError);
    /// Runs a batch on `obj` and answers each item.
    fn run(db: Arc<Db>, obj: Object, batch: Vec<Self>) -> impl Future<Output = ()> + Send;
}

/// A queue and its dispatcher, started on first use (a store is built outside a runtime).
pub(super) struct Queue<T: Item> {
    db: Arc<Db>,
    batch_keys: usize,
    sender: OnceLock<mpsc::UnboundedSender<T>>,
}

impl<T: Item> Queue<T> {
    pub(super) fn new(db: Arc<Db>, batch_keys: usize) -> Queue<T> {
        Queue {
            db,
            batch_keys,
            sender: OnceLock::new(),
        }
    }

    /// Queues `item`; its answer comes on the channel the item carries. Must run inside a
    /// Tokio runtime. The dispatcher ends when the queue is dropped.
    pub(super) fn push(&self, item: T) {
        let sender = self.sender.get_or_init(|| {
            let (sender, receiver) = mpsc::unbounded_channel();
            tokio::spawn(dispatch(Arc::clone(&self.db), receiver, self.batch_keys));
            sender
        });
        if let Err(mpsc::error::SendError(item)) = sender.send(item) {
            item.fail(StoreError::Internal(format!(
                "the {} queue has stopped",
                T::OP
            )));
        }
    }
}

async fn dispatch<T: Item>(db: Arc<Db>, mut queue: mpsc::UnboundedReceiver<T>, batch_keys: usize) {
    let slots = Arc::new(Semaphore::new(STATEMENTS));
    while let Some(first) = queue.recv().await {
        let deadline = first.queued() + db.acquire_timeout;
        let Ok(Ok(slot)) =
            tokio::time::timeout_at(deadline, Arc::clone(&slots).acquire_owned()).await
        else {
            first.fail(StoreError::AcquireTimeout);
            continue;
        };
        let mut batch = Vec::with_capacity(batch_keys.min(64));
        batch.push(first);
        while batch.len() < batch_keys {
            match queue.try_recv() {
                Ok(item) => batch.push(item),
                Err(_) => break,
            }
        }
        // The connection is taken in the batch's task: one slow to come (the database
        // restarting) holds up its batch and its slot, never the dispatcher.
        let db = Arc::clone(&db);
        tokio::spawn(async move {
            match db.conn_by(deadline).await {
                Ok(obj) => {
                    db.metrics.batch(T::OP, batch.len());
                    T::run(db, obj, batch).await;
                }
                Err(e) => batch.into_iter().for_each(|item| item.fail(e.clone())),
            }
            drop(slot);
        });
    }
}
