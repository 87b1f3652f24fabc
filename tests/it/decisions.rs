//! One decision table for the statements that act on one key: the claim, the three ways an
//! attempt ends (complete, hold, release) and an operator's delete. [`decide`] says, for the
//! row a statement finds ([`Before`]) and what it is asked ([`Op`]), what it answers
//! ([`Decision`]) and the row it leaves ([`After`]).
//!
//! The table is used twice, so that the model and the stores cannot drift apart:
//!
//! - the protocol model (`model.rs`) takes its claim, fence and delete decisions from it, and
//!   model-checks the protocol built on them;
//! - the conformance suite (`conformance::*::every_row_of_the_decision_table_holds`, on the
//!   direct, PgBouncer, partitioned and embedded stores) puts a real store's row in each
//!   [`Before`] state through the store's own API, sends each [`Op`], and checks the answer
//!   and the row left against the same table.
//!
//! In the code: the claim is `LOOK_SQL` then `CLAIM_SQL` (or the plain insert of a new key,
//! alone or batched) and `ExistingRow::decide`; the ends are `FINISH_SQL` (completed,
//! not replayable, unknown) and `RELEASE_SQL`, fenced by the lease token and
//! `state = 'in_flight'`; the delete is `DELETE_SQL` (src/store/postgres/statements.rs, and
//! the embedded store's transactions in src/store/sqlite.rs).

/// The row a statement finds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Before {
    /// No row (never claimed, released, deleted or collected).
    Absent,
    /// In flight under a live lease.
    InFlight,
    /// In flight, its lease ended (the holder died, or is paused).
    InFlightExpired,
    /// In flight, its lease and then its `ttl` passed (not collected yet): the holder may
    /// still write, and anyone may claim it afresh.
    InFlightTtlPassed,
    /// In flight under a live lease taken over from an earlier claim whose lease ended: the
    /// earlier claim's token is stale.
    TakenOver,
    /// Completed with a stored answer, its `ttl` not passed.
    Completed,
    /// Completed, its `ttl` passed (not collected yet).
    Expired,
    /// Held: recorded as an unknown outcome.
    Unknown,
    /// Completed with an answer too large to store.
    NotReplayable,
}

impl Before {
    pub const ALL: [Before; 9] = [
        Before::Absent,
        Before::InFlight,
        Before::InFlightExpired,
        Before::InFlightTtlPassed,
        Before::TakenOver,
        Before::Completed,
        Before::Expired,
        Before::Unknown,
        Before::NotReplayable,
    ];
}

/// Whose lease token an end of an attempt carries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Token {
    /// The token of the row's latest claim.
    Current,
    /// The token of the claim before it (taken over), or, where there was none, a token
    /// never issued.
    Stale,
}

/// What a statement is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A claim. `same_request`: the same fingerprint as the row's; `holds`: the route has
    /// `on_unknown_outcome: hold`.
    Claim { same_request: bool, holds: bool },
    /// `FINISH_SQL` with a stored answer.
    Complete(Token),
    /// `FINISH_SQL` with `unknown` (`on_unknown_outcome: hold`).
    Hold(Token),
    /// `RELEASE_SQL` (`reforward`, a retryable status, nothing sent).
    Release(Token),
    /// `DELETE_SQL` (`idemgate keys delete`, `DELETE /v1/keys`), forced or not.
    Delete { force: bool },
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Claim {
            same_request: true,
            holds: false,
        },
        Op::Claim {
            same_request: true,
            holds: true,
        },
        Op::Claim {
            same_request: false,
            holds: false,
        },
        Op::Claim {
            same_request: false,
            holds: true,
        },
        Op::Complete(Token::Current),
        Op::Complete(Token::Stale),
        Op::Hold(Token::Current),
        Op::Hold(Token::Stale),
        Op::Release(Token::Current),
        Op::Release(Token::Stale),
        Op::Delete { force: false },
        Op::Delete { force: true },
    ];
}

/// What the statement answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    /// The claim took the key: forward. `took_over`: from an expired lease (counted
    /// `taken_over`: a possible double).
    Acquired { took_over: bool },
    /// Another attempt holds a live lease: wait, or 409.
    InFlight,
    /// Replay the stored answer.
    Replay,
    /// The key was used with another request: 422.
    Mismatch,
    /// The first attempt's outcome is unknown and the route holds it: 502.
    Held,
    /// Completed with an answer too large to store: 502.
    NotReplayable,
    /// The end of the attempt was written.
    Wrote,
    /// Fenced: nothing written (the lease was taken over, or the row is not in flight).
    Fenced,
    /// The row was deleted; `live_lease`: under a live lease (forced).
    Deleted { live_lease: bool },
    /// A delete found no row.
    NotFound,
    /// A delete refused: in flight under a live lease, not forced.
    Refused,
}

/// The row the statement leaves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum After {
    /// As it was.
    Same,
    /// No row.
    Absent,
    /// In flight under a new claim (a new token and lease).
    Claimed,
    Completed,
    Unknown,
}

/// The decision table: what a statement asked `op` answers on a row found `before`, and the
/// row it leaves.
pub fn decide(before: Before, op: Op) -> (Decision, After) {
    use Before as B;
    match op {
        Op::Claim {
            same_request,
            holds,
        } => match before {
            // No row, or one whose ttl passed: a new life of the key, whatever it was.
            B::Absent | B::Expired | B::InFlightTtlPassed => {
                (Decision::Acquired { took_over: false }, After::Claimed)
            }
            // Any other row answers a different request with a mismatch.
            _ if !same_request => (Decision::Mismatch, After::Same),
            B::InFlight | B::TakenOver => (Decision::InFlight, After::Same),
            // An expired lease is taken over by the same request, unless the route holds
            // unknown outcomes.
            B::InFlightExpired if holds => (Decision::Held, After::Same),
            B::InFlightExpired => (Decision::Acquired { took_over: true }, After::Claimed),
            B::Completed => (Decision::Replay, After::Same),
            B::Unknown => (Decision::Held, After::Same),
            B::NotReplayable => (Decision::NotReplayable, After::Same),
        },
        Op::Complete(token) | Op::Hold(token) | Op::Release(token) => {
            // Fenced by the token and `state = 'in_flight'`, whether or not the lease has
            // ended: a holder past its lease may still write until someone takes over.
            let in_flight = matches!(
                before,
                B::InFlight | B::InFlightExpired | B::InFlightTtlPassed | B::TakenOver
            );
            if !in_flight || token == Token::Stale {
                return (Decision::Fenced, After::Same);
            }
            let after = match op {
                Op::Complete(_) => After::Completed,
                Op::Hold(_) => After::Unknown,
                _ => After::Absent,
            };
            (Decision::Wrote, after)
        }
        Op::Delete { force } => match before {
            B::Absent => (Decision::NotFound, After::Same),
            B::InFlight | B::TakenOver if !force => (Decision::Refused, After::Same),
            B::InFlight | B::TakenOver => (Decision::Deleted { live_lease: true }, After::Absent),
            _ => (Decision::Deleted { live_lease: false }, After::Absent),
        },
    }
}

/// Every (row, statement) pair of the table.
pub fn cases() -> impl Iterator<Item = (Before, Op)> {
    Before::ALL
        .into_iter()
        .flat_map(|b| Op::ALL.into_iter().map(move |o| (b, o)))
}

#[test]
fn every_case_of_the_table_is_decided_and_the_fence_never_writes_a_stale_token() {
    let mut wrote = 0;
    for (before, op) in cases() {
        let (decision, after) = decide(before, op);
        if let Op::Complete(Token::Stale) | Op::Hold(Token::Stale) | Op::Release(Token::Stale) = op
        {
            assert_eq!(decision, Decision::Fenced, "{before:?} {op:?}");
        }
        if decision == Decision::Wrote {
            wrote += 1;
            assert_ne!(after, After::Same, "a write changes the row");
        }
    }
    assert_eq!(cases().count(), 108);
    // Four in-flight rows times three ends with the current token.
    assert_eq!(wrote, 12);
}
