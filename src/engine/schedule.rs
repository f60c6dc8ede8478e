//! The wait before the next attempt: backoff, the server's `Retry-After`, and the deadline.
//!
//! The rule, in order:
//!
//! 1. Draw the backoff `b` under `c = min(cap, base * 2^retry)` as the policy's [`Jitter`] says
//!    (full jitter, `[0, c]`, by default).
//! 2. If the response carried a valid `Retry-After` asking for `f`:
//!    - if `f` is over `max_retry_after`, or would end at or past the deadline, stop now and
//!      return the response: waiting longer than the caller is willing to would be waiting to no
//!      purpose;
//!    - otherwise wait `f + b`, with `b` cut to half the time the deadline leaves after `f`. The
//!      floor is never shortened: the next attempt never starts earlier than the server asked.
//!      The jitter above it spreads clients that got the same header at the same instant, so
//!      they do not come back as one herd; it is the same window the backoff would have used.
//!      The spread is drawn from `[0, c]` whatever the jitter strategy. With
//!      `retry_after_jitter(false)`, or `Jitter::None`, the wait is `f` exactly.
//! 3. Without one, wait `b`, unless that wait would end at or past the deadline: then stop now
//!    and return the last outcome.
//!
//! A `Retry-After` in the past counts as `f = 0`; an invalid one counts as absent. A spent
//! quota's reset (the `RateLimit` fields) is a floor by the same rule, before a retry and before
//! a first attempt alike ([`hold`]).

use std::time::Duration;

use crate::engine::backoff::{self, Jitter};
use crate::engine::policy::RetryPolicy;
use crate::engine::rules::{Http, Rules};
use crate::rng::RandomSource;
use crate::stop::StopReason;

/// What to do after a transient failure that may be retried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Sleep this long, then make the next attempt.
    Sleep(Duration),
    /// Make no further attempt.
    Stop(StopReason),
}

/// The wait before retry `retry` (0 for the first), given the server's floor (if any) and the
/// time left before the deadline. `previous` is the last backoff drawn for the request (the
/// base before the first retry), for decorrelated jitter. A backoff drawn without a floor is
/// the second value, for the next call's `previous`.
pub(crate) fn next_wait(
    (policy, rules): (&RetryPolicy, &dyn Rules),
    retry: u32,
    previous: Duration,
    retry_after: Option<Duration>,
    remaining: Duration,
    rng: &dyn RandomSource,
) -> (Wait, Option<Duration>) {
    let (base, cap) = (policy.base_delay(), policy.max_delay());
    let Some(floor) = retry_after else {
        let backoff = rules.backoff(policy, retry, previous, rng);
        let wait = if backoff >= remaining {
            Wait::Stop(StopReason::DeadlineReached)
        } else {
            Wait::Sleep(backoff)
        };
        return (wait, Some(backoff));
    };
    let wait = if floor > policy.max_retry_after() || floor >= remaining {
        Wait::Stop(StopReason::RetryAfterTooLong)
    } else if !policy.retry_after_jitter() || policy.jitter() == Jitter::None {
        Wait::Sleep(floor)
    } else {
        // The spread above the floor is full jitter whatever the strategy: it only parts
        // clients that got the same header at the same instant.
        let slack = (remaining - floor) / 2;
        Wait::Sleep(floor + backoff::full_jitter(base, cap, retry, rng).min(slack))
    };
    (wait, None)
}

/// The hold before an attempt to an origin whose quota is spent for `hold` more: the hold, with
/// the jitter a `Retry-After` floor gets above it (so the requests it held do not all arrive at
/// the reset instant), or [`StopReason::QuotaExhausted`] when it is longer than
/// `max_retry_after` or would end at or past the deadline.
pub(crate) fn hold(
    policy: &RetryPolicy,
    retry: u32,
    hold: Duration,
    remaining: Duration,
    rng: &dyn RandomSource,
) -> Wait {
    // With a floor, no backoff is drawn: any rules do.
    match next_wait(
        (policy, &Http),
        retry,
        policy.base_delay(),
        Some(hold),
        remaining,
        rng,
    )
    .0
    {
        Wait::Stop(_) => Wait::Stop(StopReason::QuotaExhausted),
        wait => wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::SeededRng;

    const MINUTE: Duration = Duration::from_secs(60);

    /// The wait of a request's first backoff under `policy` (the previous one is the base).
    fn wait(
        policy: &RetryPolicy,
        retry: u32,
        retry_after: Option<Duration>,
        remaining: Duration,
        rng: &dyn RandomSource,
    ) -> Wait {
        next_wait(
            (policy, &Http),
            retry,
            policy.base_delay(),
            retry_after,
            remaining,
            rng,
        )
        .0
    }

    fn secs(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn without_retry_after_the_wait_is_the_backoff() {
        let policy = RetryPolicy::default();
        let max = || u64::MAX;
        assert_eq!(
            wait(&policy, 0, None, MINUTE, &max),
            Wait::Sleep(Duration::from_millis(100))
        );
        assert_eq!(
            wait(&policy, 2, None, MINUTE, &max),
            Wait::Sleep(Duration::from_millis(400))
        );
    }

    #[test]
    fn retry_after_is_a_floor_with_the_backoff_window_above_it() {
        let policy = RetryPolicy::default();
        assert_eq!(
            wait(&policy, 0, Some(secs(7)), MINUTE, &|| 0u64),
            Wait::Sleep(secs(7))
        );
        assert_eq!(
            wait(&policy, 0, Some(secs(7)), MINUTE, &|| u64::MAX),
            Wait::Sleep(secs(7) + Duration::from_millis(100))
        );
    }

    #[test]
    fn without_jitter_above_the_floor_the_wait_is_the_floor() {
        let policy = RetryPolicy::builder()
            .retry_after_jitter(false)
            .build()
            .unwrap();
        assert_eq!(
            wait(&policy, 0, Some(secs(7)), MINUTE, &|| u64::MAX),
            Wait::Sleep(secs(7))
        );
    }

    #[test]
    fn a_retry_after_over_the_limit_stops_at_once() {
        let policy = RetryPolicy::builder()
            .deadline(secs(3600))
            .max_retry_after(secs(60))
            .build()
            .unwrap();
        assert_eq!(
            wait(&policy, 0, Some(secs(61)), secs(3600), &SeededRng::new(1)),
            Wait::Stop(StopReason::RetryAfterTooLong)
        );
        assert_eq!(
            wait(&policy, 0, Some(secs(60)), secs(3600), &SeededRng::new(1)),
            Wait::Sleep(secs(60) + backoff_draw(1, 0).min((secs(3600) - secs(60)) / 2))
        );
    }

    /// The first draw of `SeededRng::new(seed)` for `retry` under the default policy.
    fn backoff_draw(seed: u64, retry: u32) -> Duration {
        let p = RetryPolicy::default();
        backoff::full_jitter(p.base_delay(), p.max_delay(), retry, &SeededRng::new(seed))
    }

    #[test]
    fn a_retry_after_past_the_deadline_stops_at_once() {
        let policy = RetryPolicy::default();
        assert_eq!(
            wait(&policy, 0, Some(secs(10)), secs(10), &|| 0u64),
            Wait::Stop(StopReason::RetryAfterTooLong)
        );
    }

    #[test]
    fn jitter_above_the_floor_leaves_time_for_the_attempt() {
        let policy = RetryPolicy::builder().max_delay(MINUTE).build().unwrap();
        // 10 s asked, 10.2 s left: at most half the 200 ms slack goes to jitter.
        let remaining = Duration::from_millis(10_200);
        assert_eq!(
            wait(&policy, 8, Some(secs(10)), remaining, &|| u64::MAX),
            Wait::Sleep(Duration::from_millis(10_100))
        );
    }

    #[test]
    fn a_backoff_that_would_end_at_the_deadline_stops() {
        let policy = RetryPolicy::default();
        let max = || u64::MAX;
        assert_eq!(
            wait(&policy, 0, None, Duration::from_millis(100), &max),
            Wait::Stop(StopReason::DeadlineReached)
        );
        assert_eq!(
            wait(&policy, 0, None, Duration::from_millis(101), &max),
            Wait::Sleep(Duration::from_millis(100))
        );
    }

    #[test]
    fn a_retry_after_of_zero_waits_only_the_jitter() {
        let policy = RetryPolicy::default();
        assert_eq!(
            wait(&policy, 0, Some(Duration::ZERO), MINUTE, &|| u64::MAX),
            Wait::Sleep(Duration::from_millis(100))
        );
    }
}
