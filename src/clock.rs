//! Time, injected.
//!
//! Every wait the middleware makes, and every reading of "now" that decides whether to wait, goes
//! through a [`Clock`]. In production that is [`TokioClock`]. In tests it is `FakeClock` (feature
//! `test-util`): its sleeps finish at once, advance virtual time and are recorded, so a schedule
//! with minutes of backoff runs in microseconds and can be asserted to the nanosecond.
//!
//! Per-attempt timeouts are deliberately *not* on this clock: they are enforced on the wire by
//! reqwest, in real time. A fake clock that raced real I/O would fire the timeout before the
//! server could answer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// The future a [`Clock`] returns from [`Clock::sleep`].
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// A source of time: a monotonic "now" for deadlines, a wall "now" for HTTP dates, and sleeping.
///
/// Implement it to drive the middleware from your own timer:
///
/// ```
/// use std::time::{Duration, Instant, SystemTime};
/// use reqwest_safe_retry::{Clock, Sleep};
///
/// /// A clock whose sleeps return at once, for a service's own tests.
/// #[derive(Debug)]
/// struct Impatient;
///
/// impl Clock for Impatient {
///     fn now(&self) -> Instant { Instant::now() }
///     fn wall_now(&self) -> SystemTime { SystemTime::now() }
///     fn sleep(&self, _: Duration) -> Sleep { Box::pin(async {}) }
/// }
///
/// // The middleware keeps clocks as trait objects.
/// let _clock: Box<dyn Clock> = Box::new(Impatient);
/// ```
pub trait Clock: Send + Sync + 'static {
    /// The current monotonic instant; deadlines are measured on it.
    fn now(&self) -> Instant;
    /// The current wall-clock time; `Retry-After` dates are read against it.
    fn wall_now(&self) -> SystemTime;
    /// A future that completes once `duration` has passed on this clock.
    fn sleep(&self, duration: Duration) -> Sleep;
}

/// The production clock: tokio's timer and the system's wall clock.
///
/// Its monotonic time is tokio's, so it follows a runtime whose clock is paused
/// (`tokio::time::pause`), as tokio's own timers do.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub struct TokioClock;

impl TokioClock {
    /// Creates the production clock.
    pub const fn new() -> Self {
        TokioClock
    }
}

impl Clock for TokioClock {
    fn now(&self) -> Instant {
        tokio::time::Instant::now().into_std()
    }

    fn wall_now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, duration: Duration) -> Sleep {
        if duration.is_zero() {
            // tokio's timer ticks in milliseconds: a zero sleep would still wait for the next
            // tick. Yielding lets other tasks run without that wait.
            return Box::pin(tokio::task::yield_now());
        }
        Box::pin(tokio::time::sleep(duration))
    }
}

/// The clock as the middleware stores it: shared, with a `Debug` that does not require one from
/// the user's type.
#[derive(Clone)]
pub(crate) struct SharedClock(pub(crate) Arc<dyn Clock>);

impl fmt::Debug for SharedClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Clock")
    }
}

#[cfg(feature = "test-util")]
pub use fake::FakeClock;

#[cfg(feature = "test-util")]
mod fake {
    use super::{Clock, Sleep};
    use std::sync::{Arc, Mutex, MutexGuard};
    use std::time::{Duration, Instant, SystemTime};

    /// A virtual clock for tests: sleeping advances it at once and is recorded.
    ///
    /// Clones share the same time and the same record, so keep one clone to inspect after handing
    /// another to the middleware. All sleeps, from every request, advance one timeline.
    ///
    /// Its wall time starts at 2026-01-01T00:00:00Z, the same on every run, and moves with every
    /// sleep and [`advance`](FakeClock::advance); [`set_wall_time`](FakeClock::set_wall_time)
    /// moves it for `Retry-After` dates.
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
    #[derive(Debug, Clone)]
    pub struct FakeClock {
        inner: Arc<Mutex<State>>,
    }

    #[derive(Debug)]
    struct State {
        origin: Instant,
        elapsed: Duration,
        wall: SystemTime,
        sleeps: Vec<Duration>,
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
                })),
            }
        }

        fn state(&self) -> MutexGuard<'_, State> {
            // A panic while holding this lock cannot leave the state half-updated, so a
            // poisoned lock is still good to read.
            self.inner.lock().unwrap_or_else(|e| e.into_inner())
        }

        /// Every sleep requested so far, in order.
        pub fn sleeps(&self) -> Vec<Duration> {
            self.state().sleeps.clone()
        }

        /// The sum of every sleep requested so far (saturating).
        pub fn total_slept(&self) -> Duration {
            self.state()
                .sleeps
                .iter()
                .fold(Duration::ZERO, |acc, d| acc.saturating_add(*d))
        }

        /// Virtual time passed since the clock was created: sleeps plus manual advances.
        pub fn elapsed(&self) -> Duration {
            self.state().elapsed
        }

        /// Moves time forward without recording a sleep, as if work had taken `by`.
        pub fn advance(&self, by: Duration) {
            let mut state = self.state();
            state.elapsed = state.elapsed.saturating_add(by);
            state.wall = state.wall.checked_add(by).unwrap_or(state.wall);
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
            // An `Instant` cannot hold every `Duration`: virtual time stops advancing a century
            // in, rather than overflowing.
            const CENTURY: Duration = Duration::from_secs(100 * 365 * 24 * 3600);
            state.origin + state.elapsed.min(CENTURY)
        }

        fn wall_now(&self) -> SystemTime {
            self.state().wall
        }

        fn sleep(&self, duration: Duration) -> Sleep {
            {
                let mut state = self.state();
                state.sleeps.push(duration);
                state.elapsed = state.elapsed.saturating_add(duration);
                state.wall = state.wall.checked_add(duration).unwrap_or(state.wall);
            }
            Box::pin(std::future::ready(()))
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

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
            assert_eq!(clock.total_slept(), Duration::from_millis(601_500));
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

        #[test]
        fn huge_sleeps_saturate_instead_of_panicking() {
            let clock = FakeClock::new();
            drop(clock.sleep(Duration::MAX));
            drop(clock.sleep(Duration::MAX));
            assert_eq!(clock.elapsed(), Duration::MAX);
            assert_eq!(clock.total_slept(), Duration::MAX);
            let _ = clock.now();
        }
    }
}
