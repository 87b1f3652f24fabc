//! Two keys of one scope, model-checked together: the store's batches (several keys' steps
//! in one statement and one commit) and a route's `serialize` slots (one forward at a time
//! per scope). A smaller configuration than the one-key model of the parent module, which
//! has every fault of one key; here only what two keys can do to each other.
//!
//! # What it stands for
//!
//! - Batches (`src/store/postgres/batch.rs`, `batched.rs`, `claim.rs`): a claim goes first to
//!   the queue of new keys (`Batches::claim_new`); a completion to the queue of completions
//!   (`Batches::finish`). Queued steps of different keys may go to the database together:
//!   `ClaimBatch` is CLAIM_NEW_BATCH_SQL (one insert, `ON CONFLICT DO NOTHING`: a key that
//!   exists is left to the full claim, alone), `FinishBatch` is FINISH_BATCH_CALL (one
//!   statement, each key fenced by its own token). Or a step runs alone (`ClaimAlone`, `Finish`): a batch
//!   of one, a key the batched insert found, or a key whose batch failed. Two steps of one key
//!   never share a batch (`one_per_key` sends the later one alone), so each runs alone here.
//!   The claim's decisions come from the decision table (`decisions.rs`), as in the parent
//!   model.
//! - A failed batch (`ClaimBatchFails`, `FinishBatchFails`): either a key's own error (a row
//!   locked past the statement timeout, say; the statement is rolled back, nothing of it took
//!   effect), or the commit's answer lost (`applied`: it committed all the same). `answer_all`
//!   then runs every key of the batch alone, with its own statement, and only a key that fails
//!   alone gets the error: the key at fault does (its error is its own; its lone run and
//!   its failure are one step here), the other key's step runs as if it had never been
//!   batched. A lone statement fails like the parent model's
//!   (`ClaimFails`, `FinishFails`, with `applied`), and `Claimed::record` may try a failed
//!   completion again (queued again) or give up (503).
//! - `serialize` with `max_in_flight: 1` (`src/serialize.rs`, `idemgate_take_slot`): after
//!   its claim, a request takes the scope's slot in one statement that counts the scope's
//!   live slots under a per-scope lock and inserts the slot row (slot 0, a new token, a
//!   lease), or is refused and waits; a wait that runs out releases the key (fenced) and
//!   answers 409. The slot is released after the outcome is recorded or given up
//!   (`Held::release`, fenced by the slot's token); a crashed holder's slot frees itself when
//!   its lease ends. A slot's lease, like a key's, ends by a step of its own at any moment.
//! - Two instances; each try names one of the two keys and goes to an idle instance, so both
//!   instances may work on one key, or one on each.
//!
//! # Properties
//!
//! Per key, as in the one-key model: never two forwards of a key under live leases; every
//! 2xx of a key names one execution (but an attempt that lost its lease to a counted
//! takeover); a row's response is the answer of the attempt that claimed the row (the fence);
//! every takeover is counted, and a second execution follows one. For the scope: never two
//! forwards of the scope under live slot leases. For batches: a key's step fails only for a
//! fault of its own (its own error, its own lone statement's failure), never because another
//! key of its batch failed.
//!
//! Not here: timeouts and `hold` (the upstream always answers), deletes, `ttl` and GC (one
//! life per key), batches of more than two keys, slot limits above 1 and routes of
//! different limits sharing a scope, failures of the slot statements and of the release
//! after a wait (they are written at once), the `last_start` bound on asking for a slot
//! (the model does not count on it), and the local queues in front of the store (they only
//! ever hold requests back).

use stateright::{Model, Property};

use super::{Life, Renumber, Response, Row, RowState, bit, bits, crash_points};
use crate::decisions::{self as table, Before, Decision, Op};

type Token = u8;
type Slot = u8;
type Exec = u8;
type Key = u8;

const KEYS: usize = 2;

/// A deliberately broken variant: the checker must find a counterexample to the property it
/// names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Bug {
    /// A batch statement that fails answers its error to every key in it, instead of running
    /// each alone (a key's step fails only for a fault of its own).
    SharedFate,
    /// The slot is taken by counting the scope's live slots, then inserting in a second
    /// statement, without the per-scope lock (never two forwards of the scope under live slot
    /// leases).
    SlotByCountThenInsert,
    /// SLOT_RELEASE_SQL without `token = $3`: a holder past its slot lease deletes the slot
    /// row of the request that took the slot after it (never two forwards of the scope under
    /// live slot leases).
    UnfencedSlotRelease,
}

/// The request an instance works on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Phase {
    Idle,
    /// The claim waits to be sent; `alone`: its batch failed (or found the key), it runs its
    /// own statement next.
    Claiming {
        key: Key,
        alone: bool,
    },
    /// `Claim::Acquired`: the request waits for the scope's slot.
    Claimed {
        key: Key,
        token: Token,
    },
    /// Broken variant only: the live slots were counted, the slot not yet written.
    SlotCounted {
        key: Key,
        token: Token,
    },
    /// Holds the slot; the request is on its way to the upstream or there.
    Forwarding {
        key: Key,
        token: Token,
        slot: Slot,
    },
    /// The upstream answered (`exec`); the completion waits to be sent. `alone`: as for a
    /// claim; `failed`: a write failed already (`Claimed::record` may give up).
    Finishing {
        key: Key,
        token: Token,
        slot: Slot,
        exec: Exec,
        alone: bool,
        failed: bool,
    },
    /// The outcome is recorded or given up: the slot is released next.
    Releasing {
        slot: Slot,
    },
}

impl Phase {
    fn token(self) -> Option<Token> {
        match self {
            Phase::Claimed { token, .. }
            | Phase::SlotCounted { token, .. }
            | Phase::Forwarding { token, .. }
            | Phase::Finishing { token, .. } => Some(token),
            Phase::Idle | Phase::Claiming { .. } | Phase::Releasing { .. } => None,
        }
    }

    fn slot(self) -> Option<Slot> {
        match self {
            Phase::Forwarding { slot, .. }
            | Phase::Finishing { slot, .. }
            | Phase::Releasing { slot } => Some(slot),
            _ => None,
        }
    }

    fn map(
        self,
        t: impl Fn(Token) -> Token,
        s: impl Fn(Slot) -> Slot,
        e: impl Fn(Exec) -> Exec,
    ) -> Phase {
        match self {
            Phase::Idle | Phase::Claiming { .. } => self,
            Phase::Claimed { key, token } => Phase::Claimed {
                key,
                token: t(token),
            },
            Phase::SlotCounted { key, token } => Phase::SlotCounted {
                key,
                token: t(token),
            },
            Phase::Forwarding { key, token, slot } => Phase::Forwarding {
                key,
                token: t(token),
                slot: s(slot),
            },
            Phase::Finishing {
                key,
                token,
                slot,
                exec,
                alone,
                failed,
            } => Phase::Finishing {
                key,
                token: t(token),
                slot: s(slot),
                exec: e(exec),
                alone,
                failed,
            },
            Phase::Releasing { slot } => Phase::Releasing { slot: s(slot) },
        }
    }
}

/// Events the coverage check must reach.
mod seen {
    pub const BATCH_CLAIMED: u16 = 1;
    pub const BATCH_FINISHED: u16 = 1 << 1;
    pub const CLAIMED_ALONE_AFTER_FAILED_BATCH: u16 = 1 << 2;
    pub const WROTE_ALONE_AFTER_FAILED_BATCH: u16 = 1 << 3;
    pub const SLOT_REFUSED: u16 = 1 << 4;
    pub const SLOT_AFTER_ITS_LEASE: u16 = 1 << 5;
    pub const TAKEOVER: u16 = 1 << 6;
    pub const LEASE_LOST: u16 = 1 << 7;
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(super) struct State {
    /// Tries the clients of each key have yet to send.
    tries: [u8; KEYS],
    gateways: Vec<Phase>,
    rows: [Option<Row>; KEYS],
    /// Key leases not ended (a bit per token; tokens are drawn for both keys).
    live: u16,
    /// Tokens whose row another claim took over.
    taken_over: u16,
    /// The scope's slot row (slot 0 of `idemgate_slots`): its token.
    slot: Option<Slot>,
    /// Slot leases not ended (a bit per slot token).
    slot_live: u16,
    next_token: Token,
    next_slot: Slot,
    next_exec: Exec,
    /// Each key has one life here (no delete, no `ttl`).
    lives: [Life; KEYS],
    crashes: u8,
    store_faults: u8,
    /// Keys whose step failed for another key's fault.
    shared_fate: u8,
    /// Coverage check only (see [`seen`]).
    seen: u16,
}

impl State {
    fn lease_live(&self, token: Token) -> bool {
        self.live & bit(token) != 0
    }

    fn slot_live(&self, slot: Slot) -> bool {
        self.slot_live & bit(slot) != 0
    }

    fn canonical(mut self) -> State {
        let held = self
            .gateways
            .iter()
            .filter_map(|p| p.token())
            .fold(0u16, |m, t| m | bit(t));
        let in_rows = self.rows.iter().flatten().fold(0u16, |m, r| {
            if r.state == RowState::InFlight {
                m | bit(r.token)
            } else {
                m
            }
        });
        self.live &= held | in_rows;
        self.taken_over &= held;
        let held_slots = self
            .gateways
            .iter()
            .filter_map(|p| p.slot())
            .chain(self.slot)
            .fold(0u16, |m, s| m | bit(s));
        self.slot_live &= held_slots;
        self.gateways.sort();

        let mut tokens = Renumber::default();
        let mut slots = Renumber::default();
        let mut execs = Renumber::default();
        for r in self.rows.iter().flatten() {
            tokens.see(r.token);
            if let Some(resp) = r.response {
                tokens.see(resp.forwarded_under);
                execs.see(resp.exec);
            }
        }
        if let Some(s) = self.slot {
            slots.see(s);
        }
        for p in &self.gateways {
            if let Some(t) = p.token() {
                tokens.see(t);
            }
            if let Some(s) = p.slot() {
                slots.see(s);
            }
            if let Phase::Finishing { exec, .. } = *p {
                execs.see(exec);
            }
        }
        for l in &self.lives {
            for e in bits(l.answered) {
                execs.see(e);
            }
        }
        for r in self.rows.iter_mut().flatten() {
            r.token = tokens.get(r.token);
            if let Some(resp) = &mut r.response {
                resp.forwarded_under = tokens.get(resp.forwarded_under);
                resp.exec = execs.get(resp.exec);
            }
        }
        for l in &mut self.lives {
            l.answered = bits(l.answered).fold(0, |m, e| m | bit(execs.get(e)));
        }
        for p in &mut self.gateways {
            *p = p.map(|t| tokens.get(t), |s| slots.get(s), |e| execs.get(e));
        }
        self.slot = self.slot.map(|s| slots.get(s));
        self.live = bits(self.live).fold(0, |m, t| m | bit(tokens.get(t)));
        self.taken_over = bits(self.taken_over).fold(0, |m, t| m | bit(tokens.get(t)));
        self.slot_live = bits(self.slot_live).fold(0, |m, s| m | bit(slots.get(s)));
        self.next_token = tokens.next;
        self.next_slot = slots.next;
        self.next_exec = execs.next;
        self
    }

    /// The key's row as the decision table names it (no `ttl` passes here).
    fn before(&self, key: Key) -> Before {
        match &self.rows[key as usize] {
            None => Before::Absent,
            Some(r) => match r.state {
                RowState::InFlight if self.lease_live(r.token) => Before::InFlight,
                RowState::InFlight => Before::InFlightExpired,
                RowState::Completed => Before::Completed,
                RowState::Unknown => Before::Unknown,
            },
        }
    }

    /// The write of a claim the table decided `Acquired`: a new row or the row taken over,
    /// with a new token and lease (the parent model's `Protocol::acquire`).
    fn acquire(&mut self, key: Key, took_over: bool) -> Token {
        let token = self.next_token;
        self.next_token += 1;
        let k = key as usize;
        let mut attempts = 1;
        if let Some(r) = &self.rows[k]
            && r.state == RowState::InFlight
        {
            if !self.lease_live(r.token) {
                self.taken_over |= bit(r.token);
                self.lives[k].takeovers += 1;
                self.seen |= seen::TAKEOVER;
            }
            if took_over {
                attempts = r.attempts + 1;
            }
        }
        self.rows[k] = Some(Row {
            state: RowState::InFlight,
            token,
            response: None,
            attempts,
            expired: false,
        });
        self.live |= bit(token);
        if attempts > 1 {
            self.lives[k].counted_takeovers += 1;
        }
        token
    }

    /// The batched insert of a new key (CLAIM_NEW_BATCH_SQL, `ON CONFLICT DO NOTHING`): the
    /// new row's token, or `None` when the key exists (the full claim decides, alone).
    fn insert_new(&mut self, key: Key) -> Option<Token> {
        if self.rows[key as usize].is_some() {
            return None;
        }
        Some(self.acquire(key, false))
    }

    /// FINISH_SQL (or its batched form) with a completed response, fenced as the decision
    /// table decides: whether it wrote.
    fn complete(&mut self, key: Key, token: Token, exec: Exec) -> bool {
        let Some(r) = &self.rows[key as usize] else {
            return false;
        };
        let whose = if r.token == token {
            table::Token::Current
        } else {
            table::Token::Stale
        };
        if table::decide(self.before(key), Op::Complete(whose)).0 != Decision::Wrote {
            return false;
        }
        let r = self.rows[key as usize]
            .as_mut()
            .expect("the fence found the row");
        r.state = RowState::Completed;
        r.response = Some(Response {
            exec,
            forwarded_under: token,
        });
        true
    }

    /// An attempt's completion was answered: the client gets the upstream's answer, written
    /// or not (a lost lease is counted; excused when it was taken over).
    fn answer_completion(&mut self, key: Key, token: Token, exec: Exec, written: bool) {
        if !written {
            self.seen |= seen::LEASE_LOST;
        }
        if written || self.taken_over & bit(token) == 0 {
            self.lives[key as usize].answered |= bit(exec);
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Action {
    /// A client's try for `key` reaches an idle instance; its claim is queued.
    Claim { key: Key },
    /// The claim's statement alone: the decision table decides on the key's row.
    ClaimAlone { gateway: u8 },
    /// The queued claims of two keys in one insert and one commit.
    ClaimBatch { a: u8, b: u8 },
    /// A lone claim statement fails: 503. `applied`: it committed all the same.
    ClaimFails { gateway: u8, applied: bool },
    /// The batched insert fails: for `culprit`'s own error (rolled back), or, with no
    /// culprit, its commit's answer is lost (`applied`: it committed).
    ClaimBatchFails {
        a: u8,
        b: u8,
        culprit: Option<Key>,
        applied: bool,
    },
    /// `idemgate_take_slot` (or, broken, its count).
    TakeSlot { gateway: u8 },
    /// Broken variant only: the slot's separate insert.
    SlotInsert { gateway: u8 },
    /// The wait for a slot runs out: the key is released (fenced), 409.
    WaitEnds { gateway: u8 },
    /// The upstream executes and answers.
    Upstream { gateway: u8 },
    /// The completion's statement alone (FINISH_SQL, fenced).
    Finish { gateway: u8 },
    /// The queued completions of two keys in one update and one commit (each fenced).
    FinishBatch { a: u8, b: u8 },
    /// A lone completion fails. `applied`: it committed all the same.
    FinishFails { gateway: u8, applied: bool },
    /// The batched completion fails, as [`Action::ClaimBatchFails`].
    FinishBatchFails {
        a: u8,
        b: u8,
        culprit: Option<Key>,
        applied: bool,
    },
    /// `Claimed::record` stops trying: 503.
    GiveUp { gateway: u8 },
    /// `Held::release`: SLOT_RELEASE_SQL, fenced by the slot's token.
    ReleaseSlot { gateway: u8 },
    /// The instance dies. `work_done`: the upstream executed what it had been sent.
    Crash { gateway: u8, work_done: bool },
    /// A key's lease ends.
    LeaseExpires { token: Token },
    /// A slot's lease ends.
    SlotLeaseExpires { slot: Slot },
}

/// Two keys of one scope with batches and a `serialize` slot, within bounds.
#[derive(Clone, Debug)]
pub(super) struct Scope {
    /// Tries per key.
    pub(super) tries: u8,
    pub(super) gateways: u8,
    pub(super) crashes: u8,
    pub(super) store_faults: u8,
    pub(super) bug: Option<Bug>,
    /// Check reachability (the `sometimes` properties) instead of the invariants.
    pub(super) coverage: bool,
}

impl Scope {
    fn key_of(s: &State, g: u8) -> Key {
        match s.gateways[g as usize] {
            Phase::Claiming { key, .. }
            | Phase::Claimed { key, .. }
            | Phase::SlotCounted { key, .. }
            | Phase::Forwarding { key, .. }
            | Phase::Finishing { key, .. } => key,
            other => unreachable!("no key in {other:?}"),
        }
    }

    /// Whether the scope's slot can be taken now (no live slot holds it).
    fn slot_free(s: &State) -> bool {
        s.slot.is_none_or(|t| !s.slot_live(t))
    }

    /// A failed batch, correct: every key runs alone, the culprit's step fails for its own
    /// error; broken: every key's step fails.
    fn batch_failed(
        &self,
        n: &mut State,
        gateways: [u8; 2],
        culprit: Option<Key>,
        fail: fn(Phase) -> Phase,
        alone: fn(Phase) -> Phase,
    ) {
        for g in gateways {
            let key = Self::key_of(n, g);
            let phase = n.gateways[g as usize];
            let own = culprit == Some(key);
            let next = if own || self.bug == Some(Bug::SharedFate) {
                fail(phase)
            } else {
                alone(phase)
            };
            // What the property looks at: a key's step failed, and the fault was another
            // key's.
            if next == fail(phase) && culprit.is_some_and(|c| c != key) {
                n.shared_fate |= bit(key) as u8;
            }
            n.gateways[g as usize] = next;
        }
    }

    /// The full claim, alone, as the decision table decides it.
    fn claim_alone(&self, n: &mut State, g: usize, key: Key) {
        let claim = Op::Claim {
            same_request: true,
            holds: false,
        };
        n.gateways[g] = Phase::Idle;
        match table::decide(n.before(key), claim).0 {
            Decision::Acquired { took_over } => {
                let token = n.acquire(key, took_over);
                n.gateways[g] = Phase::Claimed { key, token };
            }
            Decision::Replay => {
                let exec = n.rows[key as usize]
                    .as_ref()
                    .and_then(|r| r.response)
                    .expect("a completed row holds its response")
                    .exec;
                n.lives[key as usize].answered |= bit(exec);
            }
            // 409 `in-flight`; a waiter is a try that looks again later.
            Decision::InFlight => {}
            other => unreachable!("one fingerprint, reforward: {other:?}"),
        }
    }

    /// The pairs of instances whose queued steps of different keys may share a batch.
    fn pairs(s: &State, queued: impl Fn(Phase) -> Option<Key>) -> Vec<(u8, u8)> {
        let mut pairs = Vec::new();
        for a in 0..s.gateways.len() {
            for b in a + 1..s.gateways.len() {
                if let (Some(ka), Some(kb)) = (queued(s.gateways[a]), queued(s.gateways[b]))
                    && ka != kb
                {
                    pairs.push((a as u8, b as u8));
                }
            }
        }
        pairs
    }
}

impl Model for Scope {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        vec![State {
            tries: [self.tries; KEYS],
            gateways: vec![Phase::Idle; self.gateways as usize],
            rows: [None, None],
            live: 0,
            taken_over: 0,
            slot: None,
            slot_live: 0,
            next_token: 0,
            next_slot: 0,
            next_exec: 0,
            lives: Default::default(),
            crashes: self.crashes,
            store_faults: self.store_faults,
            shared_fate: 0,
            seen: 0,
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let fault = s.store_faults > 0;
        // Idle instances sort first and are interchangeable.
        if s.gateways[0] == Phase::Idle {
            for key in 0..KEYS as u8 {
                if s.tries[key as usize] > 0 {
                    actions.push(Action::Claim { key });
                }
            }
        }
        let claims = Scope::pairs(s, |p| match p {
            Phase::Claiming { key, alone: false } => Some(key),
            _ => None,
        });
        for (a, b) in claims {
            actions.push(Action::ClaimBatch { a, b });
            if fault {
                for culprit in [Some(0), Some(1), None] {
                    for applied in [false, true] {
                        if culprit.is_none() || !applied {
                            actions.push(Action::ClaimBatchFails {
                                a,
                                b,
                                culprit,
                                applied,
                            });
                        }
                    }
                }
            }
        }
        let finishes = Scope::pairs(s, |p| match p {
            Phase::Finishing {
                key, alone: false, ..
            } => Some(key),
            _ => None,
        });
        for (a, b) in finishes {
            actions.push(Action::FinishBatch { a, b });
            if fault {
                for culprit in [Some(0), Some(1), None] {
                    for applied in [false, true] {
                        if culprit.is_none() || !applied {
                            actions.push(Action::FinishBatchFails {
                                a,
                                b,
                                culprit,
                                applied,
                            });
                        }
                    }
                }
            }
        }
        for (g, phase) in s.gateways.iter().enumerate() {
            let gateway = g as u8;
            match *phase {
                Phase::Idle => continue,
                Phase::Claiming { .. } => {
                    actions.push(Action::ClaimAlone { gateway });
                    if fault {
                        for applied in [false, true] {
                            actions.push(Action::ClaimFails { gateway, applied });
                        }
                    }
                }
                Phase::Claimed { .. } => {
                    if Scope::slot_free(s) {
                        actions.push(Action::TakeSlot { gateway });
                    } else {
                        actions.push(Action::WaitEnds { gateway });
                    }
                }
                Phase::SlotCounted { .. } => actions.push(Action::SlotInsert { gateway }),
                Phase::Forwarding { .. } => actions.push(Action::Upstream { gateway }),
                Phase::Finishing { failed, .. } => {
                    actions.push(Action::Finish { gateway });
                    if fault {
                        for applied in [false, true] {
                            actions.push(Action::FinishFails { gateway, applied });
                        }
                    }
                    if failed {
                        actions.push(Action::GiveUp { gateway });
                    }
                }
                Phase::Releasing { .. } => actions.push(Action::ReleaseSlot { gateway }),
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
        for slot in bits(s.slot_live) {
            actions.push(Action::SlotLeaseExpires { slot });
        }
    }

    fn next_state(&self, s: &State, action: Action) -> Option<State> {
        let mut n = s.clone();
        match action {
            Action::Claim { key } => {
                n.tries[key as usize] -= 1;
                n.gateways[0] = Phase::Claiming { key, alone: false };
            }
            Action::ClaimAlone { gateway } => {
                let key = Scope::key_of(s, gateway);
                if let Phase::Claiming { alone: true, .. } = s.gateways[gateway as usize] {
                    n.seen |= seen::CLAIMED_ALONE_AFTER_FAILED_BATCH;
                }
                self.claim_alone(&mut n, gateway as usize, key);
            }
            Action::ClaimBatch { a, b } => {
                n.seen |= seen::BATCH_CLAIMED;
                for g in [a, b] {
                    let key = Scope::key_of(s, g);
                    n.gateways[g as usize] = match n.insert_new(key) {
                        Some(token) => Phase::Claimed { key, token },
                        // The key exists: the full claim decides, alone.
                        None => Phase::Claiming { key, alone: true },
                    };
                }
            }
            Action::ClaimFails { gateway, applied } => {
                let key = Scope::key_of(s, gateway);
                n.store_faults -= 1;
                let claim = Op::Claim {
                    same_request: true,
                    holds: false,
                };
                if applied
                    && let Decision::Acquired { took_over } = table::decide(s.before(key), claim).0
                {
                    // Claimed under a token no one holds; the client gets 503.
                    n.acquire(key, took_over);
                }
                n.gateways[gateway as usize] = Phase::Idle;
            }
            Action::ClaimBatchFails {
                a,
                b,
                culprit,
                applied,
            } => {
                n.store_faults -= 1;
                if applied {
                    for g in [a, b] {
                        n.insert_new(Scope::key_of(s, g));
                    }
                }
                self.batch_failed(
                    &mut n,
                    [a, b],
                    culprit,
                    |_| Phase::Idle,
                    |p| match p {
                        Phase::Claiming { key, .. } => Phase::Claiming { key, alone: true },
                        other => other,
                    },
                );
            }
            Action::TakeSlot { gateway } => {
                let g = gateway as usize;
                let Phase::Claimed { key, token } = s.gateways[g] else {
                    unreachable!("a slot is taken after the claim")
                };
                if self.bug == Some(Bug::SlotByCountThenInsert) {
                    n.gateways[g] = Phase::SlotCounted { key, token };
                } else {
                    let slot = take_slot(&mut n);
                    n.gateways[g] = Phase::Forwarding { key, token, slot };
                }
            }
            Action::SlotInsert { gateway } => {
                let g = gateway as usize;
                let Phase::SlotCounted { key, token } = s.gateways[g] else {
                    unreachable!("the insert follows its count")
                };
                let slot = take_slot(&mut n);
                n.gateways[g] = Phase::Forwarding { key, token, slot };
            }
            Action::WaitEnds { gateway } => {
                let g = gateway as usize;
                let Phase::Claimed { key, token } = s.gateways[g] else {
                    unreachable!("only a claimed request waits for a slot")
                };
                n.seen |= seen::SLOT_REFUSED;
                // RELEASE_SQL, fenced: a retry can go through.
                if let Some(r) = &s.rows[key as usize] {
                    let whose = if r.token == token {
                        table::Token::Current
                    } else {
                        table::Token::Stale
                    };
                    if table::decide(s.before(key), Op::Release(whose)).0 == Decision::Wrote {
                        n.rows[key as usize] = None;
                    }
                }
                n.gateways[g] = Phase::Idle;
            }
            Action::Upstream { gateway } => {
                let g = gateway as usize;
                let Phase::Forwarding { key, token, slot } = s.gateways[g] else {
                    unreachable!("the upstream answers a forward")
                };
                let exec = execute(&mut n, key);
                n.gateways[g] = Phase::Finishing {
                    key,
                    token,
                    slot,
                    exec,
                    alone: false,
                    failed: false,
                };
            }
            Action::Finish { gateway } => {
                let g = gateway as usize;
                let Phase::Finishing {
                    key,
                    token,
                    slot,
                    exec,
                    alone,
                    ..
                } = s.gateways[g]
                else {
                    unreachable!("only an answered attempt finishes")
                };
                let written = n.complete(key, token, exec);
                if alone && written {
                    n.seen |= seen::WROTE_ALONE_AFTER_FAILED_BATCH;
                }
                n.answer_completion(key, token, exec, written);
                n.gateways[g] = Phase::Releasing { slot };
            }
            Action::FinishBatch { a, b } => {
                n.seen |= seen::BATCH_FINISHED;
                for g in [a, b] {
                    let Phase::Finishing {
                        key,
                        token,
                        slot,
                        exec,
                        ..
                    } = s.gateways[g as usize]
                    else {
                        unreachable!("only answered attempts finish")
                    };
                    let written = n.complete(key, token, exec);
                    n.answer_completion(key, token, exec, written);
                    n.gateways[g as usize] = Phase::Releasing { slot };
                }
            }
            Action::FinishFails { gateway, applied } => {
                let g = gateway as usize;
                n.store_faults -= 1;
                let Phase::Finishing {
                    key, token, exec, ..
                } = s.gateways[g]
                else {
                    unreachable!("only an answered attempt finishes")
                };
                if applied {
                    n.complete(key, token, exec);
                }
                n.gateways[g] = failed(s.gateways[g]);
            }
            Action::FinishBatchFails {
                a,
                b,
                culprit,
                applied,
            } => {
                n.store_faults -= 1;
                if applied {
                    for g in [a, b] {
                        let Phase::Finishing {
                            key, token, exec, ..
                        } = s.gateways[g as usize]
                        else {
                            unreachable!("only answered attempts finish")
                        };
                        n.complete(key, token, exec);
                    }
                }
                self.batch_failed(&mut n, [a, b], culprit, failed, |p| match p {
                    Phase::Finishing {
                        key,
                        token,
                        slot,
                        exec,
                        failed,
                        ..
                    } => Phase::Finishing {
                        key,
                        token,
                        slot,
                        exec,
                        alone: true,
                        failed,
                    },
                    other => other,
                });
            }
            Action::GiveUp { gateway } => {
                let g = gateway as usize;
                let Phase::Finishing { slot, .. } = s.gateways[g] else {
                    unreachable!("only a failed completion is given up")
                };
                n.gateways[g] = Phase::Releasing { slot };
            }
            Action::ReleaseSlot { gateway } => {
                let g = gateway as usize;
                let Phase::Releasing { slot } = s.gateways[g] else {
                    unreachable!("only a held slot is released")
                };
                if n.slot == Some(slot) || self.bug == Some(Bug::UnfencedSlotRelease) {
                    n.slot = None;
                }
                n.gateways[g] = Phase::Idle;
            }
            Action::Crash { gateway, work_done } => {
                let g = gateway as usize;
                n.crashes -= 1;
                if work_done {
                    let Phase::Forwarding { key, .. } = s.gateways[g] else {
                        unreachable!("only a forwarded request is worked on")
                    };
                    execute(&mut n, key);
                }
                n.gateways[g] = Phase::Idle;
            }
            Action::LeaseExpires { token } => n.live &= !bit(token),
            Action::SlotLeaseExpires { slot } => n.slot_live &= !bit(slot),
        }
        if !self.coverage {
            n.seen = 0;
        }
        Some(n.canonical())
    }

    fn properties(&self) -> Vec<Property<Self>> {
        if !self.coverage {
            return vec![
                Property::always(ONE_LIVE_FORWARD_PER_KEY, |_, s: &State| {
                    (0..KEYS as u8).all(|k| {
                        let forwards = s.gateways.iter().filter(|p| {
                            matches!(**p, Phase::Forwarding { key, token, .. }
                                if key == k && s.lease_live(token))
                        });
                        forwards.count() <= 1
                    })
                }),
                Property::always(ONE_FORWARD_PER_SCOPE, |_, s: &State| {
                    let forwards = s.gateways.iter().filter(
                        |p| matches!(**p, Phase::Forwarding { slot, .. } if s.slot_live(slot)),
                    );
                    forwards.count() <= 1
                }),
                Property::always(ONE_ANSWER_PER_KEY, |_, s: &State| {
                    s.lives.iter().all(super::answers_once)
                }),
                Property::always(FENCED_PER_KEY, |_, s: &State| {
                    s.rows.iter().flatten().all(|r| match r.response {
                        Some(resp) => resp.forwarded_under == r.token,
                        None => r.state != RowState::Completed,
                    })
                }),
                Property::always(DOUBLES_COUNTED_PER_KEY, |_, s: &State| {
                    s.lives.iter().all(|l| {
                        l.takeovers == l.counted_takeovers
                            && l.executions <= 1 + l.counted_takeovers
                    })
                }),
                Property::always(NO_SHARED_FATE, |_, s: &State| s.shared_fate == 0),
            ];
        }
        macro_rules! reach {
            ($name:expr, $event:expr) => {
                Property::sometimes($name, |_, s: &State| s.seen & $event != 0)
            };
        }
        vec![
            reach!("two new keys are claimed in one batch", seen::BATCH_CLAIMED),
            reach!(
                "two completions are written in one batch",
                seen::BATCH_FINISHED
            ),
            reach!(
                "a key of a failed batch is claimed alone",
                seen::CLAIMED_ALONE_AFTER_FAILED_BATCH
            ),
            reach!(
                "a key of a failed batch is completed alone",
                seen::WROTE_ALONE_AFTER_FAILED_BATCH
            ),
            reach!(
                "a request waits out a slot held by another key",
                seen::SLOT_REFUSED
            ),
            reach!(
                "a slot is taken while its holder past its lease forwards",
                seen::SLOT_AFTER_ITS_LEASE
            ),
            reach!("an expired lease is taken over", seen::TAKEOVER),
            reach!("a completion finds its lease lost", seen::LEASE_LOST),
        ]
    }
}

pub(super) const ONE_LIVE_FORWARD_PER_KEY: &str = "never two forwards of a key under live leases";
pub(super) const ONE_FORWARD_PER_SCOPE: &str =
    "never two forwards of a serialized scope under live slot leases";
pub(super) const ONE_ANSWER_PER_KEY: &str = "every 2xx of a key names one execution";
pub(super) const FENCED_PER_KEY: &str =
    "a key's row holds the answer of the attempt that claimed it";
pub(super) const DOUBLES_COUNTED_PER_KEY: &str =
    "a key's second execution follows a counted takeover";
pub(super) const NO_SHARED_FATE: &str = "a key's step fails only for a fault of its own";

/// `idemgate_take_slot` under the per-scope lock: the slot row, new token, new lease.
fn take_slot(n: &mut State) -> Slot {
    if n.gateways
        .iter()
        .any(|p| matches!(*p, Phase::Forwarding { slot, .. } if Some(slot) == n.slot))
    {
        n.seen |= seen::SLOT_AFTER_ITS_LEASE;
    }
    let slot = n.next_slot;
    n.next_slot += 1;
    n.slot = Some(slot);
    n.slot_live |= bit(slot);
    slot
}

/// The upstream executes the key's request.
fn execute(n: &mut State, key: Key) -> Exec {
    let exec = n.next_exec;
    n.next_exec += 1;
    n.lives[key as usize].executions += 1;
    exec
}

/// A completion whose write failed: `Claimed::record` queues it again, or gives up.
fn failed(p: Phase) -> Phase {
    match p {
        Phase::Finishing {
            key,
            token,
            slot,
            exec,
            ..
        } => Phase::Finishing {
            key,
            token,
            slot,
            exec,
            alone: false,
            failed: true,
        },
        other => unreachable!("only a completion fails: {other:?}"),
    }
}
