//! The batched statements: new-key claims and completions of several keys in one statement
//! and one commit, each key with its own answer (the queue that gathers them is `batch.rs`).
//! A batch never shares its fate: a key's own error, or a deadlock, leaves each key to its
//! single statement.

use std::sync::Arc;

use deadpool_postgres::Object;
use tokio_postgres::error::SqlState;

use super::batch::{Item, Limits, Queue, Waiting, answer_all};
use super::session::*;
use super::statements::*;
use crate::store::{ClaimRequest, FinishRow, LeaseToken, Outcome, StoreError};

/// The batch queues of a store with `batch_keys` above 1 (see [`super::batch`]).
pub(super) struct Batches {
    pub(super) claims: Queue<NewKey>,
    pub(super) finishes: Queue<Completion>,
}

impl Batches {
    pub(super) fn new(db: Arc<Db>, limits: Limits) -> Batches {
        Batches {
            claims: Queue::new(Arc::clone(&db), limits),
            finishes: Queue::new(db, limits),
        }
    }

    /// Claims a new key in a batch: its lease token, or `None` when the full claim must
    /// decide (the key exists, or the batch could not tell).
    pub(super) async fn claim_new(
        &self,
        req: &ClaimRequest<'_>,
    ) -> Result<Option<LeaseToken>, StoreError> {
        let p = NewKeyParams::of(req);
        self.claims
            .ask(NewKey {
                scope: p.scope.to_owned(),
                key: p.key.to_owned(),
                route: p.route.to_owned(),
                fingerprint: *req.fingerprint,
                lease_ms: p.lease_ms,
                ttl_ms: p.ttl_ms,
            })
            .await
    }

    /// Completes an attempt in a batch: whether it wrote, or the outcome back when it must
    /// run alone.
    pub(super) async fn finish(
        &self,
        f: FinishParams<'_>,
        outcome: Outcome,
    ) -> Result<Finished, StoreError> {
        self.finishes
            .ask(Completion {
                scope: f.scope.to_owned(),
                key: f.key.to_owned(),
                token: f.token.to_owned(),
                ttl_ms: f.ttl_ms,
                id: f.id.to_owned(),
                outcome,
            })
            .await
    }
}

/// A batch statement's rows, or `None` when it wrote nothing for a reason of one of its keys
/// rather than of the store: chosen as a deadlock's victim (batched statements take their
/// keys in one order, so it should be rare), or a row held locked past the batch's 100 ms
/// (migrations/0008). Every key then runs alone, where only the one on the held row waits.
pub(super) fn unless_deadlocked(
    found: Result<Vec<tokio_postgres::Row>, tokio_postgres::Error>,
) -> Result<Option<Vec<tokio_postgres::Row>>, tokio_postgres::Error> {
    match found {
        Err(e)
            if e.code() == Some(&SqlState::T_R_DEADLOCK_DETECTED)
                || e.code() == Some(&SqlState::LOCK_NOT_AVAILABLE) =>
        {
            Ok(None)
        }
        found => found.map(Some),
    }
}

/// An ask about one key, known by its scope and key.
pub(super) trait Keyed: Item {
    fn id(&self) -> (&str, &str);
}

/// Sorts a batch by key and keeps one request per key: a later one for a key already in the
/// batch is handed to `alone` (it runs its own statement after this one).
pub(super) fn one_per_key<T: Keyed>(
    mut batch: Vec<Waiting<T>>,
    alone: impl Fn(Waiting<T>),
) -> Vec<Waiting<T>> {
    batch.sort_unstable_by(|a, b| a.ask.id().cmp(&b.ask.id()));
    let mut kept: Vec<Waiting<T>> = Vec::with_capacity(batch.len());
    for waiting in batch {
        if kept
            .last()
            .is_some_and(|last| last.ask.id() == waiting.ask.id())
        {
            alone(waiting);
        } else {
            kept.push(waiting);
        }
    }
    kept
}

/// Which requests of a sorted, one-per-key batch the rows name (by scope and key).
pub(super) fn named<T: Keyed>(
    batch: &[Waiting<T>],
    rows: &[tokio_postgres::Row],
) -> Vec<Option<usize>> {
    rows.iter()
        .map(|row| {
            let wanted: (&str, &str) = (row.get(0), row.get(1));
            batch.binary_search_by(|w| w.ask.id().cmp(&wanted)).ok()
        })
        .collect()
}

/// One column of a batch's parameter arrays.
pub(super) fn column<'a, T: Item, V>(batch: &'a [Waiting<T>], f: impl Fn(&'a T) -> V) -> Vec<V> {
    batch.iter().map(|w| f(&w.ask)).collect()
}

/// A new key's claim.
pub(super) struct NewKey {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) route: String,
    pub(super) fingerprint: crate::fingerprint::Fingerprint,
    pub(super) lease_ms: i64,
    pub(super) ttl_ms: i64,
}

impl NewKey {
    pub(super) fn params(&self) -> NewKeyParams<'_> {
        NewKeyParams {
            scope: &self.scope,
            key: &self.key,
            route: &self.route,
            fingerprint: &self.fingerprint,
            lease_ms: self.lease_ms,
            ttl_ms: self.ttl_ms,
        }
    }
}

impl Keyed for NewKey {
    fn id(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }
}

impl Item for NewKey {
    const OP: &'static str = "claim_new";
    /// The lease token, or `None`: the full claim decides.
    type Answer = Option<LeaseToken>;

    async fn run(db: Arc<Db>, obj: Object, batch: Vec<Waiting<NewKey>>) {
        // A second claim of a key in this batch goes to the full statement at once; the
        // unique index orders it with this insert, and it decides on the row it finds.
        let batch = one_per_key(batch, |w| w.answer(Ok(None)));
        db.metrics.batch(NewKey::OP, batch.len());
        let tokens = db
            .bounded(obj, async |c| {
                if let [one] = &batch[..] {
                    let token = c.claim_new(one.ask.params()).await?;
                    return Ok(Some(vec![token.map(LeaseToken)]));
                }
                let found = c
                    .query(
                        CLAIM_NEW_BATCH_CALL,
                        CLAIM_NEW_BATCH_TYPES,
                        &[
                            &column(&batch, |k| k.scope.as_str()),
                            &column(&batch, |k| k.key.as_str()),
                            &column(&batch, |k| k.route.as_str()),
                            &column(&batch, |k| &k.fingerprint[..]),
                            &column(&batch, |k| k.lease_ms),
                            &column(&batch, |k| k.ttl_ms),
                        ],
                    )
                    .await;
                let Some(rows) = unless_deadlocked(found)? else {
                    return Ok(None);
                };
                let mut tokens = vec![None; batch.len()];
                for (row, at) in rows.iter().zip(named(&batch, &rows)) {
                    if let Some(at) = at {
                        tokens[at] = Some(LeaseToken(row.get(2)));
                    }
                }
                Ok(Some(tokens))
            })
            .await;
        // Without an answer, the full statement decides each key, one at a time.
        answer_all(batch, tokens, |w, _| w.answer(Ok(None)));
    }
}

/// What a batched completion tells its caller.
pub(super) enum Finished {
    /// The statement ran: whether it wrote the row (false: the lease was lost).
    Written(bool),
    /// Run the completion alone: nothing was written (a second one for the key in the
    /// batch, or the batch wrote nothing: a deadlock's victim, a row held past its lock
    /// wait), or the batch failed after it was sent and `may_have_written` (a commit whose
    /// reply was lost).
    Alone {
        outcome: Outcome,
        may_have_written: bool,
    },
}

/// The completion of one attempt.
pub(super) struct Completion {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) token: String,
    pub(super) ttl_ms: i64,
    pub(super) id: String,
    pub(super) outcome: Outcome,
}

impl Completion {
    pub(super) fn params(&self) -> FinishParams<'_> {
        FinishParams {
            scope: &self.scope,
            key: &self.key,
            token: &self.token,
            ttl_ms: self.ttl_ms,
            id: &self.id,
        }
    }

    /// Hands the outcome back, to be written alone (see [`Finished::Alone`]).
    pub(super) fn alone(waiting: Waiting<Completion>, may_have_written: bool) {
        waiting.answer_with(|c| {
            Ok(Finished::Alone {
                outcome: c.outcome,
                may_have_written,
            })
        });
    }
}

impl Keyed for Completion {
    fn id(&self) -> (&str, &str) {
        (&self.scope, &self.key)
    }
}

impl Item for Completion {
    const OP: &'static str = "finish";
    type Answer = Finished;

    fn bytes(&self) -> usize {
        match &self.outcome {
            Outcome::Completed(stored) => stored.body.len(),
            _ => 0,
        }
    }

    async fn run(db: Arc<Db>, obj: Object, batch: Vec<Waiting<Completion>>) {
        let batch = one_per_key(batch, |w| Completion::alone(w, false));
        db.metrics.batch(Completion::OP, batch.len());
        let written = db
            .bounded(obj, async |c| {
                if let [one] = &batch[..] {
                    let f = &one.ask;
                    let written = c.finish_one(f.params(), &f.outcome).await?;
                    return Ok(Some(vec![Finished::Written(written)]));
                }
                let rows: Vec<FinishRow<'_>> = column(&batch, |f| FinishRow::of(&f.outcome));
                let found = c
                    .query(
                        FINISH_BATCH_CALL,
                        FINISH_BATCH_TYPES,
                        &[
                            &column(&batch, |f| f.scope.as_str()),
                            &column(&batch, |f| f.key.as_str()),
                            &column(&batch, |f| f.token.as_str()),
                            &rows.iter().map(|r| r.state).collect::<Vec<_>>(),
                            &rows.iter().map(|r| r.status).collect::<Vec<_>>(),
                            &rows
                                .iter()
                                .map(|r| r.headers.as_deref())
                                .collect::<Vec<_>>(),
                            &rows.iter().map(|r| r.body).collect::<Vec<_>>(),
                            &column(&batch, |f| f.ttl_ms),
                            &column(&batch, |f| f.id.as_str()),
                        ],
                    )
                    .await;
                let Some(done) = unless_deadlocked(found)? else {
                    return Ok(None);
                };
                let mut written: Vec<Finished> =
                    batch.iter().map(|_| Finished::Written(false)).collect();
                for row in &done {
                    let at: i32 = row.get(0);
                    if let Some(w) = usize::try_from(at - 1)
                        .ok()
                        .and_then(|i| written.get_mut(i))
                    {
                        *w = Finished::Written(true);
                    }
                }
                Ok(Some(written))
            })
            .await;
        answer_all(batch, written, Completion::alone);
    }
}
