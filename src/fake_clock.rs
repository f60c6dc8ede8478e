//! The virtual clock for tests (feature `test-util`): sleeps finish at once, advance its time
//! and are recorded; its timeouts fire only when that time reaches them.

use crate::clock::{Clock, Sleep};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime};

use crate::clock::Instant;

/// A virtual clock for tests: sleeping advances it at once and is recorded.
///
/// Clones share the same time and the same record, so keep one clone to inspect after handing
/// another to the middleware. All sleeps, from every request, advance one timeline.
///
/// Its [`timeout`](Clock::timeout)s (the middleware's per-attempt timeouts) fire when virtual
/// time reaches them, never on their own: an attempt waiting for a real server is cut only
/// when a test moves the time, with [`advance`](FakeClock::advance) or through another
/// request's sleep. It never reads real time beyond its creation, and needs no tokio timer.
///
/// # Wall time
///
/// Its wall time (what `Retry-After` dates are read against) starts at 2026-01-01T00:00:00Z,
/// the same on every run, and moves with every sleep and [`advance`](FakeClock::advance). A
/// test whose server builds a date from the real clock (`SystemTime::now() + 5 s`, formatted
/// as an HTTP-date) must first set the fake one to match with
/// [`set_wall_time`](FakeClock::set_wall_time): otherwise the date reads as years away, and the
/// request stops with [`StopReason::RetryAfterTooLong`](crate::StopReason::RetryAfterTooLong).
///
/// ```
/// use std::time::SystemTime;
/// use reqwest_safe_retry::{Clock, FakeClock};
///
/// let clock = FakeClock::new();
/// let now = SystemTime::now();
/// clock.set_wall_time(now);
/// assert_eq!(clock.wall_now(), now);
/// ```
///
/// # Sleeps
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::{Clock, FakeClock};
///
/// # #[tokio::main(flavor = "current_thread")]
/// # async fn main() {
/// let clock = FakeClock::new();
/// let start = clock.now();
/// clock.sleep(Duration::from_secs(90)).await; // returns at once
/// assert_eq!(clock.now() - start, Duration::from_secs(90));
/// assert_eq!(clock.sleeps(), vec![Duration::from_secs(90)]);
/// # }
/// ```
///
/// # Concurrent requests
///
/// What it cannot express: waits that overlap. Its time is one line that each sleep moves at
/// once, so requests waiting side by side (held by one spent quota, say, or each told
/// `Retry-After: 2`) come back one after another, each sleep starting where the last ended:
/// [`sleeps`](FakeClock::sleeps) shows every wait, but its time does not show when each
/// request went. For that, keep the default [`TokioClock`](crate::TokioClock) and run under
/// tokio's paused clock (`#[tokio::test(start_paused = true)]`, tokio's `test-util` feature):
/// the waits overlap in virtual time, and tokio moves it to the earliest.
///
/// ```
/// use std::time::Duration;
/// use reqwest_middleware::ClientBuilder;
/// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
/// use wiremock::{matchers::any, Mock, MockServer, ResponseTemplate};
///
/// // In your tests: #[tokio::test(start_paused = true)]
/// # #[tokio::main(flavor = "current_thread", start_paused = true)]
/// # async fn main() {
/// let server = MockServer::start().await;
/// let busy = ResponseTemplate::new(503).insert_header("retry-after", "2");
/// Mock::given(any()).respond_with(busy).up_to_n_times(3).mount(&server).await;
/// Mock::given(any()).respond_with(ResponseTemplate::new(200)).mount(&server).await;
/// // No jitter above the floor: each wait is the 2 s the server asked for.
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryPolicy::default()).with_rng(|| 0u64))
///     .build();
///
/// let start = tokio::time::Instant::now();
/// let send = || client.get(server.uri()).send();
/// let (a, b, c) = tokio::join!(send(), send(), send());
/// assert!([a, b, c].iter().all(|r| r.as_ref().is_ok_and(|r| r.status() == 200)));
/// // Three waits of 2 s, side by side: 2 s of virtual time, not 6.
/// assert!(start.elapsed() >= Duration::from_secs(2));
/// assert!(start.elapsed() < Duration::from_millis(2_050));
/// # }
/// ```
#[derive(Debug, Clone)]
#[cfg_attr(docsrs, doc(cfg(feature = "test-util")))]
pub struct FakeClock {
    inner: Arc<Mutex<State>>,
}

#[derive(Debug)]
struct State {
    origin: Instant,
    elapsed: Duration,
    wall: SystemTime,
    sleeps: Vec<Duration>,
    /// Tasks waiting on a timeout, woken whenever time moves.
    waiting: Vec<Waker>,
}

impl State {
    /// Moves time forward by `by`; returns the tasks to wake, to be woken without the lock.
    ///
    /// # Panics
    ///
    /// When the monotonic or the wall time would pass the latest this platform can hold: a
    /// clock that stopped there instead would freeze every deadline.
    fn pass(&mut self, by: Duration) -> Vec<Waker> {
        let moved = self
            .elapsed
            .checked_add(by)
            .filter(|elapsed| self.origin.checked_add(*elapsed).is_some());
        let (Some(elapsed), Some(wall)) = (moved, self.wall.checked_add(by)) else {
            panic!(
                "FakeClock moved by {by:?} past the latest time this platform can hold \
                 ({:?} in already): move it by less (any span up to billions of years on \
                 64-bit Unix works)",
                self.elapsed
            );
        };
        self.elapsed = elapsed;
        self.wall = wall;
        std::mem::take(&mut self.waiting)
    }
}

/// 2026-01-01T00:00:00Z.
const DEFAULT_WALL_SECS: u64 = 1_767_225_600;

impl FakeClock {
    /// Creates a clock at virtual time zero, with the wall clock at 2026-01-01T00:00:00Z.
    pub fn new() -> Self {
        FakeClock {
            inner: Arc::new(Mutex::new(State {
                origin: Instant::now(),
                elapsed: Duration::ZERO,
                wall: SystemTime::UNIX_EPOCH + Duration::from_secs(DEFAULT_WALL_SECS),
                sleeps: Vec::new(),
                waiting: Vec::new(),
            })),
        }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock cannot leave the state half-updated, so a
        // poisoned lock is still good to read.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Every sleep requested so far on this clock, by every request, in order: the schedule
    /// as the clock saw it. For one request's total wait, read its
    /// [`RetryRecord::waited`](crate::RetryRecord::waited); for each wait as it is decided,
    /// with the attempt it follows, the observer's [`RetryEvent::delay`](crate::RetryEvent::delay).
    pub fn sleeps(&self) -> Vec<Duration> {
        self.state().sleeps.clone()
    }

    /// Virtual time passed since the clock was created: sleeps plus manual advances.
    pub fn elapsed(&self) -> Duration {
        self.state().elapsed
    }

    /// Moves time forward without recording a sleep, as if work had taken `by`.
    ///
    /// Time moves by any span (a test may jump 150 years and every deadline still holds),
    /// up to the latest time the platform's `Instant` and `SystemTime` can hold.
    ///
    /// # Panics
    ///
    /// When `by` would move the clock past that latest time (on 64-bit Unix, hundreds of
    /// billions of years: `Duration::MAX` does): the clock refuses, rather than stopping there
    /// and freezing every deadline. So does a sleep that long.
    pub fn advance(&self, by: Duration) {
        let waiting = self.state().pass(by);
        waiting.into_iter().for_each(Waker::wake);
    }

    /// Sets the wall-clock time; monotonic time is unchanged.
    pub fn set_wall_time(&self, wall: SystemTime) {
        self.state().wall = wall;
    }

    /// Forgets the recorded sleeps; time stays where it is.
    pub fn clear_sleeps(&self) {
        self.state().sleeps.clear();
    }
}

impl Default for FakeClock {
    fn default() -> Self {
        FakeClock::new()
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Instant {
        let state = self.state();
        // `pass` keeps every elapsed time within what an `Instant` holds.
        state.origin + state.elapsed
    }

    fn wall_now(&self) -> SystemTime {
        self.state().wall
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        let waiting = {
            let mut state = self.state();
            let waiting = state.pass(duration);
            state.sleeps.push(duration);
            waiting
        };
        waiting.into_iter().for_each(Waker::wake);
        Box::pin(std::future::ready(()))
    }

    fn timeout(&self, duration: Duration) -> Sleep {
        let fires_at = self.state().elapsed.saturating_add(duration);
        Box::pin(Timeout {
            clock: self.clone(),
            fires_at,
        })
    }
}

/// A timeout on virtual time: ready once the clock's elapsed time reaches `fires_at`.
struct Timeout {
    clock: FakeClock,
    fires_at: Duration,
}

impl Future for Timeout {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut state = self.clock.state();
        if state.elapsed >= self.fires_at {
            return Poll::Ready(());
        }
        if !state.waiting.iter().any(|w| w.will_wake(cx.waker())) {
            state.waiting.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sum of every sleep recorded (saturating).
    fn total_slept(clock: &FakeClock) -> Duration {
        clock
            .sleeps()
            .iter()
            .fold(Duration::ZERO, |acc, d| acc.saturating_add(*d))
    }

    #[tokio::test]
    async fn sleeping_advances_both_clocks_and_is_recorded() {
        let clock = FakeClock::new();
        let (start, wall) = (clock.now(), clock.wall_now());
        clock.sleep(Duration::from_millis(1500)).await;
        clock.sleep(Duration::from_secs(600)).await;
        assert_eq!(clock.now() - start, Duration::from_millis(601_500));
        assert_eq!(
            clock.wall_now().duration_since(wall).unwrap(),
            Duration::from_millis(601_500)
        );
        assert_eq!(
            clock.sleeps(),
            vec![Duration::from_millis(1500), Duration::from_secs(600)]
        );
        assert_eq!(total_slept(&clock), Duration::from_millis(601_500));
    }

    #[test]
    fn advance_moves_time_without_recording_a_sleep() {
        let clock = FakeClock::new();
        let start = clock.now();
        clock.advance(Duration::from_secs(3));
        assert_eq!(clock.now() - start, Duration::from_secs(3));
        assert_eq!(clock.elapsed(), Duration::from_secs(3));
        assert!(clock.sleeps().is_empty());
    }

    #[test]
    fn wall_time_starts_at_a_fixed_date_and_can_be_set() {
        let clock = FakeClock::new();
        assert_eq!(
            httpdate::fmt_http_date(clock.wall_now()),
            "Thu, 01 Jan 2026 00:00:00 GMT"
        );
        let later = SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000);
        clock.set_wall_time(later);
        assert_eq!(clock.wall_now(), later);
    }

    #[tokio::test]
    async fn a_timeout_fires_only_when_virtual_time_reaches_it() {
        let clock = FakeClock::new();
        let mut timeout = clock.timeout(Duration::from_secs(5));
        let mut poll = || {
            let waker = std::task::Waker::noop();
            timeout
                .as_mut()
                .poll(&mut std::task::Context::from_waker(waker))
                .is_ready()
        };
        assert!(!poll(), "no time has passed");
        clock.advance(Duration::from_secs(4));
        assert!(!poll(), "4 s of 5");
        clock.sleep(Duration::from_secs(1)).await;
        assert!(poll(), "another request's sleep moved time to 5 s");
        assert_eq!(clock.sleeps(), vec![Duration::from_secs(1)]);
    }

    #[tokio::test]
    async fn moving_time_wakes_the_task_waiting_on_a_timeout() {
        let clock = FakeClock::new();
        let timeout = clock.timeout(Duration::from_millis(10));
        let mover = clock.clone();
        let waiting = tokio::spawn(timeout);
        tokio::task::yield_now().await;
        mover.advance(Duration::from_millis(10));
        // Bounded: a timeout that is never woken fails here instead of hanging.
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the timeout was woken")
            .unwrap();
    }

    #[test]
    fn a_move_of_150_years_moves_both_times_by_150_years() {
        let clock = FakeClock::new();
        let (start, wall) = (clock.now(), clock.wall_now());
        let years = Duration::from_secs(150 * 365 * 24 * 3600);
        clock.advance(years);
        drop(clock.sleep(Duration::from_secs(30)));
        let moved = years + Duration::from_secs(30);
        assert_eq!(clock.now() - start, moved);
        assert_eq!(clock.wall_now().duration_since(wall).unwrap(), moved);
    }

    #[test]
    fn a_move_past_the_latest_time_is_refused_and_leaves_the_clock_as_it_was() {
        let clock = FakeClock::new();
        clock.advance(Duration::from_secs(5));
        let moving = clock.clone();
        let refused = std::panic::catch_unwind(move || moving.advance(Duration::MAX));
        let message = *refused.unwrap_err().downcast::<String>().unwrap();
        assert!(message.contains("past the latest time"), "{message}");
        assert!(message.contains("move it by less"), "{message}");
        let sleeping = clock.clone();
        assert!(std::panic::catch_unwind(move || drop(sleeping.sleep(Duration::MAX))).is_err());
        assert_eq!(clock.elapsed(), Duration::from_secs(5));
        assert!(clock.sleeps().is_empty(), "a refused sleep is not recorded");
    }

    #[test]
    fn clearing_the_record_keeps_the_time() {
        let clock = FakeClock::new();
        drop(clock.sleep(Duration::from_secs(2)));
        clock.clear_sleeps();
        assert!(clock.sleeps().is_empty());
        assert_eq!(total_slept(&clock), Duration::ZERO);
        assert_eq!(clock.elapsed(), Duration::from_secs(2));
    }
}
