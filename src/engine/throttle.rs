//! Client-side adaptive throttling: fewer attempts reach a dependency that is turning them away.
//!
//! The retry budget bounds what retries add; during an overload, first attempts still arrive at
//! the full offered rate. An [`AdaptiveThrottle`] counts, over a trailing window, the attempts
//! asked of a dependency (`requests`) and those it accepted (`accepts`), and rejects an attempt
//! locally, before anything is sent, with probability
//!
//! ```text
//! max(0, (requests - K * accepts) / (requests + 1))
//! ```
//!
//! the rule of Google's SRE book ("Handling Overload"). While the dependency accepts more than
//! one in K attempts nothing is rejected; past that, the client sheds the excess itself, and the
//! dependency sees about K times what it can accept, which leaves it room to recover. Attempts
//! rejected locally count as requests too, so the probability settles instead of swinging.
//!
//! An attempt counts as accepted when the dependency answered with a status outside the policy's
//! retryable set (408, 429, 502, 503 and 504 by default); a timeout, a connection error, one of those
//! statuses, or an attempt on the wire when its caller gave up counts as turned away. An attempt
//! rejected here, or never sent, counts as nothing beyond the rejection.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::clock::Instant;

use crate::error::InvalidConfig;
use crate::rng::{RandomSource, uniform_duration};

/// The area named in this module's configuration errors.
const THROTTLE: &str = "adaptive throttle";

/// How many slices the trailing window is counted in: the window slides one slice at a time.
const SLICES: usize = 12;

/// Client-side adaptive throttling for one dependency. Clones share one account, as clones of a
/// [`RetryBudget`](crate::RetryBudget) do.
///
/// Over a trailing window, it counts the attempts asked of the dependency (`requests`) and
/// those it accepted (`accepts`: any answer with a status outside the policy's retryable set; a
/// timeout, a connection error or an attempt its caller gave up on is not one), and rejects an attempt locally with probability
/// `max(0, (requests - K * accepts) / (requests + 1))`, the rule of Google's SRE book
/// ("Handling Overload"). While the dependency accepts more than one in K attempts nothing is
/// rejected; past that, the client sheds the excess itself. Rejected attempts count as requests
/// too, so the probability settles instead of swinging.
///
/// Off unless a dependency is given one
/// ([`Dependency::with_throttle`](crate::Dependency::with_throttle)). It composes with
/// the budget: the budget bounds retries, the throttle bounds every attempt, first attempts
/// included. An attempt it rejects never reaches the network: a first attempt fails with
/// [`StopReason::Throttled`](crate::StopReason::Throttled) and 0 attempts, a retry stops the
/// request with that reason and the last outcome.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::{AdaptiveThrottle, Dependency, RetryPolicy};
///
/// let throttle = AdaptiveThrottle::builder()
///     .window(Duration::from_secs(60))
///     .k(2.0)
///     .build()?;
/// let payments = Dependency::new("payments", RetryPolicy::default()).with_throttle(throttle);
/// # drop(payments);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone)]
pub struct AdaptiveThrottle {
    inner: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    k: f64,
    slice: Duration,
    window: Mutex<Window>,
}

/// The counts of the trailing window, a slice at a time.
#[derive(Debug)]
struct Window {
    /// `(requests, accepts)` per slice; `newest` is the slice that holds `newest_start`.
    slices: [(u64, u64); SLICES],
    /// The sums over `slices`, kept as slices fill and empty.
    totals: (u64, u64),
    newest: usize,
    /// When the newest slice began; `None` before the first count.
    newest_start: Option<Instant>,
    /// When the newest slice ends (meaningless before the first count).
    newest_end: Instant,
}

/// When a slice that began at `start` ends: kept to spare the division on most calls.
fn slice_end(start: Instant, slice: Duration) -> Instant {
    start + slice
}

impl Window {
    /// Moves the window to `now`: slices that fell out of it are emptied.
    fn slide(&mut self, now: Instant, slice: Duration) {
        let Some(start) = self.newest_start else {
            self.newest_start = Some(now);
            self.newest_end = slice_end(now, slice);
            return;
        };
        if now < self.newest_end {
            // Still in the newest slice, as nearly every call is: one comparison.
            return;
        }
        let elapsed = now.saturating_duration_since(start);
        let steps = (elapsed.as_nanos() / slice.as_nanos().max(1)).min(SLICES as u128) as usize;
        for _ in 0..steps {
            self.newest = (self.newest + 1) % SLICES;
            let (requests, accepts) = std::mem::take(&mut self.slices[self.newest]);
            self.totals.0 -= requests;
            self.totals.1 -= accepts;
        }
        // Whole slices only, so the window's edges stay where they were; after a whole
        // window's silence, it starts again at `now`.
        let start = if steps == SLICES {
            now
        } else {
            start + slice * steps as u32
        };
        self.newest_start = Some(start);
        self.newest_end = slice_end(start, slice);
    }

    fn totals(&self) -> (u64, u64) {
        self.totals
    }

    /// Counts a request, and an accept if `accepted`, in the newest slice.
    fn count(&mut self, accepted: bool) {
        let slice = &mut self.slices[self.newest];
        slice.0 += 1;
        slice.1 += u64::from(accepted);
        self.totals.0 += 1;
        self.totals.1 += u64::from(accepted);
    }
}

impl AdaptiveThrottle {
    /// Starts a builder with the documented defaults.
    pub fn builder() -> AdaptiveThrottleBuilder {
        AdaptiveThrottleBuilder::default()
    }

    /// The probability that an attempt asked at `now` is rejected, by the rule above, over the
    /// window as it stands then: to watch how hard the throttle sheds. `now` is a reading of
    /// the middleware's clock ([`Clock::now`](crate::Clock::now)).
    pub fn rejection_probability(&self, now: Instant) -> f64 {
        let mut window = self.lock();
        window.slide(now, self.inner.slice);
        let (requests, accepts) = window.totals();
        probability(requests, accepts, self.inner.k)
    }

    /// `(requests, accepts)` over the window as it stands at `now` (a reading of the
    /// middleware's clock): the counts the probability is computed from.
    pub fn counts(&self, now: Instant) -> (u64, u64) {
        let mut window = self.lock();
        window.slide(now, self.inner.slice);
        window.totals()
    }

    /// Whether an attempt asked at `now` may go. A rejected one counts as a request at once; an
    /// admitted one counts when it has [`finished`](Self::finished), so that attempts still in
    /// flight (a burst of 64 at start-up, say) do not read as turned away.
    pub(crate) fn admit(&self, now: Instant, rng: &dyn RandomSource) -> bool {
        let mut window = self.lock();
        window.slide(now, self.inner.slice);
        let (requests, accepts) = window.totals();
        let p = probability(requests, accepts, self.inner.k);
        if p <= 0.0 {
            return true;
        }
        // A draw in [0, 1) from the injected source: reproducible in tests.
        let draw = uniform_duration(rng, Duration::from_nanos(u32::MAX.into())).as_nanos() as f64
            / (f64::from(u32::MAX) + 1.0);
        let admitted = draw >= p;
        if !admitted {
            window.count(false);
        }
        admitted
    }

    /// An admitted attempt finished at `now`: a request, and an accept if the dependency
    /// accepted it.
    pub(crate) fn finished(&self, now: Instant, accepted: bool) {
        let mut window = self.lock();
        window.slide(now, self.inner.slice);
        window.count(accepted);
    }

    /// How long one slice of the window lasts: a twelfth of it.
    pub(crate) fn slice(&self) -> Duration {
        self.inner.slice
    }

    /// Whether two throttles share one account.
    #[cfg(test)]
    pub(crate) fn same_account(&self, other: &AdaptiveThrottle) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Window> {
        // The counts stay meaningful even if a holder panicked: each update is one addition.
        self.inner
            .window
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }
}

/// Whether the dependency accepted an attempt: it answered (`status`), with a status the policy
/// does not retry. The same set that makes a status worth a retry makes it a refusal here.
pub(crate) fn accepted(
    status: Option<http::StatusCode>,
    policy: &crate::engine::policy::RetryPolicy,
) -> bool {
    status.is_some_and(|status| !policy.is_retryable_status(status))
}

/// `max(0, (requests - k * accepts) / (requests + 1))`.
fn probability(requests: u64, accepts: u64, k: f64) -> f64 {
    let requests = requests as f64;
    ((requests - k * accepts as f64) / (requests + 1.0)).max(0.0)
}

/// Builds an [`AdaptiveThrottle`].
///
/// # Default
///
/// | setting | default |
/// |---|---|
/// | [`window`](Self::window) | 2 minutes, the SRE book's |
/// | [`k`](Self::k) | 2.0: the dependency may turn away up to half the attempts before the client sheds any |
#[derive(Debug, Clone)]
pub struct AdaptiveThrottleBuilder {
    window: Duration,
    k: f64,
}

impl Default for AdaptiveThrottleBuilder {
    fn default() -> Self {
        AdaptiveThrottleBuilder {
            window: Duration::from_secs(120),
            k: 2.0,
        }
    }
}

impl AdaptiveThrottleBuilder {
    /// The trailing window the counts cover, slid a twelfth at a time. Must be at least 12 ms.
    pub fn window(mut self, window: Duration) -> Self {
        self.window = window;
        self
    }

    /// How many attempts per accepted one the client lets through before it sheds the rest.
    /// Lower sheds sooner; must be at least 1.
    pub fn k(mut self, k: f64) -> Self {
        self.k = k;
        self
    }

    /// Validates the settings.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when the window is under 12 ms, or `k` is below 1 or not a number.
    pub fn build(self) -> Result<AdaptiveThrottle, InvalidConfig> {
        if self.window < Duration::from_millis(12) {
            return Err(InvalidConfig::new(
                THROTTLE,
                format!(
                    "window ({:?}) is too short to count in: use at least 12 ms",
                    self.window
                ),
            ));
        }
        if !self.k.is_finite() || self.k < 1.0 {
            return Err(InvalidConfig::new(
                THROTTLE,
                format!(
                    "k ({}) must be a number of at least 1: below 1 the client would reject \
                     attempts the dependency accepts",
                    self.k
                ),
            ));
        }
        Ok(AdaptiveThrottle {
            inner: Arc::new(Shared {
                k: self.k,
                slice: self.window / SLICES as u32,
                window: Mutex::new(Window {
                    slices: [(0, 0); SLICES],
                    totals: (0, 0),
                    newest: 0,
                    newest_start: None,
                    newest_end: Instant::now(),
                }),
            }),
        })
    }
}

impl Default for AdaptiveThrottle {
    /// The throttle with the documented defaults (a 2-minute window, K = 2): what
    /// `AdaptiveThrottle::builder().build()` makes, without the `Result`.
    fn default() -> Self {
        AdaptiveThrottleBuilder::default()
            .build()
            .unwrap_or_else(|e| unreachable!("the default throttle is invalid: {e}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn throttle(window_secs: u64, k: f64) -> AdaptiveThrottle {
        AdaptiveThrottle::builder()
            .window(Duration::from_secs(window_secs))
            .k(k)
            .build()
            .unwrap()
    }

    /// A draw just above `p` of the unit interval, and just below it.
    fn draw_at(p: f64) -> impl Fn() -> u64 {
        move || (p * u64::MAX as f64) as u64
    }

    #[test]
    fn a_window_of_12_ms_and_a_k_of_1_are_the_smallest_accepted() {
        let smallest = AdaptiveThrottle::builder()
            .window(Duration::from_millis(12))
            .k(1.0)
            .build()
            .expect("the documented minimums");
        assert_eq!(smallest.slice(), Duration::from_millis(1));
        assert!(
            AdaptiveThrottle::builder()
                .window(Duration::from_micros(11_999))
                .build()
                .is_err()
        );
        assert!(AdaptiveThrottle::builder().k(0.999).build().is_err());
    }

    #[test]
    fn the_probability_is_the_sre_formula() {
        for (requests, accepts, k, expected) in [
            (0, 0, 2.0, 0.0),
            (10, 5, 2.0, 0.0),
            (10, 4, 2.0, 2.0 / 11.0),
            (100, 0, 2.0, 100.0 / 101.0),
            (100, 10, 2.0, 80.0 / 101.0),
            (100, 10, 1.5, 85.0 / 101.0),
            (3, 1, 1.0, 2.0 / 4.0),
        ] {
            assert_eq!(
                probability(requests, accepts, k),
                expected,
                "{requests} {accepts} {k}"
            );
        }
    }

    #[test]
    fn counts_requests_and_accepts_and_rejects_with_that_probability() {
        let t = throttle(120, 2.0);
        let now = Instant::now();
        // Ten attempts, four accepted; the highest draw admits each.
        for i in 0..10 {
            assert!(t.admit(now, &|| u64::MAX));
            t.finished(now, i < 4);
        }
        assert_eq!(t.counts(now), (10, 4));
        let p = t.rejection_probability(now);
        assert_eq!(p, 2.0 / 11.0);
        // A draw below p rejects, and counts as a request at once...
        assert!(!t.admit(now, &draw_at(p * 0.99)));
        assert_eq!(t.counts(now), (11, 4));
        let p = t.rejection_probability(now);
        assert_eq!(p, 3.0 / 12.0);
        // ...one at or above it admits, and counts when it finishes.
        assert!(t.admit(now, &draw_at(p * 1.01)));
        assert_eq!(t.counts(now), (11, 4));
        t.finished(now, false);
        assert_eq!(t.counts(now), (12, 4));
    }

    #[test]
    fn attempts_in_flight_do_not_read_as_turned_away() {
        let t = throttle(120, 2.0);
        let now = Instant::now();
        // 64 at once, none finished yet: the lowest draw still admits every one.
        for _ in 0..64 {
            assert!(t.admit(now, &|| 0u64));
        }
        assert_eq!(t.counts(now), (0, 0));
        for _ in 0..64 {
            t.finished(now, true);
        }
        assert_eq!(t.counts(now), (64, 64));
    }

    #[test]
    fn nothing_is_rejected_while_the_dependency_accepts_one_in_k() {
        let t = throttle(120, 2.0);
        let now = Instant::now();
        for i in 0..1_000 {
            // The lowest draw: rejected whenever the probability is above zero.
            assert!(t.admit(now, &|| 0u64), "attempt {i}");
            t.finished(now, i % 2 == 0);
        }
        assert_eq!(t.counts(now), (1_000, 500));
    }

    #[test]
    fn the_window_slides_a_slice_at_a_time_and_forgets_what_fell_out() {
        // 12 s window: slices of 1 s.
        let t = throttle(12, 2.0);
        let start = Instant::now();
        for _ in 0..6 {
            t.finished(start, false);
        }
        let later = start + Duration::from_millis(5_500);
        for _ in 0..4 {
            t.finished(later, true);
        }
        assert_eq!(t.counts(later), (10, 4));
        // Just under 12 s after the first slice began, all of it is still in the window...
        assert_eq!(t.counts(start + Duration::from_millis(11_999)), (10, 4));
        // ...and from 12 s on, the first slice is gone.
        assert_eq!(t.counts(start + Duration::from_secs(12)), (4, 4));
        assert_eq!(
            t.rejection_probability(start + Duration::from_secs(12)),
            0.0
        );
        // A whole window later, nothing is left.
        assert_eq!(t.counts(start + Duration::from_secs(40)), (0, 0));
    }

    #[test]
    fn clones_share_one_account() {
        let t = throttle(120, 2.0);
        let clone = t.clone();
        let now = Instant::now();
        clone.finished(now, false);
        assert_eq!(t.counts(now), (1, 0));
        assert!(t.same_account(&clone));
        assert!(!t.same_account(&AdaptiveThrottle::default()));
    }

    #[test]
    fn invalid_settings_say_what_to_change() {
        let short = AdaptiveThrottle::builder()
            .window(Duration::from_millis(5))
            .build()
            .unwrap_err();
        assert_eq!(
            short.to_string(),
            "invalid adaptive throttle: window (5ms) is too short to count in: use at least 12 ms"
        );
        for k in [0.5, f64::NAN, f64::INFINITY] {
            let err = AdaptiveThrottle::builder().k(k).build().unwrap_err();
            assert!(
                err.message().starts_with(&format!("k ({k}) must be")),
                "{err}"
            );
        }
    }
}
