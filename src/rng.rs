//! The random source behind jitter.
//!
//! Jitter is the only randomness in a retry schedule. Taking it through a small trait lets a test
//! replace it with a seeded source and get the same delays on every run, and lets a user plug in
//! whatever generator their service already trusts.
//!
//! The trait takes `&self` because one middleware serves many requests at once; implementations
//! keep their state behind interior mutability. [`SeededRng`] does so with a single atomic
//! counter, so it is lock-free and still deterministic for a given order of calls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A source of uniformly distributed 64-bit values, shared by all requests of a middleware:
/// implement it (or pass a closure) to control jitter; [`SeededRng`] is the one tests usually
/// want.
///
/// Named so that it imports beside `rand::Rng`. Any `Fn() -> u64` closure that is
/// `Send + Sync` is a `RandomSource`, which is handy in tests:
///
/// ```
/// use reqwest_safe_retry::RandomSource;
///
/// // Always the largest value: every jittered wait takes its full ceiling.
/// let max = || u64::MAX;
/// assert_eq!(max.next_u64(), u64::MAX);
/// ```
///
/// So is any of `rand`'s generators in a [`Mutex`]: they take `&mut self`, and one middleware
/// draws for many requests at once.
///
/// ```
/// use std::sync::Mutex;
/// use rand::SeedableRng;
/// use reqwest_safe_retry::{RandomSource, RetryMiddleware, RetryPolicy};
///
/// let seeded = Mutex::new(rand::rngs::StdRng::seed_from_u64(7));
/// let again = Mutex::new(rand::rngs::StdRng::seed_from_u64(7));
/// assert_eq!(seeded.next_u64(), again.next_u64());
/// let middleware = RetryMiddleware::new(RetryPolicy::default()).with_rng(seeded);
/// # drop(middleware);
/// ```
pub trait RandomSource: Send + Sync + 'static {
    /// Returns the next value, uniformly distributed over all of `u64`.
    fn next_u64(&self) -> u64;
}

impl<F> RandomSource for F
where
    F: Fn() -> u64 + Send + Sync + 'static,
{
    fn next_u64(&self) -> u64 {
        self()
    }
}

impl<R> RandomSource for Mutex<R>
where
    R: rand::Rng + Send + 'static,
{
    fn next_u64(&self) -> u64 {
        // A generator left by a panicking draw is still a generator.
        let mut rng = self
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        rand::Rng::next_u64(&mut *rng)
    }
}

/// The default random source: the thread-local generator of the `rand` crate.
///
/// It is seeded from the operating system, so two runs give different jitter, which is what a
/// fleet of clients needs. Use [`SeededRng`] where runs must repeat.
#[derive(Debug, Clone, Copy, Default)]
#[non_exhaustive]
pub(crate) struct ThreadRng;

impl ThreadRng {
    /// Creates the default random source.
    pub(crate) const fn new() -> Self {
        ThreadRng
    }
}

impl RandomSource for ThreadRng {
    fn next_u64(&self) -> u64 {
        rand::Rng::next_u64(&mut rand::rng())
    }
}

/// A deterministic, lock-free random source: the same seed gives the same sequence, so a test's
/// waits repeat exactly. Production needs none: the default draws from the thread's generator,
/// seeded by the operating system, so clients of a fleet do not draw alike.
///
/// Clones share one sequence. The generator is SplitMix64 over an atomic counter: statistically
/// sound for jitter, not for cryptography. The `n`-th value (from 1) is SplitMix64's output for
/// the state `seed + n * 0x9E37_79B9_7F4A_7C15` (wrapping), as in Vigna's reference
/// `splitmix64.c`; [`Jitter`](crate::Jitter) says how each value becomes a wait.
///
/// ```
/// use reqwest_safe_retry::{RandomSource, SeededRng};
///
/// let a = SeededRng::new(7);
/// let b = SeededRng::new(7);
/// assert_eq!(a.next_u64(), b.next_u64());
/// ```
#[derive(Debug, Clone)]
pub struct SeededRng {
    state: Arc<AtomicU64>,
}

impl SeededRng {
    /// Creates a source that yields the sequence determined by `seed`.
    pub fn new(seed: u64) -> Self {
        SeededRng {
            state: Arc::new(AtomicU64::new(seed)),
        }
    }
}

impl RandomSource for SeededRng {
    fn next_u64(&self) -> u64 {
        const GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;
        let mut z = self
            .state
            .fetch_add(GAMMA, Ordering::Relaxed)
            .wrapping_add(GAMMA);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// A uniformly chosen duration in `[0, max]`, both ends included, at nanosecond resolution.
///
/// Durations beyond `u64::MAX` nanoseconds (about 584 years) are clamped there first.
pub(crate) fn uniform_duration(rng: &dyn RandomSource, max: Duration) -> Duration {
    let max_nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX);
    // Multiply-shift maps a 64-bit value onto [0, max_nanos] with a bias below 2^-64 per value,
    // and without the modulo's division.
    let span = u128::from(max_nanos) + 1;
    let nanos = (u128::from(rng.next_u64()) * span) >> 64;
    // `nanos <= max_nanos`, so the conversion cannot fail.
    Duration::from_nanos(u64::try_from(nanos).unwrap_or(max_nanos))
}

impl crate::shared::Named for dyn RandomSource {
    const NAME: &'static str = "RandomSource";
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_rand_generator_in_a_mutex_yields_its_own_sequence() {
        use rand::SeedableRng;
        let shared = std::sync::Mutex::new(rand::rngs::StdRng::seed_from_u64(7));
        let mut own = rand::rngs::StdRng::seed_from_u64(7);
        let drawn: Vec<u64> = (0..4)
            .map(|_| super::RandomSource::next_u64(&shared))
            .collect();
        let expected: Vec<u64> = (0..4).map(|_| rand::Rng::next_u64(&mut own)).collect();
        assert_eq!(drawn, expected);
        assert_ne!(drawn[0], drawn[1]);
    }

    #[test]
    fn seeded_rng_is_splitmix64() {
        // The reference generator's first output for seed 0 (Vigna's splitmix64.c).
        assert_eq!(SeededRng::new(0).next_u64(), 0xe220_a839_7b1d_cdaf);
    }

    #[test]
    fn thread_rng_draws_differ() {
        let rng = ThreadRng::new();
        let draws: Vec<u64> = (0..8).map(|_| rng.next_u64()).collect();
        let mut distinct = draws.clone();
        distinct.sort_unstable();
        distinct.dedup();
        // Eight equal 64-bit draws from a seeded CSPRNG do not happen.
        assert!(distinct.len() > 1, "{draws:?}");
        assert!(draws.iter().any(|&d| d > 1), "{draws:?}");
    }

    use super::*;

    #[test]
    fn same_seed_gives_the_same_sequence() {
        let a = SeededRng::new(42);
        let b = SeededRng::new(42);
        let xs: Vec<u64> = (0..100).map(|_| a.next_u64()).collect();
        let ys: Vec<u64> = (0..100).map(|_| b.next_u64()).collect();
        assert_eq!(xs, ys);
        assert_ne!(SeededRng::new(43).next_u64(), xs[0]);
    }

    #[test]
    fn clones_share_one_sequence() {
        let a = SeededRng::new(1);
        let b = a.clone();
        let first = a.next_u64();
        let second = b.next_u64();
        let fresh = SeededRng::new(1);
        assert_eq!(fresh.next_u64(), first);
        assert_eq!(fresh.next_u64(), second);
    }

    #[test]
    fn uniform_duration_reaches_both_ends() {
        let max = Duration::from_millis(250);
        assert_eq!(uniform_duration(&|| 0u64, max), Duration::ZERO);
        assert_eq!(uniform_duration(&|| u64::MAX, max), max);
        assert_eq!(
            uniform_duration(&|| u64::MAX, Duration::ZERO),
            Duration::ZERO
        );
    }

    #[test]
    fn uniform_duration_clamps_durations_beyond_u64_nanos() {
        assert_eq!(
            uniform_duration(&|| u64::MAX, Duration::MAX),
            Duration::from_nanos(u64::MAX)
        );
    }

    #[test]
    fn uniform_duration_spreads_over_the_range() {
        let rng = SeededRng::new(9);
        let max = Duration::from_millis(1000);
        let mut buckets = [0u32; 10];
        for _ in 0..10_000 {
            let d = uniform_duration(&rng, max);
            assert!(d <= max);
            let i = (d.as_millis() as usize / 100).min(9);
            buckets[i] += 1;
        }
        // Each tenth of the range should get roughly 1,000 of 10,000 draws.
        for count in buckets {
            assert!((850..=1150).contains(&count), "{buckets:?}");
        }
    }
}
