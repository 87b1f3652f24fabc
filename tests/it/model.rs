//! The claim protocol as a state machine, model-checked over every interleaving within
//! bounds (tests only, with stateright): clients retrying one (scope, key), several gateway
//! instances, the key's row with its lease and token, an upstream that executes, and the
//! faults. It is the `Store` (src/store/mod.rs) contract seen from above: what the statements
//! of `src/store/postgres/` and the steps of `src/gateway/` do to one key, one step at a time.
//!
//! What each statement decides from the row it finds (the claim, the fenced ends, the
//! delete) is not re-typed here: it comes from the decision table of `decisions.rs`, which
//! the conformance suite drives every store through, row by row
//! (`conformance::*::every_row_of_the_decision_table_holds`). The claim is one step of the
//! model whether the store sends it as one statement or as the look (`LOOK_SQL`) and then
//! `CLAIM_SQL`, alone or in a batch of new keys: the look writes nothing and a claimable row
//! goes on to the statement that decides under the row's lock. Batches of several keys and
//! `serialize` slots need two keys: they are a second, smaller model in [`scope`] (two keys
//! of one scope; its own module doc says what it stands for), checked by the tests of this
//! module. On the stores, one key's error failing only that key is tested by `batches.rs`.
//!
//! # The state
//!
//! - The row of `idemgate_keys`: `state` (in flight, completed, unknown), `lease_token`, the
//!   response, `attempts`, and whether `expires_at` has passed. Leases are a set of tokens
//!   whose `lease_expires_at` has not passed in database time.
//! - Each gateway instance works on one keyed request at a time (more instances, more
//!   requests at once): idle → forwarding (claimed, token in hand, the request on its way or
//!   at the upstream) → answered (a storable answer read whole) or unknown (timed out) →
//!   idle. A crash at any step sends it back to idle with nothing it knew.
//! - Clients: a number of tries, each sent to an idle instance at any moment (a try is a try
//!   whoever sends it; a waiter that looks again after `in_flight: wait` is one more try).
//! - Time: no clock. A lease ends by a step of its own that may come at any moment, even
//!   while its holder still works (a paused process, a slow pool): the holder may still
//!   write after it, and only the fence makes that write a no-op. The real gateway does not
//!   start a record retry past its lease (`Claimed::record`) and checks at load that
//!   `lease` outlasts the upstream's `timeout`; the model does not count on either. A row's
//!   `ttl` passes only after its lease ended (`lease` <= `ttl` is checked at load).
//! - Every check starts from both `on_unknown_outcome: reforward` and `hold`.
//!
//! # Transitions and the code they stand for
//!
//! | transition | code |
//! |---|---|
//! | `Claim` | `KeyedRequest::work` → `Store::claim`: CLAIM_SQL in `PgStore::claim_once`, one statement: inserts, or takes over a row whose `ttl` passed or an in-flight row whose lease ended (not under `hold`: `Claim::Held`), or reports what is there (`Completed`: a replay; `InFlight`: 409). `took_over` comes from `attempts` and is counted `taken_over`. |
//! | `ClaimFails { applied }` | a store error on the claim: 503 `store-unavailable`, nothing forwarded; `applied`: the statement committed but its answer was lost. |
//! | `Upstream { Answers }` | `Claimed::forward`: `upstream.send_streamed`, body read whole (`Captured::Whole`). |
//! | `Upstream { TimesOutAfterWork / TimesOutBeforeWork }` | `Claimed::forward`: `UpstreamError::Timeout`, 504, counted `upstream_timeout`; the upstream did the work or not. |
//! | `Finish` (answered) | `Claimed::record` → `Claimed::finish` → `Store::finish(Outcome::Completed)`: FINISH_SQL, fenced by `lease_token` and `state = 'in_flight'`. `Ok(false)`: counted `lost`, and the client still gets the upstream's answer (docs/contract.md §2.6). |
//! | `Finish` (unknown) | `Store::finish(Outcome::Release)`: RELEASE_SQL (`reforward`), or `Outcome::Unknown`: FINISH_SQL with `'unknown'` (`hold`); both fenced. |
//! | `FinishFails { applied }` | a store error on that write. After an answer, `Claimed::record` tries again (`Finish`) or gives up (`GiveUp`: 503 `store-unavailable`); a failed release or hold is logged and left to the lease. |
//! | `Crash { work_done }` | the instance dies; `work_done`: the upstream executed what it had been sent. |
//! | `LeaseExpires` | the database clock passes `lease_expires_at`. |
//! | `TtlExpires` | the database clock passes `expires_at`: CLAIM_SQL's `k.expires_at <= now()` then inserts afresh. |
//! | `Gc` | GC_SQL (`PgStore::gc`, `idemgate gc`). |
//! | `Delete { force }` | DELETE_SQL via `keys::delete` (`idemgate keys delete`, `DELETE /v1/keys`): `Deleted::InFlight` (409, exit 1) under a live lease unless forced; a forced one is counted `force_deleted`. |
//!
//! The embedded store runs each of these statements as one write transaction on its only
//! writer, so the model describes it too. That CLAIM_SQL acts as one step, including the
//! re-read when its snapshot is older than the row it conflicted with, is taken as given
//! here; `store_claim` and the conformance tests check it against real databases.
//!
//! # Properties
//!
//! A *life* of the key runs from a claim of a key the store does not remember until an
//! operator deletes the row or its `ttl` passes; a request after that is a new request
//! (guarantee 2). Executions and answers belong to the life of the claim they came from.
//!
//! - [`ONE_LIVE_FORWARD`]: never two forwards in progress under live leases, except one whose
//!   row an operator deleted by force (counted `force_deleted`).
//! - [`ONE_ANSWER`]: every 2xx a client gets names an upstream execution (the model builds
//!   answers only from executions), and in one life they all name the same one: a replay
//!   names what the first answer named. The exception is the one contract §2.6 makes: an
//!   attempt whose lease was taken over before it could record still answers with what its
//!   upstream said (counted `lost`, after a counted `taken_over`).
//! - [`COMPLETED_HOLDS_RESPONSE`]: a completed row holds its response.
//! - [`FENCED_WRITE_CHANGES_NOTHING`]: a row's response is always the answer to the attempt
//!   that claimed that row: a write by an attempt that lost its lease changes nothing.
//! - [`DOUBLES_COUNTED`]: every takeover is counted, and the upstream executes a life's
//!   request a second time only after a counted takeover or a counted unknown outcome (a
//!   timeout released under `reforward`); under `hold`, never.
//! - [`DEAD_HOLDER_TAKEN_OVER`] (liveness): from every reachable state where the row is in
//!   flight and no attempt holds its token (its holder crashed, gave up its write, or its
//!   claim committed unanswered), the lease's end and then a new try take the key over under
//!   `reforward` (the new attempt forwards under a live lease) and answer 502
//!   `outcome-unknown` under `hold`, never 409 until the `ttl`. It is an invariant that runs
//!   the model's own steps (`LeaseExpires`, then `Claim`) from each such state, not
//!   stateright's `eventually`: clients may stop retrying, so "eventually claimed" is not a
//!   property of every run, and stateright 0.31 judges `eventually` only where a path ends
//!   and takes a state reached again (a cycle, or two paths joining) as already judged, so it
//!   can miss a counterexample (its own docs say so).
//!
//! The two exceptions are needed: without them (`literal`), the checker finds a lease-lost
//! answer that no retry will get, and a timeout released under `reforward` whose retry
//! executes again without a takeover. Both are the design (contract §2), and counted.
//!
//! A coverage check reaches, in the same bounds, a replay, a takeover, a second execution in
//! one life, a fenced write that finds its lease lost, an answer by such an attempt, a held
//! key, a refused and a forced delete, and a forgotten key executed again; so none of the
//! properties holds for want of getting there. The liveness check's situation (an in-flight
//! row no attempt holds) is reached too: the broken variant that never takes it over fails
//! it. The two-key model's coverage check reaches two new keys claimed in one batch, two
//! completions written in one batch, a key of a failed batch claimed alone and one completed
//! alone, a request that waits out the slot another key holds, a slot taken while its
//! previous holder, past its slot lease, still forwards, a takeover, and a completion that
//! finds its lease lost.
//!
//! # Broken variants ([`Bug`]), and what the checker finds (shortest runs)
//!
//! - Claim by check, then insert: two claims read "no row", both insert, and two forwards
//!   run under live leases (4 steps); or the blind insert replaces a row whose lease ended
//!   without counting a takeover (4 steps).
//! - Completion without the fence: an attempt's row is deleted by force, another claims
//!   it, and the first attempt's completion lands in its successor's row (5 steps).
//! - Answer before commit: the first attempt answers, its lease ends before it records, a
//!   takeover executes again and answers something else in the same life (5 steps).
//! - Completion in two writes: the row is completed before its response is in it (3 steps).
//! - Release without the fence: an attempt times out, its lease ends, a takeover claims the
//!   row, the first attempt's release deletes it, and a third claim forwards beside the
//!   second under live leases (6 steps).
//! - `hold` that takes over: a crashed attempt executed, its lease ends, a claim under
//!   `hold` takes the row over and the upstream executes again (5 steps).
//! - Delete that ignores a live lease: a non-forced delete removes the row of an attempt in
//!   flight, and a second claim forwards beside it, uncounted (3 steps).
//! - A claim that takes an in-flight row over only after its `ttl`: a claim committed
//!   unanswered leaves a row no attempt holds, and after its lease a new try is answered 409
//!   (1 step; a crash of the holder takes 2).
//!
//! In the two-key model ([`scope`]):
//!
//! - Shared fate: two new keys' claims go in one batch, the batch fails for one key's
//!   error, and the other key's claim is answered 503 (3 steps).
//! - Slot by count, then insert: two claimed requests both count no live slot, both insert
//!   it, and both forward under live slot leases (7 steps).
//! - Slot release without the fence: a holder's slot lease ends, another request takes the
//!   slot, the first one's release deletes it, and a third request takes it again while the
//!   second still forwards (13 steps).
//!
//! # Bounds and cost
//!
//! Two instances, four tries, and at most one each of a crash, a store fault, an operator
//! delete and a `ttl` expiry, leases ending at will: 1,407,226 states, 268,431 distinct, 19
//! steps deep, about 9 s in a debug build on one core (the liveness check runs two steps
//! from some states: about a second of it). Three instances at once with three tries and
//! the same faults: 502,467 states, 80,862 distinct, 15 deep, about 3 s. The two-key model
//! ([`scope`]: two instances, two tries per key, one crash, one store fault, key and slot
//! leases ending at will): 562,261 states, 144,234 distinct, 29 deep, about 4 s. The broken
//! variants and the coverage checks stop at their first finding, in well under a second
//! each, but the unfenced slot release (13 steps: about 3 s). The whole file runs in about
//! 20 s on a quiet core (30 s with the machine busy). States are kept small by naming tokens and executions by order of appearance,
//! sorting instances, and dropping past lives no attempt works for.
//!
//! # Not modelled
//!
//! The replay cache, fingerprint mismatches, statuses in `retry_statuses`, connect failures
//! (they release even under `hold`), responses too large to store, `on_store_error:
//! pass_through`, `mode: observe`, and the time bounds of guarantee 5. Liveness only as
//! above (a dead holder's key, one claim after its lease), not that every client eventually
//! gets an answer. In the two-key model: no timeouts or `hold`, no delete, `ttl` or GC, a
//! batch of two keys at most, slot limits of 1 only (not routes of different limits sharing
//! a scope), and no local queues in front of the store; batches and slots are not in the
//! one-key model's bounds, so the two models are never checked together.

use stateright::{Model, Property};

use crate::decisions::{self as table, After, Before, Decision, Op};

mod scope;

/// A lease token. Only equality between tokens means anything, so tokens are renumbered in
/// every state (see [`State::canonical`]); a claim draws one no one holds, as
/// `gen_random_uuid()` does.
type Token = u8;
/// An upstream execution; like tokens, only equality matters and they are renumbered.
type Exec = u8;
/// A life of the key (see [`Life`]), as an index into [`State::lives`].
type LifeId = u8;

fn bit(n: u8) -> u16 {
    1 << n
}

fn bits(mask: u16) -> impl Iterator<Item = u8> {
    (0..16).filter(move |&b| mask & bit(b) != 0)
}

/// Where an instance with crashes left to spend may crash, as `work_done`: before its work
/// (`false`), and, while it forwards, also after the upstream did it (`true`). Both models
/// crash their instances at these points.
fn crash_points(forwarding: bool) -> impl Iterator<Item = bool> {
    [false].into_iter().chain(forwarding.then_some(true))
}

/// `on_unknown_outcome` of the route the key belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Mode {
    Reforward,
    Hold,
}

/// A deliberately broken variant of the protocol: the checker must find a counterexample to
/// the property it names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Bug {
    /// The claim reads the row in one statement and writes it in another, whatever the row
    /// holds by then (never two forwards under live leases; a second execution follows a
    /// counted takeover).
    CheckThenInsert,
    /// FINISH_SQL without `lease_token = $3`: any in-flight row is completed (a fenced write
    /// after a takeover changes nothing).
    UnfencedFinish,
    /// The client gets the upstream's answer before the completion is written (every 2xx of
    /// a life names the same execution).
    AnswerBeforeCommit,
    /// RELEASE_SQL without `lease_token = $3`: a stale attempt deletes its successor's row
    /// (never two forwards under live leases).
    UnfencedRelease,
    /// Under `hold`, an expired lease is taken over like under `reforward` (a held route
    /// never executes twice).
    HoldTakesOver,
    /// DELETE_SQL deletes a row in flight under a live lease without `force`, uncounted
    /// (never two forwards under live leases, but for a counted forced delete).
    DeleteIgnoresLease,
    /// The completion marks the row completed in one write and stores the response in a
    /// second one (a completed row holds its response).
    CompleteInTwoWrites,
    /// CLAIM_SQL takes an in-flight row over only once its `ttl` passed, never when its lease
    /// ended: a key whose holder died answers 409 until then (a dead holder's key is taken
    /// over after its lease).
    LeaseNeverEnds,
}

/// The row's `state` column.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum RowState {
    InFlight,
    Completed,
    Unknown,
}

/// What a finished row holds as its response (status, headers, body), and, as a ghost the
/// real row does not keep, the lease under which that execution was forwarded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Response {
    exec: Exec,
    forwarded_under: Token,
}

/// The one row of `idemgate_keys` for the modelled (scope, key).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Row {
    state: RowState,
    /// `lease_token` of the claim that made this version of the row. FINISH_SQL sets the
    /// column to NULL when it writes an outcome; its fence also asks `state = 'in_flight'`,
    /// so keeping the token here changes no fenced write, and lets a property name the
    /// holder.
    token: Token,
    response: Option<Response>,
    attempts: u8,
    /// `expires_at <= now()`: the row's `ttl` has passed and GC has not deleted it yet.
    expired: bool,
}

/// The keyed request a gateway instance is working on, from its claim to its answer. A crash
/// drops it; the instance then takes new requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Phase {
    Idle,
    /// Broken variant only: the claim's check is read, its insert not yet written.
    Checked {
        takeover: bool,
    },
    /// `Claim::Acquired`; the request is on its way to the upstream or there
    /// (`Claimed::run`, `Claimed::forward`).
    Forwarding {
        token: Token,
        life: LifeId,
    },
    /// A storable answer was read whole; `Claimed::record` is writing it. `failed`: a
    /// write failed already, so the record loop may try again or give up; `answered`: the
    /// client already has it (broken variant only).
    Answered {
        token: Token,
        life: LifeId,
        exec: Exec,
        failed: bool,
        answered: bool,
    },
    /// Broken variant only: the row says completed; its response is not written yet.
    HalfCompleted {
        token: Token,
        life: LifeId,
        exec: Exec,
    },
    /// The upstream timed out (504, counted): the outcome is unknown, and `finish` with
    /// `Outcome::Release` (`reforward`) or `Outcome::Unknown` (`hold`) is next.
    Unknown {
        token: Token,
        life: LifeId,
    },
}

impl Phase {
    fn token(&self) -> Option<Token> {
        match *self {
            Phase::Forwarding { token, .. }
            | Phase::Answered { token, .. }
            | Phase::HalfCompleted { token, .. }
            | Phase::Unknown { token, .. } => Some(token),
            Phase::Idle | Phase::Checked { .. } => None,
        }
    }

    fn life(&self) -> Option<LifeId> {
        match *self {
            Phase::Forwarding { life, .. }
            | Phase::Answered { life, .. }
            | Phase::HalfCompleted { life, .. }
            | Phase::Unknown { life, .. } => Some(life),
            Phase::Idle | Phase::Checked { .. } => None,
        }
    }

    fn map(
        self,
        t: impl Fn(Token) -> Token,
        e: impl Fn(Exec) -> Exec,
        l: impl Fn(LifeId) -> LifeId,
    ) -> Phase {
        match self {
            Phase::Idle | Phase::Checked { .. } => self,
            Phase::Forwarding { token, life } => Phase::Forwarding {
                token: t(token),
                life: l(life),
            },
            Phase::Answered {
                token,
                life,
                exec,
                failed,
                answered,
            } => Phase::Answered {
                token: t(token),
                life: l(life),
                exec: e(exec),
                failed,
                answered,
            },
            Phase::HalfCompleted { token, life, exec } => Phase::HalfCompleted {
                token: t(token),
                life: l(life),
                exec: e(exec),
            },
            Phase::Unknown { token, life } => Phase::Unknown {
                token: t(token),
                life: l(life),
            },
        }
    }
}

/// One life of the key: from a claim of a key the store does not remember until an operator
/// deletes the row or its `ttl` passes. A request after that is a new request (README,
/// guarantee 2), so the properties speak of one life at a time.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Life {
    /// Upstream executions of requests claimed in this life.
    executions: u8,
    /// Claims that replaced an in-flight row whose lease had ended (what happened).
    takeovers: u8,
    /// Takeovers the gateway counted (`took_over`, derived from the row's `attempts`).
    counted_takeovers: u8,
    /// Upstream timeouts answered 504 and counted (`upstream_timeout`): unknown outcomes.
    counted_unknown: u8,
    /// The executions named by this life's 2xx answers (a bit each), except those given by
    /// attempts whose lease was taken over before they could record.
    answered: u16,
}

/// Events the coverage check must reach, so the properties are not true for want of trying.
mod seen {
    pub const REPLAY: u16 = 1;
    pub const TAKEOVER: u16 = 1 << 1;
    pub const DOUBLE: u16 = 1 << 2;
    pub const LEASE_LOST: u16 = 1 << 3;
    pub const LEASE_LOST_ANSWER: u16 = 1 << 4;
    pub const HELD: u16 = 1 << 5;
    pub const DELETE_REFUSED: u16 = 1 << 6;
    pub const FORCED_DELETE: u16 = 1 << 7;
    pub const FORGOTTEN: u16 = 1 << 8;
    pub const AGAIN: u16 = 1 << 9;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct State {
    mode: Mode,
    /// Tries the clients have yet to send.
    tries: u8,
    gateways: Vec<Phase>,
    row: Option<Row>,
    /// Leases whose end has not passed in database time (a bit per token).
    live: u16,
    /// Tokens whose row another claim took over.
    taken_over: u16,
    /// Tokens whose row an operator deleted, forced, under their live lease.
    force_deleted: u16,
    next_token: Token,
    next_exec: Exec,
    /// The current life is the last one; earlier ones stay while an attempt still works for
    /// them.
    lives: Vec<Life>,
    crashes: u8,
    store_faults: u8,
    deletes: u8,
    ttl_expiries: u8,
    /// Coverage check only (see [`seen`]).
    seen: u16,
}

impl State {
    fn life(&self) -> LifeId {
        (self.lives.len() - 1) as LifeId
    }

    fn lease_live(&self, token: Token) -> bool {
        self.live & bit(token) != 0
    }

    fn execute(&mut self, life: LifeId) -> Exec {
        let exec = self.next_exec;
        self.next_exec += 1;
        let l = &mut self.lives[life as usize];
        l.executions += 1;
        if l.executions > 1 {
            self.seen |= seen::DOUBLE;
        }
        if self.seen & seen::FORGOTTEN != 0 && life == self.life() {
            self.seen |= seen::AGAIN;
        }
        exec
    }

    /// A client gets a 2xx naming `exec`. `excused`: the attempt answering lost its lease to
    /// a takeover before it could record (docs/contract.md §2.6: it still answers with what
    /// the upstream said; the takeover was counted).
    fn answer(&mut self, life: LifeId, exec: Exec, excused: bool) {
        if excused {
            self.seen |= seen::LEASE_LOST_ANSWER;
        } else {
            self.lives[life as usize].answered |= bit(exec);
        }
    }

    /// One canonical state for situations that differ only in what cannot matter any more,
    /// or in names: instances are interchangeable, tokens and executions are compared only
    /// for equality, and a past life no attempt works for can no longer change.
    fn canonical(mut self, model: &Protocol) -> State {
        // What no one can use any more: the liveness of a lease neither the row nor an
        // attempt holds, and marks of tokens no attempt holds.
        let held = self
            .gateways
            .iter()
            .filter_map(Phase::token)
            .fold(0u16, |m, t| m | bit(t));
        let in_row = match &self.row {
            Some(r) if r.state == RowState::InFlight => bit(r.token),
            _ => 0,
        };
        self.live &= held | in_row;
        self.taken_over &= held;
        self.force_deleted &= held;
        self.gateways.sort();

        // Names, in order of appearance.
        let mut tokens = Renumber::default();
        let mut execs = Renumber::default();
        if let Some(r) = &self.row {
            tokens.see(r.token);
            if let Some(resp) = r.response {
                tokens.see(resp.forwarded_under);
                execs.see(resp.exec);
            }
        }
        for p in &self.gateways {
            if let Some(t) = p.token() {
                tokens.see(t);
            }
            if let Phase::Answered { exec, .. } | Phase::HalfCompleted { exec, .. } = *p {
                execs.see(exec);
            }
        }
        // Past lives no attempt works for, unless they already break a property (so the
        // checker still sees it).
        let working = self
            .gateways
            .iter()
            .filter_map(Phase::life)
            .fold(0u16, |m, l| m | bit(l));
        let current = self.life();
        let mut lives = Renumber::default();
        let mut kept = Vec::new();
        for (i, l) in self.lives.iter().enumerate() {
            let i = i as LifeId;
            if i == current || working & bit(i) != 0 || !life_holds(model, self.mode, l) {
                lives.see(i);
                kept.push(l.clone());
            }
        }
        // A kept life's answers still count; a dropped one's are forgotten with it.
        for l in &kept {
            for e in bits(l.answered) {
                execs.see(e);
            }
        }
        // The current life is last and stays last: kept lives keep their order.
        for l in &mut kept {
            l.answered = bits(l.answered).fold(0, |m, e| m | bit(execs.get(e)));
        }
        self.lives = kept;
        if let Some(r) = &mut self.row {
            r.token = tokens.get(r.token);
            if let Some(resp) = &mut r.response {
                resp.forwarded_under = tokens.get(resp.forwarded_under);
                resp.exec = execs.get(resp.exec);
            }
        }
        for p in &mut self.gateways {
            *p = p.map(|t| tokens.get(t), |e| execs.get(e), |l| lives.get(l));
        }
        self.live = bits(self.live).fold(0, |m, t| m | bit(tokens.get(t)));
        self.taken_over = bits(self.taken_over).fold(0, |m, t| m | bit(tokens.get(t)));
        self.force_deleted = bits(self.force_deleted).fold(0, |m, t| m | bit(tokens.get(t)));
        self.next_token = tokens.next;
        self.next_exec = execs.next;
        self
    }
}

/// Names things in the order they are first seen.
#[derive(Default)]
struct Renumber {
    names: [Option<u8>; 16],
    next: u8,
}

impl Renumber {
    fn see(&mut self, old: u8) {
        if self.names[old as usize].is_none() {
            self.names[old as usize] = Some(self.next);
            self.next += 1;
        }
    }

    fn get(&self, old: u8) -> u8 {
        self.names[old as usize].expect("every name in use was seen")
    }
}

/// What CLAIM_SQL finds, before it writes.
enum Found {
    /// No row, a row whose `ttl` passed, or (`takeover`) an in-flight row whose lease ended.
    Claimable {
        takeover: bool,
    },
    Completed(Option<Response>),
    InFlight,
    Held,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Upstream {
    /// It executed and answered with a storable status.
    Answers,
    /// It executed, but its answer did not come back in time.
    TimesOutAfterWork,
    /// It never got to the work before the timeout.
    TimesOutBeforeWork,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// A client's try reaches an idle instance, which runs CLAIM_SQL (or, broken, its read).
    Claim { gateway: u8 },
    /// The store does not answer the claim: 503. `applied`: it committed all the same.
    ClaimFails { gateway: u8, applied: bool },
    /// Broken variant only: the claim's separate write.
    Insert { gateway: u8 },
    /// What the upstream did with the forwarded request.
    Upstream { gateway: u8, outcome: Upstream },
    /// FINISH_SQL (completed, or unknown) or RELEASE_SQL, fenced by the lease token.
    Finish { gateway: u8 },
    /// The store does not answer that write. `applied`: it committed all the same.
    FinishFails { gateway: u8, applied: bool },
    /// `Claimed::record` stops trying: 503 to the client.
    GiveUp { gateway: u8 },
    /// The instance dies. `work_done`: the upstream executed what it had been sent.
    Crash { gateway: u8, work_done: bool },
    /// The database clock passes this lease's `lease_expires_at`.
    LeaseExpires { token: Token },
    /// The database clock passes the row's `expires_at`.
    TtlExpires,
    /// GC_SQL deletes the expired row.
    Gc,
    /// DELETE_SQL (`idemgate keys delete`, `DELETE /v1/keys`), forced or not.
    Delete { force: bool },
}

/// The protocol for one key, within bounds: how many tries, instances and faults.
#[derive(Clone, Debug)]
struct Protocol {
    /// Tries of all clients together (a try is a try, whoever sends it).
    tries: u8,
    gateways: u8,
    crashes: u8,
    store_faults: u8,
    deletes: u8,
    ttl_expiries: u8,
    bug: Option<Bug>,
    /// Check reachability (the `sometimes` properties) instead of the invariants.
    coverage: bool,
    /// Hold the protocol to the README's words without the two exceptions docs/contract.md §2
    /// makes: an attempt that lost its lease still answers with what the upstream said, and an
    /// unknown outcome is released under `reforward`.
    literal: bool,
}

impl Protocol {
    /// The row as the decision table (`decisions.rs`) names it.
    fn before(s: &State) -> Before {
        match &s.row {
            None => Before::Absent,
            Some(r) => match r.state {
                RowState::InFlight if r.expired => Before::InFlightTtlPassed,
                RowState::InFlight if s.lease_live(r.token) => Before::InFlight,
                RowState::InFlight => Before::InFlightExpired,
                _ if r.expired => Before::Expired,
                RowState::Completed => Before::Completed,
                RowState::Unknown => Before::Unknown,
            },
        }
    }

    /// The decision table's answer, or a broken variant's.
    fn decide(&self, before: Before, op: Op) -> (Decision, After) {
        let in_flight = matches!(
            before,
            Before::InFlight | Before::InFlightExpired | Before::InFlightTtlPassed
        );
        match (self.bug, op) {
            (Some(Bug::UnfencedRelease), Op::Release(_)) if in_flight => {
                (Decision::Wrote, After::Absent)
            }
            (
                Some(Bug::HoldTakesOver),
                Op::Claim {
                    same_request: true,
                    holds: true,
                },
            ) if before == Before::InFlightExpired => {
                (Decision::Acquired { took_over: true }, After::Claimed)
            }
            (Some(Bug::DeleteIgnoresLease), Op::Delete { force: false })
                if before == Before::InFlight =>
            {
                (Decision::Deleted { live_lease: false }, After::Absent)
            }
            (Some(Bug::LeaseNeverEnds), Op::Claim { .. }) if before == Before::InFlightExpired => {
                (Decision::InFlight, After::Same)
            }
            _ => table::decide(before, op),
        }
    }

    /// What CLAIM_SQL finds, as the decision table decides it (every request of the model
    /// has the same fingerprint).
    fn found(&self, s: &State) -> Found {
        let claim = Op::Claim {
            same_request: true,
            holds: s.mode == Mode::Hold,
        };
        match self.decide(Self::before(s), claim).0 {
            Decision::Acquired { took_over } => Found::Claimable {
                takeover: took_over,
            },
            Decision::Replay => Found::Completed(s.row.as_ref().and_then(|r| r.response)),
            Decision::InFlight => Found::InFlight,
            Decision::Held => Found::Held,
            other => unreachable!("one fingerprint, no oversized answer: {other:?}"),
        }
    }

    /// The write of CLAIM_SQL: a fresh row, or the row taken over, with a new token and a
    /// new lease. `takeover`: what the claim decided from what it read (the same statement,
    /// except in the broken check-then-insert).
    fn acquire(&self, n: &mut State, gateway: usize, takeover: bool) {
        let token = n.next_token;
        n.next_token += 1;
        let life = n.life();
        // What the write replaces (in the broken variant, not always what was read).
        if let Some(r) = &n.row
            && r.state == RowState::InFlight
            && !r.expired
            && !n.lease_live(r.token)
        {
            n.taken_over |= bit(r.token);
            n.lives[life as usize].takeovers += 1;
            n.seen |= seen::TAKEOVER;
        }
        // `attempts = CASE WHEN k.state = 'in_flight' AND k.expires_at > now() THEN
        // k.attempts + 1 ELSE 1 END`, on the row the claim acts on.
        let attempts = match &n.row {
            Some(r) if takeover && r.state == RowState::InFlight && !r.expired => r.attempts + 1,
            _ => 1,
        };
        n.row = Some(Row {
            state: RowState::InFlight,
            token,
            response: None,
            attempts,
            expired: false,
        });
        n.live |= bit(token);
        // `PgStore::claim_once`: `took_over: attempts > 1`, which `KeyedRequest::work` counts.
        if attempts > 1 {
            n.lives[life as usize].counted_takeovers += 1;
        }
        n.gateways[gateway] = Phase::Forwarding { token, life };
    }

    /// Whether the end `end` of the attempt holding `token` writes, as the decision table
    /// decides it (a token that is not the row's latest is stale); unfenced, any in-flight
    /// row.
    fn fence_holds(
        &self,
        s: &State,
        token: Token,
        fenced: bool,
        end: fn(table::Token) -> Op,
    ) -> bool {
        let Some(r) = &s.row else {
            return false;
        };
        if !fenced {
            return r.state == RowState::InFlight;
        }
        let whose = if r.token == token {
            table::Token::Current
        } else {
            table::Token::Stale
        };
        self.decide(Self::before(s), end(whose)).0 == Decision::Wrote
    }

    /// FINISH_SQL with a completed response, if the fence holds; whether it wrote.
    fn complete(&self, n: &mut State, token: Token, exec: Exec) -> bool {
        let fenced = self.bug != Some(Bug::UnfencedFinish);
        if !self.fence_holds(n, token, fenced, Op::Complete) {
            return false;
        }
        let r = n.row.as_mut().expect("the fence found the row");
        r.state = RowState::Completed;
        r.response = Some(Response {
            exec,
            forwarded_under: token,
        });
        r.expired = false;
        true
    }

    /// A new life starts: the store forgot the key.
    fn forget(&self, n: &mut State) {
        n.lives.push(Life::default());
        n.seen |= seen::FORGOTTEN;
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        [Mode::Reforward, Mode::Hold]
            .into_iter()
            .map(|mode| State {
                mode,
                tries: self.tries,
                gateways: vec![Phase::Idle; self.gateways as usize],
                row: None,
                live: 0,
                taken_over: 0,
                force_deleted: 0,
                next_token: 0,
                next_exec: 0,
                lives: vec![Life::default()],
                crashes: self.crashes,
                store_faults: self.store_faults,
                deletes: self.deletes,
                ttl_expiries: self.ttl_expiries,
                seen: 0,
            })
            .collect()
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let fault = s.store_faults > 0;
        // Idle instances sort first and are interchangeable: a try goes to the first.
        if s.tries > 0 && s.gateways[0] == Phase::Idle {
            actions.push(Action::Claim { gateway: 0 });
            if fault {
                for applied in [false, true] {
                    actions.push(Action::ClaimFails {
                        gateway: 0,
                        applied,
                    });
                }
            }
        }
        for (g, phase) in s.gateways.iter().enumerate() {
            let gateway = g as u8;
            match phase {
                Phase::Idle => continue,
                Phase::Checked { .. } => actions.push(Action::Insert { gateway }),
                Phase::Forwarding { .. } => {
                    for outcome in [
                        Upstream::Answers,
                        Upstream::TimesOutAfterWork,
                        Upstream::TimesOutBeforeWork,
                    ] {
                        actions.push(Action::Upstream { gateway, outcome });
                    }
                }
                Phase::Answered { failed, .. } => {
                    actions.push(Action::Finish { gateway });
                    if fault {
                        for applied in [false, true] {
                            actions.push(Action::FinishFails { gateway, applied });
                        }
                    }
                    if *failed {
                        actions.push(Action::GiveUp { gateway });
                    }
                }
                Phase::HalfCompleted { .. } => actions.push(Action::Finish { gateway }),
                Phase::Unknown { .. } => {
                    actions.push(Action::Finish { gateway });
                    if fault {
                        actions.push(Action::FinishFails {
                            gateway,
                            applied: false,
                        });
                    }
                }
            }
            if s.crashes > 0 {
                let forwarding = matches!(phase, Phase::Forwarding { .. });
                actions.extend(
                    crash_points(forwarding).map(|work_done| Action::Crash { gateway, work_done }),
                );
            }
        }
        for token in bits(s.live) {
            actions.push(Action::LeaseExpires { token });
        }
        if let Some(r) = &s.row {
            // `lease` is checked at load to be no longer than `ttl`: a row's ttl never passes
            // before its lease has ended.
            let live = r.state == RowState::InFlight && s.lease_live(r.token);
            if s.ttl_expiries > 0 && !r.expired && !live {
                actions.push(Action::TtlExpires);
            }
            if r.expired {
                actions.push(Action::Gc);
            }
            if s.deletes > 0 {
                for force in [false, true] {
                    actions.push(Action::Delete { force });
                }
            }
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Claim { gateway } => {
                let g = gateway as usize;
                n.tries -= 1;
                match self.found(s) {
                    Found::Claimable { takeover } => {
                        if self.bug == Some(Bug::CheckThenInsert) {
                            n.gateways[g] = Phase::Checked { takeover };
                        } else {
                            self.acquire(&mut n, g, takeover);
                        }
                    }
                    // A replay (`Claim::Completed`).
                    Found::Completed(Some(r)) => {
                        let life = n.life();
                        n.answer(life, r.exec, false);
                        n.seen |= seen::REPLAY;
                    }
                    // A completed row without its response: 503 (`StoreError::Corrupt`).
                    Found::Completed(None) => {}
                    // 409 `in-flight`; a waiter is a try that looks again later.
                    Found::InFlight => {}
                    // 502 `outcome-unknown`.
                    Found::Held => n.seen |= seen::HELD,
                }
            }
            Action::ClaimFails { gateway, applied } => {
                n.tries -= 1;
                n.store_faults -= 1;
                if applied && let Found::Claimable { takeover } = self.found(s) {
                    // Claimed under a token no one holds; the client gets 503.
                    self.acquire(&mut n, gateway as usize, takeover);
                    n.gateways[gateway as usize] = Phase::Idle;
                }
            }
            Action::Insert { gateway } => {
                let g = gateway as usize;
                let Phase::Checked { takeover } = s.gateways[g] else {
                    unreachable!("an insert follows its check")
                };
                self.acquire(&mut n, g, takeover);
            }
            Action::Upstream { gateway, outcome } => {
                let g = gateway as usize;
                let Phase::Forwarding { token, life } = s.gateways[g] else {
                    unreachable!("the upstream answers a forward")
                };
                match outcome {
                    Upstream::Answers => {
                        let exec = n.execute(life);
                        let answered = self.bug == Some(Bug::AnswerBeforeCommit);
                        if answered {
                            n.answer(life, exec, false);
                        }
                        n.gateways[g] = Phase::Answered {
                            token,
                            life,
                            exec,
                            failed: false,
                            answered,
                        };
                    }
                    Upstream::TimesOutAfterWork | Upstream::TimesOutBeforeWork => {
                        if outcome == Upstream::TimesOutAfterWork {
                            n.execute(life);
                        }
                        n.lives[life as usize].counted_unknown += 1;
                        n.gateways[g] = Phase::Unknown { token, life };
                    }
                }
            }
            Action::Finish { gateway } => {
                let g = gateway as usize;
                n.gateways[g] = Phase::Idle;
                match s.gateways[g] {
                    Phase::Answered {
                        token,
                        life,
                        exec,
                        answered,
                        ..
                    } => {
                        if self.bug == Some(Bug::CompleteInTwoWrites)
                            && self.fence_holds(s, token, true, Op::Complete)
                        {
                            let r = n.row.as_mut().expect("the fence found the row");
                            r.state = RowState::Completed;
                            r.expired = false;
                            n.gateways[g] = Phase::HalfCompleted { token, life, exec };
                            return Some(n.canonical(self));
                        }
                        let written = self.complete(&mut n, token, exec);
                        if !written {
                            // `Claimed::finish`: the lease was lost, counted and logged;
                            // the client still gets what the upstream said.
                            n.seen |= seen::LEASE_LOST;
                        }
                        if !answered {
                            let excused =
                                !self.literal && !written && s.taken_over & bit(token) != 0;
                            n.answer(life, exec, excused);
                        }
                    }
                    Phase::HalfCompleted { token, life, exec } => {
                        if let Some(r) = n.row.as_mut() {
                            r.response = Some(Response {
                                exec,
                                forwarded_under: token,
                            });
                        }
                        n.answer(life, exec, false);
                    }
                    Phase::Unknown { token, .. } => {
                        let end = match s.mode {
                            Mode::Reforward => Op::Release,
                            Mode::Hold => Op::Hold,
                        };
                        if self.fence_holds(s, token, true, end) {
                            match s.mode {
                                // RELEASE_SQL: the row is deleted; a retry forwards again.
                                Mode::Reforward => n.row = None,
                                // FINISH_SQL with 'unknown': retries get 502 from now on.
                                Mode::Hold => {
                                    let r = n.row.as_mut().expect("the fence found the row");
                                    r.state = RowState::Unknown;
                                    r.expired = false;
                                }
                            }
                        } else {
                            n.seen |= seen::LEASE_LOST;
                        }
                    }
                    Phase::Idle | Phase::Checked { .. } | Phase::Forwarding { .. } => {
                        unreachable!("only an attempt with an outcome finishes")
                    }
                }
            }
            Action::FinishFails { gateway, applied } => {
                let g = gateway as usize;
                n.store_faults -= 1;
                match s.gateways[g] {
                    Phase::Answered {
                        token,
                        life,
                        exec,
                        answered,
                        ..
                    } => {
                        if applied {
                            self.complete(&mut n, token, exec);
                        }
                        n.gateways[g] = Phase::Answered {
                            token,
                            life,
                            exec,
                            failed: true,
                            answered,
                        };
                    }
                    // Not written, logged, not tried again: the key stays in flight until
                    // its lease ends.
                    Phase::Unknown { .. } => n.gateways[g] = Phase::Idle,
                    _ => unreachable!("only an attempt with an outcome finishes"),
                }
            }
            Action::GiveUp { gateway } => n.gateways[gateway as usize] = Phase::Idle,
            Action::Crash { gateway, work_done } => {
                let g = gateway as usize;
                n.crashes -= 1;
                if work_done {
                    let Phase::Forwarding { life, .. } = s.gateways[g] else {
                        unreachable!("only a forwarded request is worked on")
                    };
                    n.execute(life);
                }
                n.gateways[g] = Phase::Idle;
            }
            Action::LeaseExpires { token } => n.live &= !bit(token),
            Action::TtlExpires => {
                n.ttl_expiries -= 1;
                n.row.as_mut().expect("a row to expire").expired = true;
                self.forget(&mut n);
            }
            Action::Gc => n.row = None,
            Action::Delete { force } => {
                n.deletes -= 1;
                let r = s.row.as_ref().expect("a row to delete");
                match self.decide(Self::before(s), Op::Delete { force }).0 {
                    // `Deleted::InFlight`: 409 `key-in-flight`, nothing changes.
                    Decision::Refused => n.seen |= seen::DELETE_REFUSED,
                    Decision::Deleted { live_lease } => {
                        if live_lease {
                            // Counted `force_deleted`: a possible double.
                            n.force_deleted |= bit(r.token);
                            n.seen |= seen::FORCED_DELETE;
                        }
                        if !r.expired {
                            self.forget(&mut n);
                        }
                        n.row = None;
                    }
                    other => unreachable!("a delete of a row that exists: {other:?}"),
                }
            }
        }
        if !self.coverage {
            n.seen = 0;
        }
        Some(n.canonical(self))
    }

    fn properties(&self) -> Vec<Property<Self>> {
        if !self.coverage {
            return vec![
                Property::always(ONE_LIVE_FORWARD, one_live_forward),
                Property::always(ONE_ANSWER, one_answer_per_life),
                Property::always(COMPLETED_HOLDS_RESPONSE, completed_holds_response),
                Property::always(FENCED_WRITE_CHANGES_NOTHING, fenced_write_changes_nothing),
                Property::always(DOUBLES_COUNTED, doubles_counted),
                Property::always(DEAD_HOLDER_TAKEN_OVER, dead_holders_key_is_taken_over),
            ];
        }
        vec![
            Property::sometimes("a replay is answered", |_, s: &State| {
                s.seen & seen::REPLAY != 0
            }),
            Property::sometimes("an expired lease is taken over", |_, s: &State| {
                s.seen & seen::TAKEOVER != 0
            }),
            Property::sometimes("a key is executed twice in one life", |_, s: &State| {
                s.seen & seen::DOUBLE != 0
            }),
            Property::sometimes("a fenced write finds its lease lost", |_, s: &State| {
                s.seen & seen::LEASE_LOST != 0
            }),
            Property::sometimes("an attempt that lost its lease answers", |_, s: &State| {
                s.seen & seen::LEASE_LOST_ANSWER != 0
            }),
            Property::sometimes("a held key answers outcome-unknown", |_, s: &State| {
                s.seen & seen::HELD != 0
            }),
            Property::sometimes("a delete under a live lease is refused", |_, s: &State| {
                s.seen & seen::DELETE_REFUSED != 0
            }),
            Property::sometimes(
                "a forced delete removes a row under a live lease",
                |_, s: &State| s.seen & seen::FORCED_DELETE != 0,
            ),
            Property::sometimes("a forgotten key is executed again", |_, s: &State| {
                s.seen & seen::AGAIN != 0
            }),
        ]
    }
}

const ONE_LIVE_FORWARD: &str = "never two forwards in progress under live leases";
const ONE_ANSWER: &str = "every 2xx of a life names one execution";
const COMPLETED_HOLDS_RESPONSE: &str = "a completed row holds its response";
const FENCED_WRITE_CHANGES_NOTHING: &str = "a fenced write after a takeover changes nothing";
const DOUBLES_COUNTED: &str = "a second execution follows a counted takeover or unknown outcome";
const DEAD_HOLDER_TAKEN_OVER: &str =
    "a key whose holder died is taken over after its lease (held under hold)";

/// Forwards in progress under a live lease whose row was not deleted by force: at most one.
fn one_live_forward(_: &Protocol, s: &State) -> bool {
    let live_forwards = s
        .gateways
        .iter()
        .filter(|p| match **p {
            Phase::Forwarding { token, .. } => {
                s.lease_live(token) && s.force_deleted & bit(token) == 0
            }
            _ => false,
        })
        .count();
    live_forwards <= 1
}

/// Liveness, as a check from every state: where the row is in flight (its `ttl` not passed)
/// and no attempt holds its token (the holder crashed, gave up its write, or its claim
/// committed unanswered), the lease's end followed by a new try on an idle instance takes
/// the key over under `reforward` (the new attempt forwards under a live lease), and answers
/// 502 `outcome-unknown` under `hold`: never 409 `in-flight` until the `ttl`. It runs the
/// model's own steps (`LeaseExpires`, then `Claim`, and the broken check-then-insert's
/// `Insert`), so a claim that never takes a dead holder's row over breaks it.
fn dead_holders_key_is_taken_over(model: &Protocol, s: &State) -> bool {
    let Some(r) = &s.row else {
        return true;
    };
    if r.state != RowState::InFlight
        || r.expired
        || s.gateways.iter().any(|p| p.token() == Some(r.token))
    {
        return true;
    }
    let token = r.token;
    // The lease ends; a client's new try reaches an instance of its own.
    let Some(mut t) = model.next_state(s, Action::LeaseExpires { token }) else {
        return false;
    };
    t.tries += 1;
    t.gateways.insert(0, Phase::Idle);
    if s.mode == Mode::Hold {
        return matches!(model.found(&t), Found::Held);
    }
    let Some(mut n) = model.next_state(&t, Action::Claim { gateway: 0 }) else {
        return false;
    };
    if let Some(g) = n
        .gateways
        .iter()
        .position(|p| matches!(p, Phase::Checked { .. }))
    {
        match model.next_state(&n, Action::Insert { gateway: g as u8 }) {
            Some(inserted) => n = inserted,
            None => return false,
        }
    }
    n.row.as_ref().is_some_and(|r| {
        r.state == RowState::InFlight
            && n.lease_live(r.token)
            && n.gateways
                .iter()
                .any(|p| matches!(*p, Phase::Forwarding { token, .. } if token == r.token))
    })
}

/// In each life, the 2xx answers (but the excused) name one execution.
fn one_answer_per_life(_: &Protocol, s: &State) -> bool {
    s.lives.iter().all(answers_once)
}

/// A completed row has its response.
fn completed_holds_response(_: &Protocol, s: &State) -> bool {
    match &s.row {
        Some(r) if r.state == RowState::Completed => r.response.is_some(),
        _ => true,
    }
}

/// A row's response answers the attempt that claimed the row.
fn fenced_write_changes_nothing(_: &Protocol, s: &State) -> bool {
    match &s.row {
        Some(Row {
            token,
            response: Some(resp),
            ..
        }) => resp.forwarded_under == *token,
        _ => true,
    }
}

/// In each life, every takeover is counted and every execution after the first is counted.
fn doubles_counted(model: &Protocol, s: &State) -> bool {
    s.lives.iter().all(|l| counts_doubles(model, s.mode, l))
}

/// Every 2xx answer of the life (but those excused) names the same execution.
fn answers_once(l: &Life) -> bool {
    l.answered.count_ones() <= 1
}

/// Every takeover is counted, and a second execution follows a counted takeover or unknown
/// outcome; none at all when the route holds unknown outcomes.
fn counts_doubles(model: &Protocol, mode: Mode, l: &Life) -> bool {
    let unknown = if model.literal { 0 } else { l.counted_unknown };
    l.takeovers == l.counted_takeovers
        && l.executions <= 1 + l.counted_takeovers + unknown
        && (mode == Mode::Reforward || l.executions <= 1)
}

/// A past life can be dropped once no attempt works for it, unless it already breaks a
/// property (then the checker must still see it).
fn life_holds(model: &Protocol, mode: Mode, l: &Life) -> bool {
    answers_once(l) && counts_doubles(model, mode, l)
}

mod tests {
    use std::time::Instant;

    use stateright::{Checker, HasDiscoveries};

    use super::*;

    /// Two instances, four tries, and one of each fault.
    const FAULTS: Protocol = Protocol {
        tries: 4,
        gateways: 2,
        crashes: 1,
        store_faults: 1,
        deletes: 1,
        ttl_expiries: 1,
        bug: None,
        coverage: false,
        literal: false,
    };

    /// Three instances working on the key at once, three tries, and one of each fault.
    const CROWD: Protocol = Protocol {
        tries: 3,
        gateways: 3,
        ..FAULTS
    };

    fn check_all(protocol: Protocol, name: &str) {
        let started = Instant::now();
        let checker = protocol.checker().spawn_bfs().join();
        eprintln!(
            "{name}: {} states, {} unique, depth {}, {:.1?}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
    }

    /// The shortest run of `model` that breaks `property`, if there is one within 30 steps:
    /// checked to a growing depth, so the first run that breaks it is a shortest one. `label`
    /// names the variant in the report.
    fn shortest_counterexample<M>(
        model: M,
        property: &'static str,
        label: String,
    ) -> Option<Vec<M::Action>>
    where
        M: Model + Clone + Send + Sync + 'static,
        M::State: Clone + PartialEq + std::hash::Hash + Send + Sync + 'static,
        M::Action: Clone + std::fmt::Debug + PartialEq,
    {
        let started = Instant::now();
        let mut states = 0;
        for depth in 2..=31 {
            let checker = model
                .clone()
                .checker()
                .target_max_depth(depth)
                .finish_when(HasDiscoveries::AnyOf([property].into()))
                .spawn_bfs()
                .join();
            states += checker.unique_state_count();
            if let Some(path) = checker.discovery(property) {
                let actions = path.into_actions();
                eprintln!(
                    "{label} breaks \"{property}\" in {} steps ({states} states visited, {:.1?}): \
                     {actions:?}",
                    actions.len(),
                    started.elapsed()
                );
                return Some(actions);
            }
        }
        None
    }

    fn counterexample(protocol: Protocol, property: &'static str) -> Option<Vec<Action>> {
        let literal = if protocol.literal { " (literal)" } else { "" };
        let label = format!("{:?}{literal}", protocol.bug);
        shortest_counterexample(protocol, property, label)
    }

    fn broken(bug: Bug) -> Protocol {
        Protocol {
            bug: Some(bug),
            ..FAULTS
        }
    }

    #[test]
    fn the_protocol_keeps_every_property_under_every_fault() {
        check_all(FAULTS, "faults");
    }

    #[test]
    fn the_protocol_keeps_every_property_with_three_instances_at_once() {
        check_all(CROWD, "crowd");
    }

    #[test]
    fn every_situation_the_properties_speak_of_is_reached() {
        check_all(
            Protocol {
                coverage: true,
                ..FAULTS
            },
            "coverage",
        );
    }

    #[test]
    fn a_claim_by_check_then_insert_lets_two_forwards_run_under_live_leases() {
        assert!(counterexample(broken(Bug::CheckThenInsert), ONE_LIVE_FORWARD).is_some());
    }

    #[test]
    fn a_claim_by_check_then_insert_takes_a_row_over_without_counting_it() {
        assert!(counterexample(broken(Bug::CheckThenInsert), DOUBLES_COUNTED).is_some());
    }

    #[test]
    fn a_completion_without_the_fence_overwrites_the_successors_row() {
        let found = counterexample(broken(Bug::UnfencedFinish), FENCED_WRITE_CHANGES_NOTHING);
        assert!(found.is_some());
    }

    #[test]
    fn a_release_without_the_fence_lets_two_forwards_run_under_live_leases() {
        assert!(counterexample(broken(Bug::UnfencedRelease), ONE_LIVE_FORWARD).is_some());
    }

    #[test]
    fn a_held_route_that_takes_expired_leases_over_executes_twice() {
        assert!(counterexample(broken(Bug::HoldTakesOver), DOUBLES_COUNTED).is_some());
    }

    #[test]
    fn a_delete_that_ignores_a_live_lease_lets_two_forwards_run_uncounted() {
        assert!(counterexample(broken(Bug::DeleteIgnoresLease), ONE_LIVE_FORWARD).is_some());
    }

    #[test]
    fn a_claim_that_waits_for_the_ttl_leaves_a_dead_holders_key_in_flight() {
        let found = counterexample(broken(Bug::LeaseNeverEnds), DEAD_HOLDER_TAKEN_OVER);
        assert!(found.is_some());
    }

    #[test]
    fn answering_before_the_commit_lets_two_answers_of_a_life_differ() {
        assert!(counterexample(broken(Bug::AnswerBeforeCommit), ONE_ANSWER).is_some());
    }

    #[test]
    fn completing_in_two_writes_shows_a_completed_row_without_its_response() {
        let found = counterexample(broken(Bug::CompleteInTwoWrites), COMPLETED_HOLDS_RESPONSE);
        assert!(found.is_some());
    }

    /// Two keys of one scope, two instances, two tries per key, one crash and one store
    /// fault (a lone statement's or a batch's).
    const SCOPE: scope::Scope = scope::Scope {
        tries: 2,
        gateways: 2,
        crashes: 1,
        store_faults: 1,
        bug: None,
        coverage: false,
    };

    fn check_scope(model: scope::Scope, name: &str) {
        let started = Instant::now();
        let checker = model.checker().spawn_bfs().join();
        eprintln!(
            "{name}: {} states, {} unique, depth {}, {:.1?}",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            started.elapsed()
        );
        checker.assert_properties();
    }

    /// The shortest run of the two-key model that breaks `property` (see [`counterexample`]).
    /// Whether the two-key model with `bug` breaks `property`.
    fn scope_bug_found(bug: scope::Bug, property: &'static str) -> bool {
        let broken = scope::Scope {
            bug: Some(bug),
            ..SCOPE
        };
        scope_counterexample(broken, property).is_some()
    }

    fn scope_counterexample(
        model: scope::Scope,
        property: &'static str,
    ) -> Option<Vec<scope::Action>> {
        let label = format!("{:?}", model.bug);
        shortest_counterexample(model, property, label)
    }

    #[test]
    fn two_keys_keep_every_property_through_batches_and_a_serialize_slot() {
        check_scope(SCOPE, "scope");
    }

    #[test]
    fn every_situation_of_batches_and_slots_is_reached() {
        check_scope(
            scope::Scope {
                coverage: true,
                ..SCOPE
            },
            "scope coverage",
        );
    }

    #[test]
    fn a_batch_that_fails_every_key_for_one_keys_error_shares_its_fate() {
        assert!(scope_bug_found(
            scope::Bug::SharedFate,
            scope::NO_SHARED_FATE
        ));
    }

    #[test]
    fn a_slot_taken_by_count_then_insert_lets_two_forwards_of_a_scope_run() {
        assert!(scope_bug_found(
            scope::Bug::SlotByCountThenInsert,
            scope::ONE_FORWARD_PER_SCOPE
        ));
    }

    #[test]
    fn a_slot_release_without_the_fence_lets_two_forwards_of_a_scope_run() {
        assert!(scope_bug_found(
            scope::Bug::UnfencedSlotRelease,
            scope::ONE_FORWARD_PER_SCOPE
        ));
    }

    /// Guarantee 3 in so many words ("no client ever holds an answer that a retry would not
    /// get again") does not hold when a lease is taken over: docs/contract.md §2.6 has the
    /// first attempt answer with what its upstream said, while the store keeps its
    /// successor's answer.
    #[test]
    fn an_attempt_that_lost_its_lease_answers_what_a_retry_will_not_get() {
        let literal = Protocol {
            literal: true,
            ..FAULTS
        };
        assert!(counterexample(literal, ONE_ANSWER).is_some());
    }

    /// "Doubles only after a takeover" in so many words does not hold: under `reforward`, a
    /// timed-out attempt releases the key (docs/contract.md §2.6) and the next try executes
    /// again with no takeover; what counts it is the 504 `upstream_timeout`.
    #[test]
    fn a_released_unknown_outcome_executes_again_without_a_takeover() {
        let literal = Protocol {
            literal: true,
            ..FAULTS
        };
        assert!(counterexample(literal, DOUBLES_COUNTED).is_some());
    }
}
