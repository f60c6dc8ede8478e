//! The decision core: for one logical request, what to do next.
//!
//! A [`Decider`] is a small state machine with no I/O and no awaiting, in the manner of a sans-IO
//! protocol core: the driver (the middleware) tells it that an attempt is about to start and
//! what the attempt's outcome was, passing the clock to read the time from, and it answers with
//! the next action: make attempt *n* within timeout *t*, sleep *d*, or stop for reason *r*. It
//! does all the budget accounting and all the counting, so every rule below can be tested
//! without a socket or a runtime, and another driver could reuse it.
//!
//! # Where each rule lives
//!
//! | rule | where |
//! |---|---|
//! | transient or final, method safety, the cost kind | `classify` (the [`Verdict`] passed in) |
//! | which stop reason wins | [`Decider::after_attempt`], in the order below |
//! | backoff, `Retry-After` floor, no wait past the deadline | `schedule::next_wait` |
//! | the attempt's timeout cut to what the deadline leaves | [`Decider::next_attempt`] |
//! | charge before sleep, deposit, refund, give back | here, on the [`RetryBudget`] |
//! | counters | here: a retry counts when its attempt starts |
//!
//! # Precedence
//!
//! After an attempt, the first rule that applies decides:
//!
//! 1. a final verdict: [`Succeeded`](StopReason::Succeeded),
//!    [`NotRetryable`](StopReason::NotRetryable) or [`NotSafeToRetry`](StopReason::NotSafeToRetry);
//! 2. the request forbade retries: [`RetriesDisabled`](StopReason::RetriesDisabled);
//! 3. the last allowed attempt was made: [`AttemptsExhausted`](StopReason::AttemptsExhausted);
//! 4. no copy of the request can be sent: [`BodyNotCloneable`](StopReason::BodyNotCloneable);
//! 5. the deadline has passed: [`DeadlineReached`](StopReason::DeadlineReached);
//! 6. the schedule: a `Retry-After` too long
//!    ([`RetryAfterTooLong`](StopReason::RetryAfterTooLong)) or a wait that would end past the
//!    deadline ([`DeadlineReached`](StopReason::DeadlineReached));
//! 7. the budget refuses: [`BudgetExhausted`](StopReason::BudgetExhausted).
//!
//! The budget comes last on purpose: a retry that a cheaper rule forbids must not cost a token.
//!
//! # Cancellation
//!
//! A retry is paid for before its wait (charge-before-sleep), so while the driver sleeps the
//! decider holds a withdrawal that no attempt has used yet. If the request is dropped then (the
//! caller's own timeout, a `select!`), or the deadline turns out to have passed when the wait
//! ends, the decider's `Drop` gives the tokens back: a guard, not a convention. Nothing is
//! counted for a retry until its attempt starts, so a dropped request leaves counters that
//! count only what happened.

use std::time::{Duration, Instant};

use http::HeaderValue;

use crate::budget::RetryBudget;
use crate::classify::Verdict;
use crate::clock::Clock;
use crate::error::StopReason;
use crate::observe::{Count, MetricKeys, RetryCounters};
use crate::policy::RetryPolicy;
use crate::retry_after;
use crate::rng::RandomSource;
use crate::schedule::{self, Wait};
use crate::throttle::AdaptiveThrottle;

/// What the decider is told about one attempt's outcome.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Observed<'a> {
    /// Transient or final, from `classify`.
    pub(crate) verdict: Verdict,
    /// The dependency answered with an HTTP response (of any status).
    pub(crate) answered: bool,
    /// The response's `Retry-After`, if any.
    pub(crate) retry_after: Option<&'a HeaderValue>,
    /// A copy of the request is at hand for another attempt.
    pub(crate) can_resend: bool,
}

/// A retry paid for whose attempt has not started.
#[derive(Debug, Clone, Copy)]
struct Pending {
    cost: u64,
    delay: Duration,
    honours_floor: bool,
}

/// The decisions of one logical request.
#[derive(Debug)]
pub(crate) struct Decider<'a> {
    policy: &'a RetryPolicy,
    budget: Option<&'a RetryBudget>,
    counters: &'a RetryCounters,
    metric_keys: &'a MetricKeys,
    max_attempts: u32,
    retries_disabled: bool,
    started: Instant,
    /// Attempts started so far.
    attempt: u32,
    waited: Duration,
    /// What the last started retry cost, for a refund on success.
    last_cost: u64,
    /// The dependency's adaptive throttle, if it has one.
    throttle: Option<&'a AdaptiveThrottle>,
    /// When the throttle admitted the attempt in flight.
    admitted_at: Instant,
    /// The last backoff drawn (without a `Retry-After` floor), for decorrelated jitter.
    last_backoff: Option<Duration>,
    pending: Option<Pending>,
}

impl<'a> Decider<'a> {
    /// Starts a logical request at `now` (counted as one request).
    pub(crate) fn start(
        policy: &'a RetryPolicy,
        budget: Option<&'a RetryBudget>,
        counters: &'a RetryCounters,
        metric_keys: &'a MetricKeys,
        retries_disabled: bool,
        now: Instant,
    ) -> Self {
        counters.add(Count::Request, metric_keys);
        Decider {
            policy,
            budget,
            counters,
            metric_keys,
            max_attempts: if retries_disabled {
                1
            } else {
                policy.max_attempts()
            },
            retries_disabled,
            started: now,
            attempt: 0,
            waited: Duration::ZERO,
            last_cost: 0,
            throttle: None,
            admitted_at: now,
            last_backoff: None,
            pending: None,
        }
    }

    /// Puts the attempts of this request under `throttle`.
    pub(crate) fn with_throttle(mut self, throttle: Option<&'a AdaptiveThrottle>) -> Self {
        self.throttle = throttle;
        self
    }

    /// Asks the throttle, if any, whether the next attempt may go: called after
    /// [`next_attempt`](Self::next_attempt) allowed it, before it is sent. The first attempt is
    /// asked at the request's start, without a clock reading.
    ///
    /// # Errors
    ///
    /// [`StopReason::Throttled`] when the throttle rejects it; a retry's tokens are given back,
    /// and the rejection is counted.
    pub(crate) fn admit(
        &mut self,
        time: &dyn Clock,
        rng: &dyn RandomSource,
    ) -> Result<(), StopReason> {
        let Some(throttle) = self.throttle else {
            return Ok(());
        };
        let now = if self.attempt == 0 {
            self.started
        } else {
            time.now()
        };
        if throttle.admit(now, rng) {
            self.admitted_at = now;
            return Ok(());
        }
        self.give_back();
        self.count(Count::Throttled);
        Err(StopReason::Throttled)
    }

    /// Tells the throttle, if any, that the attempt just finished, and whether the dependency
    /// accepted it.
    ///
    /// Counted at the instant it was admitted when no attempt can outlast a slice of the
    /// window (the default: 10 s slices, 10 s attempt timeouts), which spares a clock reading;
    /// on a reading of its own otherwise (a window of a few seconds, whose slices are shorter
    /// than an attempt may take).
    pub(crate) fn finished(&self, accepted: bool, time: &dyn Clock) {
        if let Some(throttle) = self.throttle {
            let at = if throttle.slice() >= self.policy.attempt_timeout() {
                self.admitted_at
            } else {
                time.now()
            };
            throttle.finished(at, accepted);
        }
    }

    /// Whether this request's attempts are throttled: the driver then judges each outcome for
    /// the throttle.
    pub(crate) fn throttled(&self) -> bool {
        self.throttle.is_some()
    }

    /// When the logical request started, on the clock it was given.
    pub(crate) fn started(&self) -> Instant {
        self.started
    }

    /// Attempts started so far.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The time spent in finished waits.
    pub(crate) fn waited(&self) -> Duration {
        self.waited
    }

    /// Whether another attempt may follow the next one: whether the driver needs to keep a copy
    /// of the request.
    pub(crate) fn may_retry_after_next(&self) -> bool {
        self.attempt + 1 < self.max_attempts
    }

    fn count(&self, count: Count) {
        self.counters.add(count, self.metric_keys);
    }

    fn remaining(&self, now: Instant) -> Duration {
        let elapsed = now.saturating_duration_since(self.started);
        self.policy.deadline().saturating_sub(elapsed)
    }

    /// The timeout of the next attempt: the policy's, cut to what the deadline leaves. Called
    /// when the previous wait (if any) has finished; nothing is counted until
    /// [`attempt_started`](Self::attempt_started).
    ///
    /// # Errors
    ///
    /// [`StopReason::DeadlineReached`] when the deadline passed during the wait (a real clock
    /// that slept longer than asked); the retry's tokens are given back.
    pub(crate) fn next_attempt(&mut self, time: &dyn Clock) -> Result<Duration, StopReason> {
        let timeout = self.policy.attempt_timeout();
        let Some(pending) = self.pending else {
            // The first attempt: the deadline cannot have been reached, no clock reading.
            return Ok(timeout.min(self.policy.deadline()));
        };
        self.waited = self.waited.saturating_add(pending.delay);
        let remaining = self.remaining(time.now());
        if remaining.is_zero() {
            self.give_back();
            self.count(Count::DeadlineStop);
            return Err(StopReason::DeadlineReached);
        }
        Ok(timeout.min(remaining))
    }

    /// The attempt the last [`next_attempt`](Self::next_attempt) allowed is being sent: counts
    /// it (and the retry, which now uses its tokens).
    pub(crate) fn attempt_started(&mut self) {
        self.attempt += 1;
        self.count(Count::Attempt);
        if let Some(pending) = self.pending.take() {
            self.last_cost = pending.cost;
            self.count(Count::Retry);
            if pending.honours_floor {
                self.count(Count::RetryAfterHonoured);
            }
        }
    }

    /// Decides what follows the attempt just finished: a wait before the next attempt, or a
    /// stop. `time` is read only when a retry is in question; `rng` draws the jitter.
    pub(crate) fn after_attempt(
        &mut self,
        observed: Observed<'_>,
        time: &dyn Clock,
        rng: &dyn RandomSource,
    ) -> Wait {
        let kind = match observed.verdict {
            Verdict::Final(stop) => {
                self.settle(stop, observed.answered);
                return Wait::Stop(stop);
            }
            Verdict::Transient(kind, _) => kind,
        };
        let stop = if self.retries_disabled {
            StopReason::RetriesDisabled
        } else if self.attempt >= self.max_attempts {
            StopReason::AttemptsExhausted
        } else if !observed.can_resend {
            StopReason::BodyNotCloneable
        } else {
            let remaining = self.remaining(time.now());
            if remaining.is_zero() {
                StopReason::DeadlineReached
            } else {
                let floor = observed
                    .retry_after
                    .and_then(|value| retry_after::parse(value.as_bytes(), time.wall_now()));
                let retry = self.attempt - 1;
                let previous = self.last_backoff.unwrap_or(self.policy.base_delay());
                let (wait, backoff) =
                    schedule::next_wait(self.policy, retry, previous, floor, remaining, rng);
                if backoff.is_some() {
                    self.last_backoff = backoff;
                }
                match wait {
                    Wait::Stop(stop) => stop,
                    Wait::Sleep(delay) => match self.withdraw(kind, time.now()) {
                        Some(cost) => {
                            self.pending = Some(Pending {
                                cost,
                                delay,
                                honours_floor: floor.is_some(),
                            });
                            return Wait::Sleep(delay);
                        }
                        None => {
                            self.count(Count::BudgetRefusal);
                            StopReason::BudgetExhausted
                        }
                    },
                }
            }
        };
        if stop == StopReason::DeadlineReached {
            self.count(Count::DeadlineStop);
        }
        Wait::Stop(stop)
    }

    /// Withdraws a retry's cost; without a budget every retry is free.
    fn withdraw(&self, kind: crate::budget::RetryKind, now: Instant) -> Option<u64> {
        match self.budget {
            None => Some(0),
            Some(budget) => budget.try_withdraw(kind, now),
        }
    }

    /// The budget's part in a final outcome: a first attempt the dependency answered (with a
    /// response that is not a transient failure) deposits; a success after retries refunds its
    /// last retry, if the budget refunds.
    fn settle(&self, stop: StopReason, answered: bool) {
        let Some(budget) = self.budget else {
            return;
        };
        let earned = matches!(stop, StopReason::Succeeded | StopReason::NotRetryable);
        if self.attempt == 1 {
            if answered && earned {
                budget.deposit_first_attempt();
            }
        } else if stop == StopReason::Succeeded {
            budget.refund(self.last_cost);
        }
    }

    /// Returns a withdrawal no attempt has used.
    fn give_back(&mut self) {
        if let (Some(pending), Some(budget)) = (self.pending.take(), self.budget) {
            budget.cancel_withdrawal(pending.cost);
        }
    }
}

impl Drop for Decider<'_> {
    fn drop(&mut self) {
        self.give_back();
    }
}

#[cfg(test)]
mod tests;
