//! What a serving thread does when it wakes up (`server.yield_on_wake`): if nothing the
//! gateway waits for is in flight, it first lets the task it woke up beside run, so that
//! requests that arrive together are answered in one pass.
//!
//! Why: under Linux's default policy a thread woken by a readable socket usually preempts
//! the task that wrote to it. When the client shares the cores (a load generator, a caller
//! on the same host), that task is the client itself, in the middle of writing its requests:
//! the woken thread answers the one request it finds, sleeps again, and the client resumes to
//! write the next, a pair of context switches for every request or two. A thread that yields
//! first lets the client finish writing and block, and then finds the requests all ready.
//! `SCHED_BATCH` has the same effect (docs/operations.md, "CPU scheduling") but must be set
//! by the operator, and costs tail latency when the cores are busy; the yield stops itself
//! there (below). Measured on replays from memory with the client on the same two cores:
//! 15 to 34% more replays a second, 13 to 19% less CPU each (BENCHMARKS.md, "a woken serving
//! thread yields once").
//!
//! When a yield would not pay, and what stops it:
//! - **Something the gateway waits for is in flight.** The wake-up may be the upstream's
//!   response or the store's answer, which a client waits for; yielding would only delay it.
//!   [`InFlight`] counts, process-wide, the forwards waiting for their response (a plain
//!   forward's head; a keyed forward's head and the body it reads whole) and the store round
//!   trips and waits of keyed requests (claim, waiting for an in-flight key, recording with
//!   its retries, a `serialize` slot taken and given back); a thread yields only while the
//!   count is zero, as in a retry storm answered from memory. (A plain forward's body, which
//!   streams to the client after its head, is not counted.)
//! - **A busy neighbour takes the core for its whole slice.** The requests that woke the
//!   thread then wait milliseconds. A yield that took [`SLOW_YIELD`] or more is slow (a
//!   scheduler slice is 0.75 to 3 ms; a client that shares the cores lets a yield last 20 to
//!   400 µs, measured on the shared perf harness's replays: p10 21, p50 215, p99 361 µs, 4 in
//!   10,000 over a millisecond). Once a window of yields ([`WINDOW`]) holds [`SLOW_IN_WINDOW`]
//!   slow ones, or has taken [`SLOW_BUDGET`] in all (a neighbour whose turns stay under a
//!   slice but add up), every serving thread stops yielding for [`PAUSE`] and
//!   `idemgate_yield_pauses_total` counts it: a few slow yields a second at most, instead of
//!   one per wake-up. A first rule judged the window by its total alone (20 ms): a client's
//!   turns at 215 µs already spent two thirds of it, and a slower minute of the machine
//!   paused the yields it was there for. The threads are judged together: when one stops
//!   yielding, the client it no longer yields to keeps running, and the others' yields grow
//!   longer, so threads judged one by one would pause each other.
//! - **Nothing else wants the core** (the client is on another host): the yield returns at
//!   once. That costs a system call, about 0.5 µs, once per wake-up with nothing in flight.
//!   It is not stopped: a rule that paused yielding after futile windows also paused it, in
//!   measurements, while the threads were finding their way to the cores the client runs on.
//!
//! Installed with `server.runtime: thread_per_core` only: there a task never leaves its
//! thread, so the hook runs where the wake-up happened.

use prometheus_client::metrics::counter::Counter;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::{Duration, Instant};

/// Forwards waiting for their response, and store round trips and waits of keyed requests,
/// across the process (the module docs list them). Relaxed: it only decides whether a yield is worth trying.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// Counts one wait of the gateway (a forward, a store round trip) while it lives.
#[must_use = "counts only while held"]
pub struct InFlight(());

impl InFlight {
    pub fn start() -> InFlight {
        IN_FLIGHT.fetch_add(1, Ordering::Relaxed);
        InFlight(())
    }

    /// How many are in flight now.
    pub fn count() -> usize {
        IN_FLIGHT.load(Ordering::Relaxed)
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Yields judged together.
pub const WINDOW: u32 = 64;
/// A yield this long let a neighbour run a scheduler slice.
pub const SLOW_YIELD: Duration = Duration::from_millis(1);
/// Slow yields a window may hold.
pub const SLOW_IN_WINDOW: u32 = 8;
/// The time a window's yields may take in all: 625 µs each.
pub const SLOW_BUDGET: Duration = Duration::from_millis(40);
/// How long the threads stop yielding once a window's yields took too long.
pub const PAUSE: Duration = Duration::from_secs(5);

/// The serving threads' recent yields.
#[derive(Debug, Default)]
pub struct Yields {
    timed: u32,
    slow: u32,
    spent: Duration,
}

/// What the record says after one more yield.
#[derive(Debug, PartialEq, Eq)]
pub enum Verdict {
    Keep,
    /// The window holds [`SLOW_IN_WINDOW`] slow yields, or its yields took more than
    /// [`SLOW_BUDGET`]: stop for [`PAUSE`].
    Pause,
}

impl Yields {
    /// Adds one yield that took `took`.
    pub fn record(&mut self, took: Duration) -> Verdict {
        self.timed += 1;
        self.slow += u32::from(took >= SLOW_YIELD);
        self.spent += took;
        if self.slow >= SLOW_IN_WINDOW || self.spent > SLOW_BUDGET {
            *self = Yields::default();
            return Verdict::Pause;
        }
        if self.timed == WINDOW {
            *self = Yields::default();
        }
        Verdict::Keep
    }
}

static YIELDS: Mutex<Yields> = Mutex::new(Yields {
    timed: 0,
    slow: 0,
    spent: Duration::ZERO,
});
static PAUSES: OnceLock<Counter> = OnceLock::new();

/// The process's count of pauses (`idemgate_yield_pauses_total`): every handle shares it.
pub fn pauses() -> Counter {
    PAUSES.get_or_init(Counter::default).clone()
}
/// Until when yielding is paused, in nanoseconds since [`EPOCH`]; 0: never paused.
static PAUSED_UNTIL: AtomicU64 = AtomicU64::new(0);
static EPOCH: OnceLock<Instant> = OnceLock::new();

/// The runtime's `on_thread_unpark` hook: yields once if nothing is in flight and yielding
/// is not paused.
pub fn on_wake() {
    if InFlight::count() != 0 {
        return;
    }
    let epoch = *EPOCH.get_or_init(Instant::now);
    let paused_until = PAUSED_UNTIL.load(Ordering::Relaxed);
    if paused_until != 0 && nanos_since(epoch) < paused_until {
        return;
    }
    let started = Instant::now();
    std::thread::yield_now();
    note(started.elapsed(), epoch);
}

/// Records one yield that took `took`, and pauses yielding if the window says so.
fn note(took: Duration, epoch: Instant) {
    // `record` cannot panic: a poisoned lock still holds a whole record.
    let mut yields = YIELDS.lock().unwrap_or_else(PoisonError::into_inner);
    if yields.record(took) == Verdict::Pause {
        let until = nanos_since(epoch).saturating_add(PAUSE.as_nanos() as u64);
        PAUSED_UNTIL.store(until, Ordering::Relaxed);
        pauses().inc();
    }
}

fn nanos_since(epoch: Instant) -> u64 {
    u64::try_from(epoch.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(yields: &mut Yields, took: Duration, n: u32) -> Vec<Verdict> {
        (0..n).map(|_| yields.record(took)).collect()
    }

    #[test]
    fn yields_that_let_the_client_run_briefly_keep_going() {
        let mut y = Yields::default();
        // The client ran for 110 µs, then blocked: ten windows, never a pause.
        let v = feed(&mut y, Duration::from_micros(110), 10 * WINDOW);
        assert!(v.iter().all(|v| *v == Verdict::Keep));
    }

    #[test]
    fn futile_yields_keep_going() {
        let mut y = Yields::default();
        let v = feed(&mut y, Duration::from_nanos(500), 10 * WINDOW);
        assert!(v.iter().all(|v| *v == Verdict::Keep));
    }

    #[test]
    fn a_neighbours_whole_slices_pause_at_the_eighth() {
        let mut y = Yields::default();
        // A busy loop's slice: the eighth such yield pauses, after 11 ms in all.
        let v = feed(&mut y, Duration::from_micros(1400), SLOW_IN_WINDOW);
        assert!(v[..7].iter().all(|v| *v == Verdict::Keep));
        assert_eq!(v[7], Verdict::Pause);
        // And the record starts afresh.
        assert_eq!(y.record(Duration::from_micros(1400)), Verdict::Keep);
    }

    #[test]
    fn slices_among_a_clients_turns_pause_too() {
        let mut y = Yields::default();
        // A neighbour that wins one wake-up in three: the eighth slice pauses.
        let mut verdicts = Vec::new();
        for _ in 0..8 {
            verdicts.extend(feed(&mut y, Duration::from_micros(200), 2));
            verdicts.push(y.record(Duration::from_millis(2)));
        }
        assert_eq!(verdicts.iter().filter(|v| **v == Verdict::Pause).count(), 1);
        assert_eq!(verdicts.last(), Some(&Verdict::Pause));
    }

    #[test]
    fn a_clients_longer_turns_do_not_pause() {
        let mut y = Yields::default();
        // 320 µs each, window after window: 20.5 ms a window, which the first rule (a 20 ms
        // total) paused on; a client's turns on a slower machine look like this.
        let v = feed(&mut y, Duration::from_micros(320), 10 * WINDOW);
        assert!(v.iter().all(|v| *v == Verdict::Keep));
        // Nor do 600 µs ones (38.4 ms a window), or seven slices in a window.
        let v = feed(&mut y, Duration::from_micros(600), 10 * WINDOW);
        assert!(v.iter().all(|v| *v == Verdict::Keep));
        for _ in 0..10 {
            let v = feed(&mut y, Duration::from_millis(2), SLOW_IN_WINDOW - 1);
            assert!(v.iter().all(|v| *v == Verdict::Keep));
            let v = feed(
                &mut y,
                Duration::from_micros(150),
                WINDOW - (SLOW_IN_WINDOW - 1),
            );
            assert!(v.iter().all(|v| *v == Verdict::Keep));
        }
    }

    #[test]
    fn turns_that_add_up_past_the_budget_pause() {
        let mut y = Yields::default();
        // 900 µs turns, under a slice each: the budget stops them at the 45th (40.5 ms).
        let v = feed(&mut y, Duration::from_micros(900), 45);
        assert!(v[..44].iter().all(|v| *v == Verdict::Keep));
        assert_eq!(v[44], Verdict::Pause);
    }

    #[test]
    fn a_pause_stops_the_yields_and_is_counted() {
        let epoch = *EPOCH.get_or_init(Instant::now);
        let before = pauses().get();
        // Eight slow yields pause; a few more in case another test's yields closed the
        // window in between (the record is the process's).
        for _ in 0..WINDOW {
            note(Duration::from_millis(2), epoch);
            if pauses().get() > before {
                break;
            }
        }
        assert!(pauses().get() > before, "the pause is counted");
        let until = PAUSED_UNTIL.load(Ordering::Relaxed);
        assert!(until > nanos_since(epoch), "yielding is paused for a while");
    }

    #[test]
    fn in_flight_counts_while_held() {
        let before = InFlight::count();
        let a = InFlight::start();
        let b = InFlight::start();
        assert_eq!(InFlight::count(), before + 2);
        drop(a);
        drop(b);
        assert_eq!(InFlight::count(), before);
    }
}
