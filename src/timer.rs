//! Sleeps that reuse one tokio timer per client connection instead of making one per request.
//!
//! A new tokio sleep finds the runtime's handle (a reference count every worker shares),
//! registers with the timer wheel when first polled (under the wheel's lock) and deregisters
//! when dropped (under it again). A plain request made two of them: hyper's header read
//! timeout and the upstream exchange's timeout. A sleep moved to a later deadline while it is
//! still registered costs one compare-and-swap instead: the wheel finds the later deadline when
//! the earlier one comes and files the entry again. [`Spare`] keeps a sleep between requests
//! for that. A client connection has two: one is hyper's timer for its request heads (hyper may
//! hold that sleep while a request runs, `server.rs`), the other times its body reads and
//! upstream exchanges (`ClientInfo::timer`).
//!
//! Invariants: a sleep has one user at a time (it is taken out of the spare while in use; a
//! second user at the same time, as on an h2 connection, gets a new one, and the spare keeps
//! one of them afterwards); a reused sleep fires at the deadline it was last given, as a new
//! one would.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// One connection's sleep between uses (see the module docs). Cloned by the connection's
/// requests, which share it.
#[derive(Clone, Debug, Default)]
pub struct Spare(Arc<Mutex<Option<Pin<Box<Sleep>>>>>);

impl Spare {
    /// A sleep until `deadline`: the spare one moved there, or a new one.
    pub fn sleep_until(&self, deadline: Instant) -> Recycled {
        let spare = self.0.lock().unwrap_or_else(|e| e.into_inner()).take();
        let sleep = match spare {
            Some(mut sleep) => {
                sleep.as_mut().reset(deadline);
                sleep
            }
            None => Box::pin(tokio::time::sleep_until(deadline)),
        };
        Recycled {
            sleep: Some(sleep),
            spare: self.clone(),
        }
    }
}

/// A sleep that goes back to its [`Spare`] when dropped.
pub struct Recycled {
    /// Always `Some` until dropped.
    sleep: Option<Pin<Box<Sleep>>>,
    spare: Spare,
}

impl Future for Recycled {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match self.sleep.as_mut() {
            Some(sleep) => sleep.as_mut().poll(cx),
            None => Poll::Ready(()),
        }
    }
}

impl Drop for Recycled {
    fn drop(&mut self) {
        if let Some(sleep) = self.sleep.take() {
            let mut spare = self.spare.0.lock().unwrap_or_else(|e| e.into_inner());
            if spare.is_none() {
                *spare = Some(sleep);
            }
        }
    }
}

impl hyper::rt::Sleep for Recycled {}

/// hyper's timer for one connection (its header read timeout): the connection's [`Spare`].
impl hyper::rt::Timer for Spare {
    fn sleep(&self, duration: Duration) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Spare::sleep_until(self, Instant::now() + duration))
    }

    fn sleep_until(&self, deadline: std::time::Instant) -> Pin<Box<dyn hyper::rt::Sleep>> {
        Box::pin(Spare::sleep_until(self, deadline.into()))
    }

    fn now(&self) -> std::time::Instant {
        Instant::now().into()
    }
}

/// `duration` passed before the future completed.
#[derive(Debug)]
pub struct Elapsed;

/// `fut`, or `Err(Elapsed)` when `duration` passes first (as `tokio::time::timeout`), timed
/// by `spare`'s sleep when one is given.
///
/// The deadline is taken now; the sleep is set only when `fut` first finds itself waiting, so
/// a future that is ready at once (a request body that came with its head) costs no timer.
///
/// A future of its own rather than an `async fn`: an `async fn` keeps its argument and the
/// pinned copy it polls both in its state, so every future that awaits this one would carry
/// `fut` twice, and every request's future is moved into place whole (hyper, `tokio::spawn`).
pub fn timeout<F: Future>(spare: Option<&Spare>, duration: Duration, fut: F) -> Timeout<'_, F> {
    Timeout {
        fut,
        deadline: Instant::now() + duration,
        spare,
        sleep: Deadline::Unset,
    }
}

pin_project_lite::pin_project! {
    /// The future [`timeout`] returns.
    pub struct Timeout<'a, F> {
        #[pin]
        fut: F,
        deadline: Instant,
        spare: Option<&'a Spare>,
        #[pin]
        sleep: Deadline,
    }
}

pin_project_lite::pin_project! {
    /// A [`Timeout`]'s sleep: none yet, a connection's reused one, or one of its own.
    #[project = DeadlineProj]
    enum Deadline {
        Unset,
        Spare { sleep: Recycled },
        Own { #[pin] sleep: Sleep },
    }
}

impl<F: Future> Future for Timeout<'_, F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        let had_budget = tokio::task::coop::has_budget_remaining();
        if let Poll::Ready(out) = this.fut.poll(cx) {
            return Poll::Ready(Ok(out));
        }
        // As `tokio::time::timeout`: a future that used up the task's budget would have the
        // sleep answer Pending for that reason alone, and one that always did so would never
        // time out. Its sleep is then polled outside the budget.
        let outside = had_budget && !tokio::task::coop::has_budget_remaining();
        if let Deadline::Unset = *this.sleep {
            this.sleep.set(match this.spare {
                Some(spare) => Deadline::Spare {
                    sleep: spare.sleep_until(*this.deadline),
                },
                None => Deadline::Own {
                    sleep: tokio::time::sleep_until(*this.deadline),
                },
            });
        }
        let elapsed = match this.sleep.project() {
            // Set just above.
            DeadlineProj::Unset => Poll::Pending,
            DeadlineProj::Spare { sleep } => poll_sleep(Pin::new(sleep), outside, cx),
            DeadlineProj::Own { sleep } => poll_sleep(sleep, outside, cx),
        };
        elapsed.map(|()| Err(Elapsed))
    }
}

/// Polls `sleep`, outside the task's budget when `outside`.
fn poll_sleep<S: Future<Output = ()>>(
    sleep: Pin<&mut S>,
    outside: bool,
    cx: &mut Context<'_>,
) -> Poll<()> {
    if outside {
        Pin::new(&mut tokio::task::coop::unconstrained(sleep)).poll(cx)
    } else {
        sleep.poll(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_reused_sleep_fires_at_its_new_deadline_not_its_old_one() {
        let spare = Spare::default();
        let mut first = spare.sleep_until(Instant::now() + Duration::from_secs(10));
        // Registered with the wheel by a poll, then given back.
        assert!(futures_poll(&mut first).is_pending());
        drop(first);
        assert!(spare.0.lock().unwrap().is_some(), "given back");
        // The same sleep, moved later while it is still registered for the earlier deadline
        // (the path every request after a connection's first takes).
        let started = Instant::now();
        let second = spare.sleep_until(Instant::now() + Duration::from_secs(30));
        assert!(spare.0.lock().unwrap().is_none(), "the spare one was taken");
        second.await;
        assert_eq!(started.elapsed(), Duration::from_secs(30));
    }

    #[tokio::test(start_paused = true)]
    async fn a_reused_sleep_moved_earlier_fires_at_the_earlier_deadline() {
        let spare = Spare::default();
        let mut first = spare.sleep_until(Instant::now() + Duration::from_secs(30));
        // Registered with the wheel by a poll, then given back.
        assert!(futures_poll(&mut first).is_pending());
        drop(first);
        let started = Instant::now();
        spare
            .sleep_until(Instant::now() + Duration::from_secs(5))
            .await;
        let took = started.elapsed();
        assert!(
            took >= Duration::from_secs(5) && took < Duration::from_secs(30),
            "{took:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn two_users_at_once_get_two_sleeps() {
        let spare = Spare::default();
        drop(spare.sleep_until(Instant::now()));
        let a = spare.sleep_until(Instant::now() + Duration::from_secs(1));
        let b = spare.sleep_until(Instant::now() + Duration::from_secs(2));
        let started = Instant::now();
        // Each fires at its own deadline: one sleep shared and moved to the later deadline
        // would end `a` at 2 s.
        a.await;
        assert_eq!(started.elapsed(), Duration::from_secs(1));
        assert!(spare.0.lock().unwrap().is_some(), "a's sleep went back");
        b.await;
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert!(spare.0.lock().unwrap().is_some(), "the spare keeps one");
    }

    #[tokio::test(start_paused = true)]
    async fn hypers_header_timer_sleeps_on_the_spare() {
        let spare = Spare::default();
        let started = Instant::now();
        hyper::rt::Timer::sleep(&spare, Duration::from_secs(2)).await;
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        assert!(spare.0.lock().unwrap().is_some(), "the sleep went back");
        let deadline = hyper::rt::Timer::now(&spare) + Duration::from_secs(3);
        hyper::rt::Timer::sleep_until(&spare, deadline).await;
        assert_eq!(started.elapsed(), Duration::from_secs(5));
        assert!(spare.0.lock().unwrap().is_some(), "and again");
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_on_the_spare_ends_a_slow_future_and_passes_a_fast_one() {
        let spare = Spare::default();
        let slow = sleep_bounded(Some(&spare), 1, 60).await;
        assert!(slow.is_err());
        let fast = timeout(Some(&spare), Duration::from_secs(10), async { 7 }).await;
        assert_eq!(fast.unwrap(), 7);
        // The first one's sleep, back in the spare (the second, ready at once, set none), is
        // moved later for the third, which needs its whole bound and gets it.
        let started = Instant::now();
        let third = sleep_bounded(Some(&spare), 5, 4).await;
        assert!(third.is_ok());
        assert!(started.elapsed() >= Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn a_timeout_without_a_spare_ends_a_slow_future_at_its_bound_and_passes_a_fast_one() {
        let started = Instant::now();
        let slow = sleep_bounded(None, 2, 60).await;
        assert!(slow.is_err());
        assert_eq!(started.elapsed(), Duration::from_secs(2));
        let fast = timeout(None, Duration::from_secs(10), async { 7 }).await;
        assert_eq!(fast.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_timeout_holds_its_future_once() {
        // What `timeout` is for (see its docs): the future it bounds is stored once, beside
        // a sleep, not twice as an `async fn`'s argument and pinned copy would be.
        let big = async {
            let buf = [0u8; 4096];
            tokio::task::yield_now().await;
            buf.len()
        };
        let bounded = timeout(None, Duration::from_secs(1), big);
        let (inner, outer) = (4096 + 8, std::mem::size_of_val(&bounded));
        assert!(outer < 2 * inner, "{outer} bytes for a {inner}-byte future");
    }

    #[tokio::test(start_paused = true)]
    async fn a_future_ready_at_once_sets_no_sleep_and_a_waiting_one_sets_it_once() {
        let spare = Spare::default();
        let ready = timeout(Some(&spare), Duration::from_secs(1), async { 7 }).await;
        assert_eq!(ready.unwrap(), 7);
        assert!(spare.0.lock().unwrap().is_none(), "no sleep was made");
        // One that waits takes the sleep at its first wait and keeps it through the next ones:
        // set again at each, it would take another and give the first back to the spare.
        drop(spare.sleep_until(Instant::now()));
        let waits = async {
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
            tokio::time::sleep(Duration::from_secs(60)).await;
        };
        let mut bounded = Box::pin(timeout(Some(&spare), Duration::from_secs(3), waits));
        let waker = std::task::Waker::noop();
        for _ in 0..4 {
            assert!(
                bounded
                    .as_mut()
                    .poll(&mut Context::from_waker(waker))
                    .is_pending()
            );
            assert!(spare.0.lock().unwrap().is_none(), "one sleep, taken once");
        }
        let started = Instant::now();
        assert!(bounded.as_mut().await.is_err());
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        drop(bounded);
        assert!(spare.0.lock().unwrap().is_some(), "the sleep went back");
    }

    #[tokio::test]
    async fn a_future_that_uses_up_the_tasks_budget_still_times_out() {
        // Each poll of `busy` spends the task's whole budget: a sleep polled within it after
        // that answers Pending whatever the time. The outer bound is tokio's own timeout, which
        // handles this, so that a failure ends instead of hanging.
        for spare in [None, Some(Spare::default())] {
            let busy = async {
                loop {
                    tokio::task::coop::consume_budget().await;
                }
            };
            let bounded = timeout(spare.as_ref(), Duration::from_millis(20), busy);
            let ended = tokio::time::timeout(Duration::from_secs(10), bounded).await;
            assert!(
                matches!(ended, Ok(Err(Elapsed))),
                "the bound never fired (spare: {})",
                spare.is_some()
            );
        }
    }

    /// A timeout of `bound` seconds around a sleep of `takes` seconds.
    async fn sleep_bounded(spare: Option<&Spare>, bound: u64, takes: u64) -> Result<(), Elapsed> {
        let sleep = tokio::time::sleep(Duration::from_secs(takes));
        timeout(spare, Duration::from_secs(bound), sleep).await
    }

    fn futures_poll(fut: &mut Recycled) -> Poll<()> {
        let waker = std::task::Waker::noop();
        Pin::new(fut).poll(&mut Context::from_waker(waker))
    }
}
