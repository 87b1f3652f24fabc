//! Waiting for an in-flight key or a `serialize` slot: the loop and its backoff.
//!
//! The registry (`mod.rs`: subscriptions, announcements, shared lookups) says who is woken;
//! this file only decides when to look again: when woken, at least every [`SAFETY_POLL`]
//! while wake-ups flow, with a backoff from [`POLL_MIN`] to [`POLL_MAX`] while they do not,
//! and when the holder's lease ends.

use tokio::time::Instant;

use super::Wakeups;
use crate::store::{Claim, ClaimRequest, Store, StoreError};
use std::time::Duration;

/// Longest pause between two looks at an in-flight key while wake-ups flow.
pub const SAFETY_POLL: Duration = Duration::from_secs(1);
/// Polling bounds while wake-ups do not flow.
pub const POLL_MIN: Duration = Duration::from_millis(10);
pub const POLL_MAX: Duration = Duration::from_millis(250);

/// How long a waiter naps between looks: a safety poll while wake-ups flow, else polling
/// that backs off from [`POLL_MIN`] to [`POLL_MAX`]. Shared by in-flight keys and
/// `serialize` slots.
pub struct Backoff {
    pause: Duration,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff { pause: POLL_MIN }
    }
}

impl Backoff {
    /// The next nap, given whether wake-ups are flowing now.
    pub fn next(&mut self, wakeups_flow: bool) -> Duration {
        if wakeups_flow {
            return SAFETY_POLL;
        }
        let p = self.pause;
        self.pause = (self.pause * 2).min(POLL_MAX);
        p
    }
}

/// Waits for an in-flight key until it is finished or `deadline` passes; returns what the
/// key holds then (never `InFlight`) and when the look that found it started, or `None`
/// when the deadline passed first. Waiters are woken by the store's announcements (see
/// `mod.rs`), look again when the holder's lease ends (it may have crashed), and share
/// their lookups.
pub async fn wait_in_flight(
    store: &dyn Store,
    wakeups: &Wakeups,
    req: ClaimRequest<'_>,
    deadline: Instant,
) -> Result<Option<(Claim, Instant)>, StoreError> {
    let sub = wakeups.subscribe(req.scope, req.key);
    let mut since = Instant::now();
    let mut backoff = Backoff::default();
    loop {
        let woken = sub.next_wakeup();
        let looked_at = Instant::now();
        let lease_remaining = match sub.lookup(store, req, since, deadline).await? {
            None => return Ok(None),
            Some(Claim::InFlight { lease_remaining }) => lease_remaining,
            Some(other) => return Ok(Some((other, looked_at))),
        };
        let now = Instant::now();
        if now >= deadline {
            return Ok(None);
        }
        let nap = backoff
            .next(wakeups.healthy())
            .min(lease_remaining + POLL_MIN)
            .max(POLL_MIN)
            .min(deadline - now);
        tokio::select! {
            () = woken => {}
            () = tokio::time::sleep(nap) => {}
        }
        since = Instant::now();
    }
}
