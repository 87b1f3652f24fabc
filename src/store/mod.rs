//! The Store: claim / finish / inspect / delete, whatever holds the rows.
//!
//! Contract for every implementation (docs/contract.md §2 and §5):
//! - [`Store::claim`] is one atomic statement that inserts the row or reports what is there;
//!   it takes over rows whose `ttl` expired and in-flight rows whose lease expired, and
//!   compares fingerprints. Leases and expiries use the database clock.
//! - [`Store::finish`] writes the outcome only if the row still carries our lease token
//!   (fencing): `Ok(false)` means our lease was taken over, and nothing was written.
//! - A row is never `completed` without its whole response in the same statement.
//! - Every call is bounded in time: it returns [`StoreError`] instead of hanging.
//!
//! A store announces what happens to keys ([`Announce`]: a key finished, announcements
//! flowing or not); it never waits for one. Waiting, and the replay cache those announcements
//! keep honest, belong to the gateway (`crate::inflight`).
//!
//! The protocol these statements make with the gateway's steps (claim, forward, record,
//! release, delete, expiry) is written as a state machine in the tests (`tests/it/model.rs`)
//! and model-checked there, faults included; its doc maps each step to the code.
//!
//! Two implementations: [`postgres::PgStore`] (many instances, production) and, with the
//! `sqlite` feature, [`sqlite::SqliteStore`] (one instance, zero setup). The conformance tests
//! (`tests/it/conformance.rs`) run the same test bodies against both.

pub mod postgres;
#[cfg(feature = "sqlite")]
pub mod sqlite;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use crate::fingerprint::Fingerprint;
use crate::metrics::StoreMetrics;
use crate::replay::StoredResponse;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the online part of a migration did ([`Store::migrate_online`]).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OnlineRun {
    /// Another instance holds the online lock: it does the work.
    pub skipped: bool,
    /// Indexes built (concurrently) by this run.
    pub indexes_built: usize,
    /// Rows backfilled by this run.
    pub rows_filled: u64,
}

/// Where a store announces what happens to keys, for whoever waits for them (the gateway's
/// in-flight registry, `crate::inflight::Wakeups`). Ids are [`crate::key::KeyId`]s, as a
/// `NOTIFY` payload carries them.
pub trait Announce: Send + Sync {
    /// The key (or a scope's slots) with this id was finished: completed, released, held,
    /// deleted, or a slot freed.
    fn wake(&self, id: &str);
    /// Announcements may have been missed (a listener reconnected): everyone looks again.
    fn wake_all(&self);
    /// Whether announcements reach this instance now.
    fn set_healthy(&self, healthy: bool);
    fn healthy(&self) -> bool;
    /// A listener session was established (counted for tests and metrics).
    fn listener_session(&self) {}
    /// A listener connection was replaced: a probe sent through the pool was not heard.
    fn listener_replaced(&self) {}
}

/// Why the store could not answer. Every variant means: assume nothing was written.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    #[error("timed out waiting for a database connection")]
    AcquireTimeout,
    #[error("database operation timed out")]
    Timeout,
    #[error("cannot connect to the database: {0}")]
    Connect(String),
    #[error("database error: {0}")]
    Db(String),
    #[error("stored row is corrupt: {0}")]
    Corrupt(&'static str),
    /// The database answers but may lose what it commits (contract §8.4), or would fail the
    /// gateway's statements (a default isolation above read committed behind a pooler): a
    /// configuration error, not an outage. The text names the setting that fixes it.
    #[error("{0}")]
    NotDurable(String),
    /// A store call failed inside the gateway itself (a bug: the embedded store's job
    /// panicked): 500 `internal`, never blamed on the store.
    #[error("a store call panicked: {0}")]
    Internal(String),
    /// The store's role may not do what the gateway needs of it (apply pending migrations):
    /// an operator must act, and trying again changes nothing until they do. The text names
    /// the role and what to run.
    #[error("{0}")]
    Privilege(String),
}

impl StoreError {
    /// The store could not be reached in time (acquire timeout, connect error, statement
    /// timeout): the only errors `on_store_error: pass_through` forwards past. A corrupt row
    /// or a database error about a row that exists must never cause a second forward.
    pub fn is_unavailable(&self) -> bool {
        match self {
            StoreError::AcquireTimeout | StoreError::Timeout | StoreError::Connect(_) => true,
            StoreError::Db(_)
            | StoreError::Corrupt(_)
            | StoreError::NotDurable(_)
            | StoreError::Internal(_)
            | StoreError::Privilege(_) => false,
        }
    }
}

/// A random token that fences every write after a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseToken(pub String);

/// What one claim asks for.
#[derive(Debug, Clone, Copy)]
pub struct ClaimRequest<'a> {
    pub scope: &'a str,
    pub key: &'a str,
    pub route: &'a str,
    pub fingerprint: &'a Fingerprint,
    pub lease: Duration,
    pub ttl: Duration,
    /// `on_unknown_outcome: hold`: an expired lease is not taken over but reported as
    /// [`Claim::Held`] (its attempt crashed or hung: the outcome is unknown).
    pub hold_expired_leases: bool,
}

/// What the claim found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// We own the key; `took_over` is true when an expired lease of another attempt was taken
    /// over (that attempt's outcome is unknown: a double execution is possible).
    Acquired { token: LeaseToken, took_over: bool },
    /// Completed with the same fingerprint: replay this. The duration is what is left of its
    /// `ttl` in database time (a replay cache may keep it no longer).
    Completed(StoredResponse, Duration),
    /// Another attempt with the same fingerprint holds a live lease, for this much longer.
    InFlight { lease_remaining: Duration },
    /// The key was used with a different request.
    Mismatch,
    /// The outcome of the first attempt is unknown and the route holds such keys (recorded
    /// as unknown, or an expired lease on a holding route).
    Held,
    /// Completed, but the response was too large to store.
    NotReplayable { status: u16 },
}

/// How a claimed attempt ended.
#[derive(Debug, Clone)]
pub enum Outcome {
    /// Store this response, to be replayed until `ttl` passes.
    Completed(StoredResponse),
    /// The upstream answered with a response too large to store.
    NotReplayable { status: u16 },
    /// Hold the key: the outcome is unknown (`on_unknown_outcome: hold`).
    Unknown,
    /// Delete the row so that a retry forwards again.
    Release,
}

/// The `state` column of a key's row, spelled the same in both stores' schemas.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RowState {
    /// Claimed; an attempt holds (or held) its lease.
    InFlight,
    /// The answer is stored: status, headers and body are all set.
    Completed,
    /// Answered, but too large to store: only the status is kept.
    NotReplayable,
    /// The outcome of the attempt is unknown and the route holds such keys.
    Unknown,
}

impl RowState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            RowState::InFlight => "in_flight",
            RowState::Completed => "completed",
            RowState::NotReplayable => "not_replayable",
            RowState::Unknown => "unknown",
        }
    }

    pub(crate) fn parse(s: &str) -> Option<RowState> {
        Some(match s {
            "in_flight" => RowState::InFlight,
            "completed" => RowState::Completed,
            "not_replayable" => RowState::NotReplayable,
            "unknown" => RowState::Unknown,
            _ => return None,
        })
    }
}

/// An existing key's row as a claim reads it back, whichever store: what decides the
/// answer to a request that found its key already there (docs/contract.md §2.4).
pub(crate) struct ExistingRow<'a> {
    pub state: &'a str,
    pub fingerprint: &'a [u8],
    pub status: Option<i64>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<Vec<u8>>,
    /// In flight and its lease has ended (database time).
    pub lease_expired: bool,
    pub lease_remaining_ms: i64,
    pub expires_in_ms: i64,
}

impl ExistingRow<'_> {
    /// The claim's answer for a request with fingerprint `fp`. A row that breaks the
    /// schema's invariants (an unknown state, a completed row without its answer) is
    /// [`StoreError::Corrupt`], never a guess.
    pub(crate) fn decide(self, fp: &[u8]) -> Result<Claim, StoreError> {
        if self.fingerprint != fp {
            return Ok(Claim::Mismatch);
        }
        let ms = |v: i64| Duration::from_millis(u64::try_from(v).unwrap_or(0));
        let status = self
            .status
            .and_then(|s| u16::try_from(s).ok())
            .filter(|s| http::StatusCode::from_u16(*s).is_ok());
        let state = RowState::parse(self.state).ok_or(StoreError::Corrupt("unknown state"))?;
        Ok(match state {
            // Only a route that holds unknown outcomes leaves an expired lease in place.
            RowState::InFlight if self.lease_expired => Claim::Held,
            RowState::InFlight => Claim::InFlight {
                lease_remaining: ms(self.lease_remaining_ms),
            },
            RowState::Unknown => Claim::Held,
            RowState::NotReplayable => Claim::NotReplayable {
                status: status.ok_or(StoreError::Corrupt("missing or invalid status"))?,
            },
            RowState::Completed => {
                let (Some(status), Some(headers), Some(body)) = (
                    status,
                    self.headers
                        .as_deref()
                        .and_then(StoredResponse::decode_headers),
                    self.body,
                ) else {
                    return Err(StoreError::Corrupt("incomplete stored response"));
                };
                Claim::Completed(
                    StoredResponse {
                        status,
                        headers,
                        body: body.into(),
                    },
                    ms(self.expires_in_ms),
                )
            }
        })
    }
}

/// The columns a final outcome writes (every store's finish statement takes these).
pub(crate) struct FinishRow<'a> {
    pub state: &'static str,
    pub status: Option<i32>,
    pub headers: Option<Vec<u8>>,
    pub body: Option<&'a [u8]>,
}

impl<'a> FinishRow<'a> {
    pub(crate) fn of(outcome: &'a Outcome) -> FinishRow<'a> {
        let (state, status, headers, body) = match outcome {
            Outcome::Completed(r) => (
                RowState::Completed,
                Some(i32::from(r.status)),
                Some(r.encode_headers()),
                Some(&r.body[..]),
            ),
            Outcome::NotReplayable { status } => (
                RowState::NotReplayable,
                Some(i32::from(*status)),
                None,
                None,
            ),
            Outcome::Unknown => (RowState::Unknown, None, None, None),
            // Release deletes the row instead (RELEASE_SQL); nothing is written.
            Outcome::Release => (RowState::InFlight, None, None, None),
        };
        FinishRow {
            state: state.as_str(),
            status,
            headers,
            body,
        }
    }
}

/// A row as an operator sees it (`idemgate keys show`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyInfo {
    pub scope: String,
    pub key: String,
    pub route: String,
    pub state: String,
    pub status: Option<u16>,
    pub attempts: i32,
    pub body_bytes: Option<usize>,
    pub created_at: String,
    pub completed_at: Option<String>,
    pub lease_expires_at: Option<String>,
    pub expires_at: String,
    pub fingerprint_hex: String,
    /// Milliseconds since `created_at`, by the database clock when read.
    pub age_ms: i64,
    /// Milliseconds left of the lease (negative: ended), by the database clock when read;
    /// `None` when the row holds no lease (not in flight).
    pub lease_left_ms: Option<i64>,
}

/// The most keys one page of a listing returns ([`ListQuery::limit`]).
pub const LIST_LIMIT_MAX: usize = 1000;
/// How many rows a page may read per key it may return ([`ListQuery::examine`]).
pub const LIST_EXAMINE_PER_KEY: usize = 10;
/// The most rows one page of a listing reads, whatever its filters match.
pub const LIST_EXAMINE_MAX: usize = 10_000;

/// One page of an operator's listing of keys (`idemgate keys list`, `GET /v1/keys`).
///
/// The page walks the primary key `(scope, key)` in order from just after `after` (the
/// start when `None`), only inside `scope` when given, reads at most `examine` rows, and
/// returns those of them that match the other filters, at most `limit`. Filters other than
/// the scope are checked on the rows read: no other index is used or needed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListQuery {
    /// The last `(scope, key)` of the previous page.
    pub after: Option<(String, String)>,
    /// One stored scope (`header:acct_9`), walked as a prefix of the primary key.
    pub scope: Option<String>,
    pub state: Option<String>,
    pub route: Option<String>,
    /// Only keys created at least this long ago (database clock).
    pub older_than: Option<Duration>,
    pub limit: usize,
    pub examine: usize,
}

/// What one page of a listing found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListPage {
    /// The rows that match, in primary-key order.
    pub keys: Vec<KeyInfo>,
    /// How many rows the page read.
    pub examined: usize,
    /// Where the next page starts (after this `(scope, key)`); `None`: the walk reached the
    /// end (of the table, or of the scope).
    pub next: Option<(String, String)>,
}

impl ListPage {
    /// Where the next page starts, from what this one did: it read `examined` rows, the last
    /// of them `last_read`, and returned `matched` keys, the last of them `last_match`
    /// (`last_read` itself when `last_match_is_last_read`). A page that returned `limit`
    /// keys goes on after its last key (rows it read past that key are read again), unless
    /// that key was the last row there is; a page that read `examine` rows goes on after the
    /// last of them; any other page read to the end.
    pub(crate) fn next_after(
        q: &ListQuery,
        examined: usize,
        last_match: Option<(String, String)>,
        last_read: Option<(String, String)>,
        matched: usize,
        last_match_is_last_read: bool,
    ) -> Option<(String, String)> {
        if matched >= q.limit && !(last_match_is_last_read && examined < q.examine) {
            last_match
        } else if matched < q.limit && examined >= q.examine {
            last_read
        } else {
            None
        }
    }
}

/// What an operator's delete did (docs/contract.md §8.2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Deleted {
    /// The row is gone. `live_lease`: it was in flight under a live lease (a forced delete:
    /// the attempt may still complete upstream, and a retry forwards again: a possible
    /// double).
    Yes { route: String, live_lease: bool },
    /// No such row.
    NotFound,
    /// Refused: the key is in flight under a live lease and the delete was not forced.
    InFlight,
}

/// A forwarding slot of a scope (`serialize`), held until released or its lease ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Slot {
    pub scope: String,
    pub slot: i32,
    /// Fences the release: a slot taken over after its lease ended is not freed by us.
    pub token: String,
}

/// What one garbage collection did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GcRun {
    /// Expired rows deleted.
    pub deleted: u64,
    /// False when another instance held the collection lock, so this one did nothing.
    pub ran: bool,
}

pub trait Store: Send + Sync + 'static {
    /// Claims `(scope, key)` in one statement; see the module docs.
    fn claim<'a>(&'a self, req: ClaimRequest<'a>) -> BoxFuture<'a, Result<Claim, StoreError>>;

    /// Records an outcome, fenced by the lease token. `Ok(false)`: the lease was lost.
    fn finish<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        token: &'a LeaseToken,
        outcome: Outcome,
        ttl: Duration,
    ) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Asks to be woken when the in-flight key is finished (stores that announce only to
    /// waiters). `Ok(false)`: the key is no longer in flight; look again now.
    fn watch<'a>(
        &'a self,
        _scope: &'a str,
        _key: &'a str,
    ) -> BoxFuture<'a, Result<bool, StoreError>> {
        Box::pin(async { Ok(true) })
    }

    /// Reads one row for operators.
    fn inspect<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
    ) -> BoxFuture<'a, Result<Option<KeyInfo>, StoreError>>;

    /// One page of an operator's listing (see [`ListQuery`]): a walk of the primary key that
    /// reads at most `q.examine` rows.
    fn list<'a>(&'a self, q: &'a ListQuery) -> BoxFuture<'a, Result<ListPage, StoreError>>;

    /// Deletes one row (operator release), in one atomic step: a row in flight under a
    /// live lease only when `force`, so a delete never races a lease into a double unasked.
    fn delete<'a>(
        &'a self,
        scope: &'a str,
        key: &'a str,
        force: bool,
    ) -> BoxFuture<'a, Result<Deleted, StoreError>>;

    /// Deletes expired rows in batches of `batch`, unless another instance is collecting.
    fn gc(&self, batch: usize) -> BoxFuture<'_, Result<GcRun, StoreError>>;

    /// Takes a forwarding slot of `scope` for a route whose limit is `max_in_flight`, leased
    /// for `lease`, across all instances. The slot records that limit, and it is granted only
    /// if, counting it, the scope's live slots number at most `max_in_flight` and at most the
    /// limit of every live holder; the decision is atomic with respect to every other taker
    /// of the scope. `Ok(None)`: the scope is full for this route now.
    fn acquire_slot<'a>(
        &'a self,
        scope: &'a str,
        max_in_flight: u32,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<Slot>, StoreError>>;

    /// Frees a slot we hold and wakes the scope's waiters. `Ok(false)`: it was taken over.
    fn release_slot<'a>(&'a self, slot: &'a Slot) -> BoxFuture<'a, Result<bool, StoreError>>;

    /// Applies pending migrations (safe to run from several instances at once where the
    /// store allows several). Returns how many were applied.
    fn migrate(&self) -> BoxFuture<'_, Result<usize, StoreError>>;

    /// The work migrations leave for after their transaction (indexes built concurrently,
    /// backfills in batches), run while the gateway serves; idempotent. Nothing by default.
    fn migrate_online(&self) -> BoxFuture<'_, Result<OnlineRun, StoreError>> {
        Box::pin(async { Ok(OnlineRun::default()) })
    }

    /// Starts what runs beside the requests (the Postgres wake-up listener) and names where
    /// the store announces finished keys from then on (the first call's `announce` stays).
    /// Must be called inside a Tokio runtime; without it, waiters poll.
    fn start_background(&self, announce: Arc<dyn Announce>);

    /// The store's own metrics (operation latency, pool wait, pool state).
    fn metrics(&self) -> &StoreMetrics;

    /// Refreshes gauges read at scrape time (pool state).
    fn observe_pool(&self) {}

    /// Whether the store answers, keeps what it commits (see [`Store::durability`]) and its
    /// schema is current.
    fn ready(&self) -> BoxFuture<'_, Result<(), StoreError>>;

    /// Whether a commit, once acknowledged, survives a crash of the database as it is
    /// configured for us (guarantee 3): [`StoreError::NotDurable`] when it may not and the
    /// configuration does not accept that; other errors when the store cannot say now.
    fn durability(&self) -> BoxFuture<'_, Result<(), StoreError>> {
        Box::pin(async { Ok(()) })
    }
}

#[cfg(test)]
mod tests;
