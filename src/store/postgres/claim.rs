//! The claim and the completion of one key: the plain insert of a new key (batched when
//! batches are on), the full claim when the key exists (a look first, then the statement
//! that takes it over), and the fenced completion.

use super::PgStore;
use super::batched::*;
use super::session::*;
use super::statements::*;
use crate::store::{Claim, ClaimRequest, ExistingRow, LeaseToken, Outcome, StoreError};

/// What one claim's statements found: a new key claimed by the plain insert, or the full
/// statement's row (none: look again, see the module docs).
pub(super) enum Found {
    New(LeaseToken),
    Existing(Option<tokio_postgres::Row>),
}

impl PgStore {
    /// A claim, from the batched insert of a new key (with batches) to the full statement.
    pub(super) async fn claim_all(&self, req: &ClaimRequest<'_>) -> Result<Claim, StoreError> {
        // With batches, a new key is claimed with the others waiting (one insert for all);
        // a key that exists is left to the full statement, run alone.
        let mut try_new = true;
        if let Some(batches) = &self.batches {
            if let Some(token) = batches.claim_new(req).await? {
                return Ok(Claim::Acquired {
                    token,
                    took_over: false,
                });
            }
            try_new = false;
        }
        // A row committed after our snapshot but before our insert's conflict check makes
        // the statement return nothing (or a stale version): run it again. Five such answers
        // in a row would need five such races; treat that as the store misbehaving. Only the
        // first try can find the key new: a retry follows a row seen.
        for attempt in 0..5 {
            if let Some(claim) = self.claim_once(req, try_new && attempt == 0).await? {
                return Ok(claim);
            }
        }
        Err(StoreError::Db("claim saw no current row five times".into()))
    }

    /// The end of an attempt: a completion goes with the others waiting (with batches); a
    /// release (rare), or a completion handed back by its batch, runs alone.
    ///
    /// A completion whose batch failed after it was sent, and which then writes nothing
    /// alone, is answered an error rather than "nothing written": the batch may have written
    /// it (its commit's reply lost), and only the caller, which knows whether its lease still
    /// holds, can tell that from a lost lease (`gateway::record` looks at the row on a retry).
    pub(super) async fn finish_all(
        &self,
        f: FinishParams<'_>,
        outcome: Outcome,
    ) -> Result<bool, StoreError> {
        let (outcome, may_have_written) = match (&self.batches, outcome) {
            (_, Outcome::Release) => (Outcome::Release, false),
            (None, outcome) => (outcome, false),
            (Some(batches), outcome) => match batches.finish(f, outcome).await? {
                Finished::Written(written) => return Ok(written),
                Finished::Alone {
                    outcome,
                    may_have_written,
                } => (outcome, may_have_written),
            },
        };
        let written = self
            .db
            .unobserved(async |c| c.finish_one(f, &outcome).await)
            .await?;
        if !written && may_have_written {
            return Err(StoreError::Db(
                "the batch carrying this completion failed after it was sent, and the key \
                 alone found nothing to write: the batch may have written it"
                    .into(),
            ));
        }
        Ok(written)
    }

    /// One claim: with `try_new`, first the plain insert of a new key ([`CLAIM_NEW_SQL`]);
    /// when the key exists (or without `try_new`), the full statement ([`CLAIM_SQL`]). Both
    /// run on one connection within one statement bound.
    pub(super) async fn claim_once(
        &self,
        req: &ClaimRequest<'_>,
        try_new: bool,
    ) -> Result<Option<Claim>, StoreError> {
        let p = NewKeyParams::of(req);
        let found = self
            .db
            .unobserved(async |c| {
                if try_new {
                    let token = c.claim_new(p).await?;
                    if let Some(token) = token {
                        return Ok(Found::New(LeaseToken(token)));
                    }
                }
                // A row that will not be taken over is answered from a read (LOOK_SQL).
                let look = c
                    .query_opt(
                        LOOK_SQL,
                        LOOK_TYPES,
                        &[&p.scope, &p.key, &p.fingerprint, &req.hold_expired_leases],
                    )
                    .await?;
                if let Some(row) = look
                    && !row.get::<_, bool>("claimable")
                {
                    return Ok(Found::Existing(Some(row)));
                }
                c.query_opt(
                    CLAIM_SQL,
                    CLAIM_TYPES,
                    &[
                        &p.scope,
                        &p.key,
                        &p.route,
                        &p.fingerprint,
                        &p.lease_ms,
                        &p.ttl_ms,
                        &req.hold_expired_leases,
                    ],
                )
                .await
                .map(Found::Existing)
            })
            .await?;
        let row = match found {
            Found::New(token) => {
                return Ok(Some(Claim::Acquired {
                    token,
                    took_over: false,
                }));
            }
            Found::Existing(None) => return Ok(None),
            Found::Existing(Some(row)) => row,
        };
        if row.get::<_, bool>("stale") {
            return Ok(None);
        }
        let state: &str = row.get("state");
        if state == "claimed" {
            let attempts: i32 = row.get("attempts");
            return Ok(Some(Claim::Acquired {
                token: LeaseToken(row.get("token")),
                took_over: attempts > 1,
            }));
        }
        ExistingRow {
            state,
            fingerprint: row.get("fingerprint"),
            status: row.get::<_, Option<i32>>("status").map(i64::from),
            headers: row.get("headers"),
            body: row.get("body"),
            lease_expired: row.get("lease_expired"),
            lease_remaining_ms: row.get("lease_remaining_ms"),
            expires_in_ms: row.get("expires_in_ms"),
        }
        .decide(p.fingerprint)
        .map(Some)
    }
}
