//! Admission bounds (docs/contract.md §8.2): what protects the upstream and the gateway's
//! memory from a storm, detached work included.
//!
//! - [`UpstreamLimit`]: `upstreams.<name>.max_in_flight`, requests being forwarded to one
//!   upstream at once. A plain request takes its slot when it is admitted; a keyed one only
//!   once it has claimed its key and is about to be forwarded (a duplicate waiting for it,
//!   or a replay, takes none). A slot is freed when its forward ends: for a keyed request
//!   when its detached task ends (a client that hangs up does not free it), for a streamed
//!   one when the response body has been passed on (or dropped).
//! - [`ByteBudget`]: `server.max_buffered_bytes`, every body the gateway holds in memory
//!   across all requests: keyed request bodies, reserved as their bytes arrive (a client that
//!   declares a large body and sends little holds little), upstream answers captured for the
//!   store, and answers held until they are written to the client (first answers and
//!   replays, from the store or the replay cache; the reservation travels with the response
//!   body, `access::Logged`). A captured response is added as it arrives (the upstream
//!   already executed: it is never refused), so the budget can be overdrawn by responses
//!   already being captured, and new requests are refused until it is back under.
//!
//! Past either bound a request is answered 503 `overloaded` with `Retry-After`: nothing is
//! forwarded and no key is held. Both are gauges; refusals are counted by upstream and bound.
//!
//! Invariants: every slot and byte taken is given back exactly once, by a guard's `Drop`;
//! the counters never underflow; a limit changed by a reload applies to new admissions while
//! the requests already admitted keep their slots (the counter is carried over by name).

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use prometheus_client::metrics::gauge::Gauge;
use tokio::sync::OwnedSemaphorePermit;

/// A connection's slot of `server.max_connections` (taken by the listener, `server.rs`),
/// shared by the connection and its requests (in their extensions): freed when the last
/// holder is gone. Only a tunnel keeps its request's copy past the response
/// (`Gateway::route_request` drops it for everything else).
/// With several serving threads it also holds the connection's [`Seat`] on the thread that
/// serves it, so a tunnel counts there as long as it is open.
#[derive(Clone)]
pub struct ConnectionSlot {
    _held: Arc<(OwnedSemaphorePermit, Option<Seat>)>,
}

impl ConnectionSlot {
    pub fn new(permit: OwnedSemaphorePermit, seat: Option<Seat>) -> ConnectionSlot {
        ConnectionSlot {
            _held: Arc::new((permit, seat)),
        }
    }
}

/// How many connections each serving thread serves (`server.runtime: thread_per_core`),
/// for the balance that spreads new ones (`server.rs`). Read without a lock: a reading may
/// be one off while a connection starts or ends elsewhere.
pub struct ThreadLoad {
    open: Box<[AtomicUsize]>,
}

impl ThreadLoad {
    pub fn new(threads: usize) -> ThreadLoad {
        ThreadLoad {
            open: (0..threads).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// The connections thread `index` serves.
    pub fn of(&self, index: usize) -> usize {
        self.open[index].load(Ordering::Relaxed)
    }

    /// The thread serving the fewest, and how many.
    pub fn fewest(&self) -> (usize, usize) {
        self.open
            .iter()
            .map(|n| n.load(Ordering::Relaxed))
            .enumerate()
            .min_by_key(|&(_, n)| n)
            .expect("at least one thread")
    }

    /// Counts a connection on thread `index` until its seat is dropped.
    pub fn seat(self: &Arc<ThreadLoad>, index: usize) -> Seat {
        self.open[index].fetch_add(1, Ordering::Relaxed);
        Seat {
            load: Arc::clone(self),
            index,
        }
    }
}

/// A connection counted on the thread that serves it ([`ThreadLoad`]), until dropped.
pub struct Seat {
    load: Arc<ThreadLoad>,
    index: usize,
}

impl Drop for Seat {
    fn drop(&mut self) {
        self.load.open[self.index].fetch_sub(1, Ordering::Relaxed);
    }
}

/// Slots of one upstream. The count is its gauge's own atomic: one counter, so admitting
/// and freeing a slot write one cache line, not two.
pub struct UpstreamLimit {
    max: AtomicUsize,
    gauge: Gauge,
}

impl UpstreamLimit {
    pub fn new(max: usize, gauge: Gauge) -> UpstreamLimit {
        UpstreamLimit {
            max: AtomicUsize::new(max),
            gauge,
        }
    }

    /// Applies a reloaded `max_in_flight` to new admissions.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Requests admitted to this upstream now.
    pub fn current(&self) -> usize {
        usize::try_from(self.gauge.get()).unwrap_or(0)
    }

    /// Takes a slot, or `None` when all are taken.
    pub fn try_acquire(self: &Arc<Self>) -> Option<SlotGuard> {
        let max = i64::try_from(self.max.load(Ordering::Relaxed)).unwrap_or(i64::MAX);
        self.gauge
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()?;
        Some(SlotGuard(Arc::clone(self)))
    }
}

/// One admitted request's slot; freed on drop.
pub struct SlotGuard(Arc<UpstreamLimit>);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        self.0.gauge.dec();
    }
}

/// The process's budget of buffered bytes. The count is its gauge's own atomic, as for
/// [`UpstreamLimit`].
pub struct ByteBudget {
    max: usize,
    gauge: Gauge,
}

impl ByteBudget {
    pub fn new(max: usize, gauge: Gauge) -> ByteBudget {
        ByteBudget { max, gauge }
    }

    /// Bytes held now.
    pub fn used(&self) -> usize {
        usize::try_from(self.gauge.get()).unwrap_or(0)
    }

    /// Reserves `n` bytes, or `None` if that would pass the bound. A reservation of 0 bytes
    /// is refused while the budget is overdrawn (so captures already running drain first).
    pub fn try_reserve(self: &Arc<Self>, n: usize) -> Option<Reservation> {
        let max = i64::try_from(self.max).unwrap_or(i64::MAX);
        let n64 = i64::try_from(n).ok()?;
        self.gauge
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let after = used.checked_add(n64)?;
                (used < max && after <= max).then_some(after)
            })
            .ok()?;
        Some(Reservation {
            budget: Some(Arc::clone(self)),
            bytes: n,
        })
    }

    /// Admits a request that buffers nothing (a streamed forward), refused as a reservation
    /// of 0 bytes is while the budget is overdrawn; it only reads the counter. Its
    /// reservation can never grow.
    pub fn admit_unbuffered(&self) -> Option<Reservation> {
        (self.used() < self.max).then_some(Reservation {
            budget: None,
            bytes: 0,
        })
    }
}

/// Bytes held for one request; given back on drop.
pub struct Reservation {
    /// `None` for [`ByteBudget::admit_unbuffered`]'s, which holds nothing.
    budget: Option<Arc<ByteBudget>>,
    bytes: usize,
}

impl Reservation {
    /// Sets the reservation to exactly `n` bytes: shrinking gives bytes back; growing takes
    /// them even past the bound (used for responses already executed upstream). An
    /// unbuffered request's reservation stays at 0 (nothing of it is buffered).
    pub fn resize(&mut self, n: usize) {
        let Some(budget) = &self.budget else {
            debug_assert_eq!(n, 0, "an unbuffered request's reservation grew");
            return;
        };
        let delta = i64::try_from(n)
            .unwrap_or(i64::MAX)
            .saturating_sub(i64::try_from(self.bytes).unwrap_or(i64::MAX));
        if delta != 0 {
            budget.gauge.inc_by(delta);
        }
        self.bytes = n;
    }

    /// Sets the reservation to `n` bytes if the bound allows it: shrinking always does;
    /// growing is refused (`false`, nothing changed) when it would pass the bound or the
    /// budget is already overdrawn. For what is not held yet (a request body as it arrives,
    /// an answer about to be written).
    pub fn try_resize(&mut self, n: usize) -> bool {
        if n <= self.bytes {
            self.resize(n);
            return true;
        }
        let Some(budget) = &self.budget else {
            return false;
        };
        let max = i64::try_from(budget.max).unwrap_or(i64::MAX);
        let delta = i64::try_from(n - self.bytes).unwrap_or(i64::MAX);
        let grown = budget
            .gauge
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                let after = used.checked_add(delta)?;
                (after <= max).then_some(after)
            })
            .is_ok();
        if grown {
            self.bytes = n;
        }
        grown
    }

    /// Bytes held by this reservation.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.resize(0);
    }
}

impl Admission {
    /// Takes an upstream slot for a request about to be forwarded, if it holds none yet;
    /// past `max_in_flight` the refusal is counted (`idemgate_overloaded_total`) and the
    /// bound's name returned.
    pub(crate) fn take_slot(
        &mut self,
        limit: &Arc<UpstreamLimit>,
        upstream: &str,
        metrics: &crate::metrics::Metrics,
    ) -> Result<(), &'static str> {
        if self.slot.is_none() {
            match limit.try_acquire() {
                Some(slot) => self.slot = Some(slot),
                None => {
                    metrics.refused(upstream, "max_in_flight");
                    return Err("max_in_flight");
                }
            }
        }
        Ok(())
    }
}

/// What an admitted request holds until its forward ends: its upstream slot while it is
/// forwarded (a keyed request takes one only once it has claimed its key: a duplicate that
/// waits or a replay never holds one), and the bytes it buffers.
pub struct Admission {
    pub slot: Option<SlotGuard>,
    pub bytes: Reservation,
}

/// The open-file room at start (Linux): the soft `RLIMIT_NOFILE` read from
/// `/proc/self/limits`, against what the configuration can hold open at once (each client
/// connection up to `server.max_connections`, each with an upstream connection, the store's
/// pool, and a margin for listeners, the wake-up listener, logs and the runtime). A text to
/// warn with when it does not fit; `None` when it does or the limit cannot be read.
///
/// Run after [`raise_open_files`]; the warning says how to raise the limit further
/// (`ulimit -n`, systemd's `LimitNOFILE=`, deploy/systemd/idemgate.service).
pub fn open_file_room(config: &crate::config::Config) -> Option<String> {
    let (soft, _) = open_file_limits()?;
    let pool = match &config.store {
        crate::config::StoreConfig::Postgres(pg) => pg.pool_size as u64 + 2,
        crate::config::StoreConfig::Sqlite(_) => 4,
    };
    let connections = config.server.max_connections as u64;
    let needed = connections * 2 + pool + 64;
    (needed > soft).then(|| {
        format!(
            "the open-file limit is {soft}, below what this configuration can hold open \
             ({needed}: server.max_connections {connections} client connections, as many \
             upstream connections, {pool} store connections and 64 more): past it, new \
             connections fail with \"Too many open files\". Raise it (ulimit -n {needed}, or \
             LimitNOFILE={needed} in the systemd unit) or lower server.max_connections"
        )
    })
}

/// The soft and hard `RLIMIT_NOFILE` of this process, from `/proc/self/limits` (Linux).
fn open_file_limits() -> Option<(u64, u64)> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let mut fields = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))?
        .split_whitespace()
        .skip(3);
    let soft = fields.next()?.parse().ok()?;
    let hard = match fields.next()? {
        "unlimited" => u64::MAX,
        n => n.parse().ok()?,
    };
    Some((soft, hard))
}

/// Raises the soft open-file limit to the hard one, as servers do at start (raising one's own
/// soft limit up to the hard one needs no privilege). With no unsafe code in the crate, it
/// asks util-linux's `prlimit` to do it for this process; where that is missing or refused,
/// the limit stays and [`open_file_room`] says what it costs. Returns (from, to) when raised.
pub fn raise_open_files() -> Option<(u64, u64)> {
    let (soft, hard) = open_file_limits()?;
    if soft >= hard || hard == u64::MAX {
        return None;
    }
    let done = std::process::Command::new("prlimit")
        .arg(format!("--pid={}", std::process::id()))
        .arg(format!("--nofile={hard}:{hard}"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let (now, _) = open_file_limits()?;
    (done && now > soft).then_some((soft, now))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_bounded_and_given_back() {
        let limit = Arc::new(UpstreamLimit::new(2, Gauge::default()));
        let a = limit.try_acquire().unwrap();
        let b = limit.try_acquire().unwrap();
        assert!(limit.try_acquire().is_none());
        drop(a);
        let c = limit.try_acquire().unwrap();
        assert_eq!(limit.current(), 2);
        drop((b, c));
        assert_eq!(limit.current(), 0);
        assert_eq!(limit.gauge.get(), 0);
    }

    #[test]
    fn bytes_are_bounded_resized_and_given_back() {
        let budget = Arc::new(ByteBudget::new(100, Gauge::default()));
        let mut a = budget.try_reserve(60).unwrap();
        assert!(budget.try_reserve(50).is_none());
        a.resize(10);
        let mut b = budget.try_reserve(50).unwrap();
        // A capture grows past the bound; then nothing new is admitted, not even 0 bytes.
        b.resize(120);
        assert_eq!(budget.used(), 130);
        assert!(budget.try_reserve(0).is_none());
        drop(b);
        assert!(budget.try_reserve(0).is_some());
        drop(a);
        assert_eq!(budget.used(), 0);
        assert_eq!(budget.gauge.get(), 0);
    }

    #[test]
    fn an_unbuffered_admission_is_refused_while_overdrawn_and_holds_nothing() {
        let budget = Arc::new(ByteBudget::new(100, Gauge::default()));
        let mut held = budget.try_reserve(100).unwrap();
        assert!(budget.admit_unbuffered().is_none(), "at the bound");
        held.resize(150);
        assert!(budget.admit_unbuffered().is_none(), "overdrawn");
        held.resize(99);
        let mut free = budget.admit_unbuffered().unwrap();
        free.resize(0);
        assert_eq!(free.bytes(), 0);
        drop(free);
        assert_eq!(budget.used(), 99);
        drop(held);
        assert_eq!(budget.used(), 0);
    }
}
