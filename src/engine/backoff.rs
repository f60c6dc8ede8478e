//! Capped exponential backoff, with full jitter unless the policy picks another.
//!
//! The ceiling of the wait before retry `k` (`k = 0` for the first retry) is
//! `c = min(cap, base * 2^k)`, and [`Jitter`] says how the wait is drawn under it.
//!
//! Why full jitter by default: clients that failed together would, with a fixed exponential
//! schedule, come back together, and fail together again. Drawing the whole wait at random
//! spreads them over the window, which keeps both the number of calls and the time to finish
//! low under contention; "equal" jitter (half fixed, half random) keeps a fixed floor that
//! re-synchronises clients for no gain. The others are there for a client that must behave like
//! another one. Every strategy stays at or under the cap.
//!
//! The arithmetic saturates: `2^k` stops growing once it no longer fits, and the product with the
//! base stops at `Duration::MAX` before the cap applies, so any attempt number is safe.

use std::time::Duration;

use crate::rng::{RandomSource, uniform_duration};

/// How the wait before a retry is drawn under its ceiling `c = min(max_delay, base_delay * 2^k)`
/// (`k = 0` for the first retry). Every strategy stays within `[0, max_delay]`.
///
/// | strategy | the wait before retry `k` |
/// |---|---|
/// | [`Full`](Self::Full) (default) | uniform in `[0, c]` |
/// | [`Equal`](Self::Equal) | uniform in `[c / 2, c]` |
/// | [`Decorrelated`](Self::Decorrelated) | uniform in `[base_delay, max(base_delay, 3 * previous)]`, then capped at `max_delay`; `previous` is the last backoff drawn (`base_delay` before the first retry), so it does not use `c` |
/// | [`None`](Self::None) | exactly `c` |
///
/// Above a server's `Retry-After` floor the spread is drawn from `[0, c]` whatever the strategy
/// (its purpose there is only to part clients that got the same header), except with
/// [`None`](Self::None), which waits the floor exactly, as `retry_after_jitter(false)` does.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::{Jitter, RetryPolicy};
///
/// // As a client that uses decorrelated jitter (Polly's default) does.
/// let policy = RetryPolicy::builder().jitter(Jitter::Decorrelated).build()?;
/// assert_eq!(policy.jitter(), Jitter::Decorrelated);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
///
/// # How a draw becomes a wait
///
/// Each wait takes one value `x` from the middleware's [`RandomSource`], in the order the
/// waits come (none for [`None`](Self::None), nor for a `Retry-After` floor waited exactly).
/// "Uniform in `[lo, hi]`" is, in nanoseconds, `lo + floor(x * (hi - lo + 1) / 2^64)`: both
/// ends included (`x = 0` gives `lo`, `x = u64::MAX` gives `hi`), at a resolution of one
/// nanosecond. `c` and the ends are whole nanoseconds; `2^k` and the products saturate.
///
/// Then, in order: after an answer with a valid `Retry-After` (or millisecond) floor `f`, the
/// wait is `f + min(j, (left - f) / 2)`, `j` full jitter's draw under `c` whatever the
/// strategy, `left` the time the deadline leaves; without one, a wait `w` with `w >= left`
/// stops the request with [`DeadlineReached`](crate::StopReason::DeadlineReached) instead of
/// waiting. A [`SeededRng`](crate::SeededRng) yields the same values on every run, shared by
/// every request of the middleware in the order they draw: give a test's concurrent requests a
/// source each, or expect their draws interleaved.
///
/// So a test can state a schedule from the policy and the seed alone: see
/// [`RetryMiddleware::with_rng`](crate::RetryMiddleware::with_rng).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Jitter {
    /// A wait drawn uniformly from all of `[0, c]`: the AWS study's recommendation.
    #[default]
    Full,
    /// Half the ceiling fixed, the other half drawn: `[c / 2, c]`.
    Equal,
    /// Each wait drawn from the base to three times the last one, capped ("decorrelated",
    /// from the AWS study; Polly's default).
    Decorrelated,
    /// No randomness: the ceiling itself. Clients that fail together come back together.
    None,
}

impl Jitter {
    /// The wait before retry `retry` (0-based), under `base` and `cap`; `previous` is the last
    /// backoff this strategy drew for the request (`base` before the first retry), which only
    /// decorrelated jitter reads.
    pub(crate) fn draw(
        self,
        base: Duration,
        cap: Duration,
        retry: u32,
        previous: Duration,
        rng: &dyn RandomSource,
    ) -> Duration {
        match self {
            Jitter::Full => full_jitter(base, cap, retry, rng),
            Jitter::Equal => equal_jitter(base, cap, retry, rng),
            Jitter::Decorrelated => decorrelated_jitter(base, cap, previous, rng),
            Jitter::None => ceiling(base, cap, retry),
        }
    }
}

/// The largest wait the schedule allows before retry `retry` (0-based): `min(cap, base * 2^retry)`.
pub(crate) fn ceiling(base: Duration, cap: Duration, retry: u32) -> Duration {
    // 2^retry saturates at u32::MAX from retry = 32 on; base * that saturates at Duration::MAX.
    let factor = 1u32.checked_shl(retry).unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(cap)
}

/// gRPC's wait before retry `retry` (0-based; A6 as revised in 2024): the ceiling
/// `min(base * multiplier^retry, cap)` (`multiplier_milli` in thousandths), times a factor
/// drawn from `[0.8, 1.2]`. The jitter comes after the cap, so a wait may pass it by a fifth.
#[cfg(feature = "grpc")]
pub(crate) fn a6(
    base: Duration,
    cap: Duration,
    multiplier_milli: u32,
    retry: u32,
    rng: &dyn RandomSource,
) -> Duration {
    let top = a6_ceiling(base, cap, multiplier_milli, retry);
    let low = top.saturating_mul(4) / 5;
    low + uniform_duration(rng, top.saturating_mul(2) / 5)
}

/// `min(base * multiplier^retry, cap)`, `multiplier_milli` in thousandths: in floating point,
/// as any multiplier may be given; a product too large, or not a number, is the cap.
#[cfg(feature = "grpc")]
pub(crate) fn a6_ceiling(
    base: Duration,
    cap: Duration,
    multiplier_milli: u32,
    retry: u32,
) -> Duration {
    let factor =
        (f64::from(multiplier_milli) / 1000.0).powi(i32::try_from(retry).unwrap_or(i32::MAX));
    let secs = base.as_secs_f64() * factor;
    if secs < cap.as_secs_f64() {
        Duration::from_secs_f64(secs)
    } else {
        cap
    }
}

/// A wait drawn uniformly from `[0, ceiling(base, cap, retry)]`.
pub(crate) fn full_jitter(
    base: Duration,
    cap: Duration,
    retry: u32,
    rng: &dyn RandomSource,
) -> Duration {
    uniform_duration(rng, ceiling(base, cap, retry))
}

/// A wait drawn from `[c/2, c]`, `c = ceiling(base, cap, retry)`: "equal" jitter, half fixed and
/// half random.
pub(crate) fn equal_jitter(
    base: Duration,
    cap: Duration,
    retry: u32,
    rng: &dyn RandomSource,
) -> Duration {
    let top = ceiling(base, cap, retry);
    let half = top / 2;
    half + uniform_duration(rng, top - half)
}

/// "Decorrelated" jitter: a wait drawn from `[base, max(base, 3 * previous)]`, capped, where
/// `previous` is the last wait (the base before the first retry).
pub(crate) fn decorrelated_jitter(
    base: Duration,
    cap: Duration,
    previous: Duration,
    rng: &dyn RandomSource,
) -> Duration {
    let top = previous.saturating_mul(3).max(base);
    (base + uniform_duration(rng, top - base)).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SeededRng;

    const BASE: Duration = Duration::from_millis(100);
    const CAP: Duration = Duration::from_secs(10);

    #[test]
    fn ceiling_doubles_from_the_base_until_the_cap() {
        let ceilings: Vec<u128> = (0..9).map(|k| ceiling(BASE, CAP, k).as_millis()).collect();
        assert_eq!(
            ceilings,
            [100, 200, 400, 800, 1600, 3200, 6400, 10_000, 10_000]
        );
    }

    #[test]
    fn ceiling_never_overflows_for_any_retry_number() {
        for k in [31, 32, 33, 63, 64, 65, 1000, u32::MAX] {
            assert_eq!(ceiling(BASE, CAP, k), CAP, "retry {k}");
            assert_eq!(
                ceiling(Duration::MAX, Duration::MAX, k),
                Duration::MAX,
                "retry {k}"
            );
        }
    }

    #[test]
    fn full_jitter_stays_within_the_ceiling_and_covers_it() {
        let rng = SeededRng::new(3);
        for k in 0..12 {
            let top = ceiling(BASE, CAP, k);
            let draws: Vec<Duration> = (0..2000).map(|_| full_jitter(BASE, CAP, k, &rng)).collect();
            assert!(draws.iter().all(|d| *d <= top), "retry {k}");
            // Full jitter reaches both the bottom and the top tenth of its window.
            assert!(draws.iter().any(|d| *d < top / 10), "retry {k}");
            assert!(draws.iter().any(|d| *d > top * 9 / 10), "retry {k}");
        }
    }

    #[test]
    fn equal_jitter_keeps_half_the_ceiling() {
        for k in 0..8 {
            let top = ceiling(BASE, CAP, k);
            assert_eq!(equal_jitter(BASE, CAP, k, &|| 0u64), top / 2);
            assert_eq!(equal_jitter(BASE, CAP, k, &|| u64::MAX), top);
        }
    }

    #[test]
    fn decorrelated_jitter_grows_from_the_last_wait_and_stops_at_the_cap() {
        let max = || u64::MAX;
        assert_eq!(decorrelated_jitter(BASE, CAP, BASE, &max), BASE * 3);
        assert_eq!(decorrelated_jitter(BASE, CAP, BASE * 3, &max), BASE * 9);
        assert_eq!(decorrelated_jitter(BASE, CAP, CAP, &max), CAP);
        assert_eq!(decorrelated_jitter(BASE, CAP, CAP, &|| 0u64), BASE);
        assert_eq!(decorrelated_jitter(BASE, CAP, Duration::MAX, &max), CAP);
    }

    #[test]
    fn zero_base_means_no_wait() {
        let rng = SeededRng::new(3);
        for k in 0..5 {
            assert_eq!(full_jitter(Duration::ZERO, CAP, k, &rng), Duration::ZERO);
        }
    }

    /// Each strategy's documented range, for any settings, retry number, last wait and draw.
    mod ranges {
        use super::*;
        use proptest::prelude::*;

        fn nanos(n: u64) -> Duration {
            Duration::from_nanos(n)
        }

        /// Settings as `build()` allows them (base at most cap), from zero to past u64
        /// nanoseconds' reach of a doubling.
        fn base_and_cap() -> impl Strategy<Value = (Duration, Duration)> {
            (any::<u64>(), any::<u64>()).prop_map(|(a, b)| (nanos(a.min(b)), nanos(a.max(b))))
        }

        proptest! {
            // A fifth of the cases in a debug build (the test command), all in release.
            #![proptest_config(ProptestConfig::with_cases(if cfg!(debug_assertions) { 4_000 } else { 20_000 }))]

            #[test]
            fn every_strategy_stays_within_its_range_and_under_the_cap(
                (base, cap) in base_and_cap(),
                retry in prop_oneof![0u32..70, any::<u32>()],
                previous in any::<u64>(),
                draw in any::<u64>(),
            ) {
                let previous = nanos(previous);
                let rng = move || draw;
                let c = ceiling(base, cap, retry);
                prop_assert!(c <= cap);
                for jitter in [Jitter::Full, Jitter::Equal, Jitter::Decorrelated, Jitter::None] {
                    let wait = jitter.draw(base, cap, retry, previous, &rng);
                    prop_assert!(wait <= cap, "{jitter:?}: {wait:?} over the cap {cap:?}");
                    let (low, high) = match jitter {
                        Jitter::Full => (Duration::ZERO, c),
                        Jitter::Equal => (c / 2, c),
                        Jitter::Decorrelated => (
                            base.min(cap),
                            previous.saturating_mul(3).max(base).min(cap),
                        ),
                        Jitter::None => (c, c),
                    };
                    prop_assert!(
                        low <= wait && wait <= high,
                        "{jitter:?}: {wait:?} outside [{low:?}, {high:?}]"
                    );
                }
            }

            #[test]
            fn the_lowest_and_highest_draws_reach_the_ends_of_the_range(
                (base, cap) in base_and_cap(),
                retry in 0u32..70,
            ) {
                let c = ceiling(base, cap, retry);
                let (low, high) = (|| 0u64, || u64::MAX);
                prop_assert_eq!(Jitter::Full.draw(base, cap, retry, base, &low), Duration::ZERO);
                prop_assert_eq!(Jitter::Full.draw(base, cap, retry, base, &high), c);
                prop_assert_eq!(Jitter::Equal.draw(base, cap, retry, base, &low), c / 2);
                prop_assert_eq!(Jitter::Equal.draw(base, cap, retry, base, &high), c);
                prop_assert_eq!(Jitter::Decorrelated.draw(base, cap, retry, base, &low), base);
                prop_assert_eq!(
                    Jitter::Decorrelated.draw(base, cap, retry, base, &high),
                    base.saturating_mul(3).min(cap)
                );
            }
        }
    }
}
