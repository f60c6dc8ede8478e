//! Capped exponential backoff with full jitter.
//!
//! The wait before retry `k` (`k = 0` for the first retry) is drawn uniformly from
//! `[0, min(cap, base * 2^k)]`.
//!
//! Why full jitter: clients that failed together would, with a fixed exponential schedule, come
//! back together, and fail together again. Drawing the whole wait at random spreads them over the
//! window, which keeps both the number of calls and the time to finish low under contention;
//! "equal" jitter (half fixed, half random) keeps a fixed floor that re-synchronises clients for
//! no gain. The cap keeps a long run of failures from producing absurd waits.
//!
//! The arithmetic saturates: `2^k` stops growing once it no longer fits, and the product with the
//! base stops at `Duration::MAX` before the cap applies, so any attempt number is safe.

use std::time::Duration;

use crate::rng::{RandomSource, uniform_duration};

/// The largest wait the schedule allows before retry `retry` (0-based): `min(cap, base * 2^retry)`.
pub(crate) fn ceiling(base: Duration, cap: Duration, retry: u32) -> Duration {
    // 2^retry saturates at u32::MAX from retry = 32 on; base * that saturates at Duration::MAX.
    let factor = 1u32.checked_shl(retry).unwrap_or(u32::MAX);
    base.saturating_mul(factor).min(cap)
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
/// half random. Kept for comparison in the simulator; the middleware uses full jitter.
#[cfg_attr(not(feature = "sim"), allow(dead_code))]
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

/// "Decorrelated" jitter: a wait drawn from `[base, 3 * previous]`, capped, where `previous` is
/// the last wait (the base before the first retry). Kept for comparison in the simulator.
#[cfg_attr(not(feature = "sim"), allow(dead_code))]
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
}
