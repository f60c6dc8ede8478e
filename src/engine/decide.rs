//! The decision core: for one logical request, what to do next.
//!
//! A [`Decider`] is a small state machine with no I/O, no clock and no awaiting, in the manner of
//! a sans-IO protocol core: the driver (the middleware) hands it the time and asks what the next
//! attempt may do, then tells it the attempt's outcome, and it answers with the next action:
//! send attempt *n* within timeout *t*, hold *d* for a spent quota, sleep *d*, or stop for
//! reason *r*. It does all the budget, quota and throttle accounting and all the counting, so
//! every rule below can be tested without a socket or a runtime, and another driver could reuse
//! it. The request starts here when `send()` is called, before any hold: the deadline covers
//! holds, attempts and waits alike.
//!
//! The driver talks to it through a few verbs whose answers carry all it needs (`plan.rs`:
//! [`Decider::plan`] before each attempt, [`Decider::at_limit`] and, for a hedged one,
//! [`Decider::copy`] while one is out, [`Decider::ended`] after it); the finer steps below are what those verbs
//! are made of, and what the core's tests drive one by one.
//!
//! # Where each rule lives
//!
//! | rule | where |
//! |---|---|
//! | transient or final, method safety, the cost kind | `classify` (the [`Verdict`] passed in) |
//! | which stop reason wins | [`Decider::after_attempt`], in the order below |
//! | backoff, `Retry-After` floor, no wait past the deadline | `schedule::next_wait` |
//! | the attempt's timeout cut to what the deadline leaves | [`Decider::next_attempt`] |
//! | a spent quota: hold, probe or stop before an attempt; a floor before a retry | [`Decider::next_attempt`], [`Decider::after_attempt`], on `rate_limit::QuotaState` |
//! | the throttle: admit before an attempt, count it when it ends or is dropped | here, on the [`AdaptiveThrottle`] |
//! | charge before sleep, deposit, refund, give back | here, on the [`RetryBudget`] |
//! | counters | here: a retry counts when its attempt starts, a stamped key when the first does |
//! | the attempt's timeout from measured latency, doubled after a timeout | [`Decider::next_attempt`], on `latency::LatencyWindow` |
//! | whether and when a hedge goes, what it costs, which copy's outcome counts | [`Decider::next_attempt`], [`Decider::copy`] ([`Decider::hedge`] for an HTTP read, [`Decider::call_copy`] for a hedged gRPC call), [`Decider::hedge_won`]; when each copy goes: `course`; which requests may be hedged: `classify` |
//!
//! # Precedence
//!
//! After an attempt, the first rule that applies decides:
//!
//! 1. a final verdict: [`Succeeded`](StopReason::Succeeded),
//!    [`NotRetryable`](StopReason::NotRetryable) or [`NotSafeToRetry`](StopReason::NotSafeToRetry);
//! 2. the request forbade retries: [`RetriesDisabled`](StopReason::RetriesDisabled);
//! 3. the last allowed attempt was made: [`AttemptsExhausted`](StopReason::AttemptsExhausted),
//!    or [`DeadlineReached`](StopReason::DeadlineReached) when the request's deadline was too
//!    short for any retry and so allowed one;
//! 4. no copy of the request can be sent: [`BodyNotCloneable`](StopReason::BodyNotCloneable);
//! 5. the deadline has passed: [`DeadlineReached`](StopReason::DeadlineReached);
//! 6. the schedule: a `Retry-After` too long
//!    ([`RetryAfterTooLong`](StopReason::RetryAfterTooLong)), a spent quota whose reset is too
//!    far ([`QuotaExhausted`](StopReason::QuotaExhausted)), or a wait that would end past the
//!    deadline ([`DeadlineReached`](StopReason::DeadlineReached));
//! 7. the budget refuses: [`BudgetExhausted`](StopReason::BudgetExhausted).
//!
//! The budget comes last on purpose: a retry that a cheaper rule forbids must not cost a token.
//!
//! Before each attempt (the first included), [`Decider::next_attempt`] asks, in order: the
//! deadline, a copy to send, the origin's quota (hold, or stop with
//! [`QuotaExhausted`](StopReason::QuotaExhausted), or go as the probe), then the throttle
//! ([`Throttled`](StopReason::Throttled)).
//!
//! # Cancellation
//!
//! A retry is paid for before its wait (charge-before-sleep), so while the driver sleeps the
//! decider holds a withdrawal that no attempt has used yet. If the request is dropped then (the
//! caller's own timeout, a `select!`), or the deadline turns out to have passed when the wait
//! ends, the decider's `Drop` gives the tokens back: a guard, not a convention. Nothing is
//! counted for a retry until its attempt starts, so a dropped request leaves counters that
//! count only what happened. A hedge is a retry sent early, and costs what a retry costs once it
//! is sent: dropped with it on the wire, the request keeps it paid for (the server got the copy
//! whether or not its caller waits for it), and only a hedge never sent gives its tokens back.
//! The same guard gives back a quota probe that got no answer, and
//! tells the throttle that an attempt on the wire got no accept: its caller gave up on it (the
//! instant it was admitted stands for the instant it ended, as the core has no clock).

use std::time::{Duration, SystemTime};

use crate::clock::Instant;

use http::HeaderMap;

use crate::engine::budget::{RetryBudget, RetryKind};
use crate::engine::classify::{Cause, Verdict};
use crate::engine::course::{CopyEnd, Course, Pushback};
use crate::engine::latency::LatencyWindow;
use crate::engine::observed::{Answer, Observed};
use crate::engine::policy::RetryPolicy;
use crate::engine::rate_limit::{self, Gate, Origin, ProbeTicket, QuotaState};
use crate::engine::retry_after;
use crate::engine::rules::Rules;
use crate::engine::schedule::{self, Wait};
use crate::engine::seen::Locate;
use crate::engine::throttle::{self, AdaptiveThrottle};
use crate::fault::Fault;
use crate::observe::{Balance, Count, MetricKeys, RetryCounters};
use crate::rng::RandomSource;
use crate::stop::StopReason;

/// The most holds one request waits out before it gives up with
/// [`StopReason::QuotaExhausted`].
const MOST_HOLDS: u8 = 16;

/// What a dependency's requests share: the accounts the core keeps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Accounts<'a> {
    pub(crate) budget: Option<&'a RetryBudget>,
    pub(crate) counters: &'a RetryCounters,
    pub(crate) metric_keys: &'a MetricKeys,
    pub(crate) throttle: Option<&'a AdaptiveThrottle>,
    pub(crate) quota: &'a QuotaState,
    /// The latency window, when the policy measures it.
    pub(crate) latency: Option<&'a LatencyWindow>,
    /// The dependency's rules: HTTP's, or its protocol's (`engine::rules`).
    pub(crate) rules: &'a dyn Rules,
}

impl Accounts<'_> {
    /// The budget, as the metrics read its balance.
    fn balance(&self) -> Option<&dyn Balance> {
        self.budget.map(|budget| budget as &dyn Balance)
    }
}

/// What an answer says of its origin's quota: its `RateLimit` field, unless a valid wait field
/// (`Retry-After`, or a millisecond one) beside it takes precedence, when the wait fields are
/// read (`waits_read`: the policy reads them, and the answer is a transient failure; on a
/// final answer they are never read, so one there cancels nothing).
fn quota_said(headers: &HeaderMap, waits_read: bool) -> Option<rate_limit::Quota> {
    rate_limit::of_response(headers).filter(|_| !(waits_read && retry_after::is_asked(headers)))
}

/// What a retry after a failure of `cause` costs the budget: a throttled answer (429) and a
/// timeout are priced apart (the budget's `throttled_cost` and `timeout_cost`), every other
/// cause at the retry's base cost.
fn cost_kind(cause: Cause) -> RetryKind {
    match cause {
        Cause::Status { throttled: true } => RetryKind::Throttled,
        Cause::Fault(Fault::Timeout) => RetryKind::Timeout,
        Cause::Status { .. } | Cause::Fault(_) | Cause::Classifier => RetryKind::Other,
    }
}

/// What the next attempt may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Send it, within this timeout.
    Send(Duration),
    /// Hold it this long (a spent quota), then ask again.
    Hold(Duration),
    /// Send nothing more.
    Stop(StopReason),
}

/// The second copy of an attempt (a hedge), until the attempt's outcome is taken in.
#[derive(Debug)]
struct Hedge {
    /// What it withdrew from the budget, given back if the request is dropped with it out.
    cost: u64,
    /// When the throttle admitted it, if there is a throttle.
    admitted: Option<Instant>,
    /// When it was sent (the window's time).
    sent_at: u64,
}

/// What caps a request's attempts besides its policy: what its override said.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cap {
    /// The policy's attempts.
    Policy,
    /// One attempt: the request forbade retries.
    NoRetries,
    /// One attempt: the request's deadline leaves no room for a retry's wait.
    Deadline,
}

/// A retry paid for whose attempt has not started.
#[derive(Debug, Clone, Copy)]
struct Pending {
    cost: u64,
    honours_floor: bool,
}

/// The decisions of one logical request.
#[derive(Debug)]
pub(crate) struct Decider<'a> {
    policy: &'a RetryPolicy,
    accounts: Accounts<'a>,
    cap: Cap,
    started: Instant,
    /// Attempts started so far.
    attempt: u32,
    /// In nanoseconds, saturating (584 years): the decider lives in every request's future,
    /// which is kept small.
    waited: u64,
    /// The wait (sleep or hold) last answered, counted as waited when the next question comes;
    /// in nanoseconds, saturating.
    asleep: u64,
    /// What the last started retry cost, for a refund on success.
    last_cost: u64,
    /// The request's key was stamped here: counted when the first attempt is sent.
    stamped: bool,
    /// When the throttle admitted the last attempt it was asked about.
    admitted: Option<Instant>,
    /// That attempt is on the wire: sent, and not yet ended.
    on_wire: bool,
    /// Holds answered so far.
    holds: u8,
    /// The probe of a spent quota this request took, until its answer (boxed: rare, and the
    /// decider lives in every request's future).
    probe: Option<Box<ProbeTicket>>,
    /// The floor the last transient answer set: its `Retry-After`, or its quota's reset.
    floor: Option<Duration>,
    /// The last backoff drawn (without a floor), for decorrelated jitter.
    /// In nanoseconds, saturating; `u64::MAX` before the first (kept small: see `waited`).
    last_backoff: u64,
    pending: Option<Pending>,
    /// When the last attempt was allowed to go, in its dependency's latency window's time
    /// (kept only when the dependency measures its latency).
    sent_at: u64,
    /// The last attempt's time limit, in microseconds (saturating), and whether it timed out:
    /// a retry after a timeout gets twice the limit (kept only when latency is measured).
    last_limit_us: u32,
    last_timed_out: bool,
    /// The hedging state of a request that may be hedged; boxed, as few requests may be, and
    /// the decider lives in every request's future, which is kept small.
    hedging: Option<Box<Hedging>>,
    /// The attempts the backoff does not count: those made when a gRPC server last pushed
    /// back (it counts its retries from there), and a transparent retry since (past 255
    /// attempts, from the 255th).
    backoff_from: u8,
    /// A gRPC call's transparent retry was made: one attempt more than its policy's.
    transparent: bool,
    /// A hedged gRPC call: its copies' ends were counted by the throttling one by one.
    hedged: bool,
}

/// The hedging state of one request: when a hedge may go, and the one out.
#[derive(Debug, Default)]
struct Hedging {
    /// When the attempt last allowed may be hedged, if it may.
    after: Option<Duration>,
    /// The hedge on the wire, until the attempt's outcome is taken in.
    out: Option<Hedge>,
    /// The last outcome taken in came from a hedge.
    answered: bool,
}

impl<'a> Decider<'a> {
    /// Starts a logical request at `now`, when `send()` is called (counted as one request,
    /// whatever follows).
    pub(crate) fn start(
        policy: &'a RetryPolicy,
        accounts: Accounts<'a>,
        cap: Cap,
        method: &http::Method,
        now: Instant,
    ) -> Self {
        accounts
            .counters
            .add(Count::Request, accounts.metric_keys, accounts.balance());
        // A method the policy does not retry goes once, as under `no_retries`.
        let cap = if policy.is_retryable_method(method) {
            cap
        } else {
            Cap::NoRetries
        };
        Decider {
            policy,
            accounts,
            cap,
            started: now,
            attempt: 0,
            waited: 0,
            asleep: 0,
            last_cost: 0,
            stamped: false,
            admitted: None,
            on_wire: false,
            holds: 0,
            probe: None,
            floor: None,
            last_backoff: u64::MAX,
            pending: None,
            sent_at: 0,
            last_limit_us: 0,
            last_timed_out: false,
            hedging: None,
            backoff_from: 0,
            transparent: false,
            hedged: false,
        }
    }

    /// The request may be hedged, if its policy hedges reads: it is a read without a key whose
    /// body can be sent twice (`classify::may_be_hedged`).
    fn allow_hedges(&mut self) {
        if self.policy.hedge_reads().is_some() {
            self.hedging = Some(Box::default());
        }
    }

    /// How long after the attempt last allowed a hedge of it may be sent, if one may.
    fn hedge_after(&self) -> Option<Duration> {
        self.hedging.as_deref()?.after
    }

    /// Whether the outcome last taken in came from a hedge.
    pub(crate) fn hedge_answered(&self) -> bool {
        self.hedging.as_deref().is_some_and(|h| h.answered)
    }

    /// The next attempt's timeout before the deadline cuts it, given the one from the measured
    /// latency (if the window has one): it, or the policy's; after a timeout, twice the last
    /// attempt's limit, up to the policy's.
    fn measured_timeout(&self, measured: Option<Duration>) -> Duration {
        let timeout = measured.unwrap_or(self.policy.attempt_timeout());
        if self.last_timed_out {
            let doubled = Duration::from_micros(u64::from(self.last_limit_us) * 2);
            return timeout.max(doubled).min(self.policy.attempt_timeout());
        }
        timeout
    }

    /// The request's key was stamped by the middleware: counted once its first attempt is sent.
    fn key_stamped(&mut self) {
        self.stamped = true;
    }

    /// The most attempts this request makes: 1 when it forbade retries.
    fn max_attempts(&self) -> u32 {
        if self.cap == Cap::NoRetries {
            1
        } else {
            self.policy.max_attempts() + u32::from(self.transparent)
        }
    }

    /// The policy the request runs under.
    pub(crate) fn policy(&self) -> &'a RetryPolicy {
        self.policy
    }

    /// The rules the request is judged and scheduled by.
    pub(crate) fn rules(&self) -> &'a dyn Rules {
        self.accounts.rules
    }

    /// Attempts started so far.
    pub(crate) fn attempts(&self) -> u32 {
        self.attempt
    }

    /// The time spent in finished waits and holds.
    pub(crate) fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited)
    }

    /// The floor the last transient answer set (its `Retry-After`, or the reset of the quota
    /// spent at the origin the retry goes to), whether or not a wait followed; `None` after an
    /// answer that is not retried.
    pub(crate) fn floor(&self) -> Option<Duration> {
        self.floor
    }

    /// Whether another attempt may follow the next one: whether the driver needs to keep a copy
    /// of the request.
    fn may_retry_after_next(&self) -> bool {
        self.attempt + 1 < self.max_attempts()
    }

    fn count(&self, count: Count) {
        let accounts = &self.accounts;
        accounts
            .counters
            .add(count, accounts.metric_keys, accounts.balance());
    }

    /// The time left at `now` before the request's deadline.
    fn remaining(&self, now: Instant) -> Duration {
        if now == self.started {
            // The first attempt without a hold, as nearly every request's: no subtraction.
            return self.policy.deadline();
        }
        let elapsed = now.saturating_duration_since(self.started);
        self.policy.deadline().saturating_sub(elapsed)
    }

    /// Whether this request heeds quotas, and some quota of its dependency may be spent.
    fn quota_in_question(&self) -> bool {
        self.policy.rate_limit_fields() && self.accounts.quota.maybe_spent()
    }

    /// What the next attempt may do at `now`: called before the first attempt, after each wait
    /// and after each hold. `resend` is where a copy of the request would go, if one is at hand.
    ///
    /// In order: the deadline ([`StopReason::DeadlineReached`], when a wait or hold ended past
    /// it), a copy to send ([`StopReason::BodyNotCloneable`]), the origin's quota (a hold, a
    /// probe, or [`StopReason::QuotaExhausted`] when its hold would be longer than
    /// `max_retry_after` or than the deadline leaves), the throttle
    /// ([`StopReason::Throttled`]). A stop gives back what a retry paid; nothing is counted
    /// as an attempt until [`attempt_started`](Self::attempt_started).
    fn next_attempt(
        &mut self,
        now: Instant,
        resend: Option<&dyn Locate>,
        rng: &dyn RandomSource,
    ) -> Next {
        self.waited = self.waited.saturating_add(std::mem::take(&mut self.asleep));
        let remaining = self.remaining(now);
        if remaining.is_zero() {
            return self.refuse(StopReason::DeadlineReached);
        }
        let Some(url) = resend else {
            return self.refuse(StopReason::BodyNotCloneable);
        };
        if self.quota_in_question() {
            match self.accounts.quota.gate(&Origin::of(url.target()), now) {
                Gate::Open => {}
                Gate::Probe(ticket) => self.probe = Some(Box::new(ticket)),
                // A clock whose sleeps pass no time would hold for ever: a few holds are all
                // a request ever needs (one per reset or probe it waits for).
                Gate::Held(_) if self.holds >= MOST_HOLDS => {
                    return self.refuse(StopReason::QuotaExhausted);
                }
                Gate::Held(hold) => {
                    self.holds += 1;
                    let retry = self.attempt.saturating_sub(1);
                    return match schedule::hold(self.policy, retry, hold, remaining, rng) {
                        Wait::Sleep(hold) => {
                            self.asleep = nanos(hold);
                            Next::Hold(hold)
                        }
                        Wait::Stop(stop) => self.refuse(stop),
                    };
                }
            }
        }
        if let Some(throttle) = self.accounts.throttle {
            if !throttle.admit(now, rng) {
                self.count(Count::Throttled);
                return self.refuse(StopReason::Throttled);
            }
            self.admitted = Some(now);
        }
        let Some(window) = self.accounts.latency else {
            return Next::Send(self.policy.attempt_timeout().min(remaining));
        };
        let (measured, at) = window.measured(now);
        // The window measures for the dependency; a request whose policy says its own fixed
        // timeout (an override's) is not cut at the dependency's measured limit.
        let taken = measured
            .timeout
            .filter(|_| self.policy.timeout_from_latency().is_some());
        let limit = self.measured_timeout(taken).min(remaining);
        self.sent_at = at;
        self.last_limit_us = u32::try_from(limit.as_micros()).unwrap_or(u32::MAX);
        // A hedge is a retry sent early: only an attempt that a retry may follow is hedged
        // (not the last one the limit allows, nor one of a request that forbade retries).
        let may_follow = self.may_retry_after_next();
        if let Some(hedging) = self.hedging.as_deref_mut() {
            hedging.after = (measured.hedge_after).filter(|after| may_follow && *after < limit);
        }
        Next::Send(limit)
    }

    /// The attempt on the wire reached its time limit at `now`: `None` cuts it there (it timed
    /// out); `Some(more)` lets it run `more` longer, up to the fixed attempt timeout (and the
    /// deadline). Only a limit from measured latency below the fixed timeout is a guess worth
    /// a second look: while the dependency's cuts are few (its window's allowance), the attempt
    /// is a straggler and is cut, so a retry may answer sooner; past the allowance, attempts
    /// reaching their limits together are a brownout, and each runs on instead of becoming a
    /// retry that the budget pays for and that meets the same slowness.
    ///
    /// An attempt planned with a hedge is cut at its limit: its hedge is its second look.
    pub(crate) fn at_limit(&mut self, now: Instant) -> Option<Duration> {
        let window = self.accounts.latency?;
        if self.hedge_after().is_some() {
            return None;
        }
        let limit = Duration::from_micros(u64::from(self.last_limit_us));
        let more = (self.policy.attempt_timeout())
            .saturating_sub(limit)
            .min(self.remaining(now));
        if more.is_zero() || window.take_cut(now) {
            return None;
        }
        self.last_limit_us = u32::try_from((limit + more).as_micros()).unwrap_or(u32::MAX);
        Some(more)
    }

    /// Whether a hedge of the attempt on the wire may go at `now`, to `resend`: its time limit
    /// if so. It is paid for from the budget like a retry, and the deadline, the origin's
    /// quota (no hold, no probe: a hedge only ever goes through an open gate) and the throttle
    /// apply to it. At most one per attempt.
    fn hedge(
        &mut self,
        now: Instant,
        resend: &dyn Locate,
        rng: &dyn RandomSource,
    ) -> Option<Duration> {
        let limit = match self.hedging.as_deref() {
            Some(h) if h.out.is_none() && h.after.is_some() => {
                Duration::from_micros(u64::from(self.last_limit_us))
            }
            _ => return None,
        };
        let remaining = self.remaining(now);
        if remaining.is_zero() {
            return None;
        }
        if self.quota_in_question() {
            match self.accounts.quota.gate(&Origin::of(resend.target()), now) {
                Gate::Open => {}
                Gate::Probe(ticket) => {
                    self.accounts.quota.give_back(&ticket);
                    return None;
                }
                Gate::Held(_) => return None,
            }
        }
        let cost = self.withdraw(RetryKind::Other, now)?;
        let admitted = match self.accounts.throttle {
            None => None,
            Some(throttle) if throttle.admit(now, rng) => Some(now),
            Some(_) => {
                if let Some(budget) = self.accounts.budget {
                    budget.cancel_withdrawal(cost);
                }
                return None;
            }
        };
        let sent_at = self.accounts.latency.map_or(0, |window| window.micros(now));
        if let Some(hedging) = self.hedging.as_deref_mut() {
            hedging.out = Some(Hedge {
                cost,
                admitted,
                sent_at,
            });
        }
        Some(limit.min(remaining))
    }

    /// The hedge [`hedge`](Self::hedge) allowed could not be sent (no timer for it): what it
    /// withdrew comes back, and its admission counts nothing (the throttle's admission of a
    /// copy not sent counts nothing, as for an attempt).
    fn hedge_unsent(&mut self) {
        let Some(hedge) = self.hedging.as_deref_mut().and_then(|h| h.out.take()) else {
            return;
        };
        if let Some(budget) = self.accounts.budget {
            budget.cancel_withdrawal(hedge.cost);
        }
    }

    /// The hedge [`hedge`](Self::hedge) allowed is being sent: counted, and from now on what
    /// it cost stays spent, whatever becomes of it.
    fn hedge_started(&mut self) {
        self.count(Count::Hedge);
    }

    /// A copy after the first (a hedge, or a hedged call's later copy), not the first, gave
    /// the outcome about to be taken in: a hedge's time is measured and its admission
    /// counted, and the first copy is the one given up.
    fn hedge_won(&mut self) {
        let hedging = self.hedging.get_or_insert_with(Box::default);
        if let Some(hedge) = hedging.out.as_mut() {
            // With a throttle both copies were admitted (without one, neither): the hedge's
            // admission is now the one the outcome settles, the first copy's the one given up.
            std::mem::swap(&mut self.sent_at, &mut hedge.sent_at);
            std::mem::swap(&mut self.admitted, &mut hedge.admitted);
        }
        hedging.answered = true;
        self.count(Count::HedgeWon);
    }

    /// Ends the hedge of the attempt just ended: the copy that did not answer was given up
    /// (the throttle counts it as not accepted); what it cost stays spent.
    fn settle_hedge(&mut self) {
        let Some(hedge) = self.hedging.as_deref_mut().and_then(|h| h.out.take()) else {
            return;
        };
        if let (Some(throttle), Some(admitted)) = (self.accounts.throttle, hedge.admitted) {
            throttle.finished(admitted, false);
        }
    }

    /// What the attempt that just ended at `now` says of the dependency's latency: an answer's
    /// time (unless its status is retried: a fast failure), or a timeout.
    fn measure(&mut self, observed: &Observed<'_>, now: Instant) {
        let Some(window) = self.accounts.latency else {
            return;
        };
        self.last_timed_out = observed.timed_out;
        if observed.timed_out {
            window.timed_out(now);
        } else if let Some(answer) = observed.answer {
            if !self.policy.is_retryable_status(answer.status) {
                window.answered_since(self.sent_at, now);
            }
        }
    }

    /// Stops before an attempt: gives back what no attempt will use, counts a deadline stop.
    fn refuse(&mut self, stop: StopReason) -> Next {
        self.give_back();
        if stop == StopReason::DeadlineReached {
            self.count(Count::DeadlineStop);
        }
        Next::Stop(stop)
    }

    /// The attempt the last [`next_attempt`](Self::next_attempt) allowed is being sent: counts
    /// it (and the retry, which now uses its tokens; and a stamped key, on the first).
    fn attempt_started(&mut self) {
        self.attempt += 1;
        if let Some(hedging) = self.hedging.as_deref_mut() {
            hedging.answered = false;
        }
        self.count(Count::Attempt);
        self.on_wire = self.admitted.is_some();
        if self.attempt == 1 && self.stamped {
            self.count(Count::KeyStamped);
        }
        if let Some(pending) = self.pending.take() {
            self.last_cost = pending.cost;
            self.count(Count::Retry);
            if pending.honours_floor {
                self.count(Count::RetryAfterHonoured);
            }
        }
    }

    /// The stop that follows the attempt just ended, when it needs no reading of the time: a
    /// final verdict, with nothing for the quota to take in (no probe out, no `RateLimit` field)
    /// and no throttle that counts it at its end rather than its admission. Most requests end
    /// so, and the driver then reads no clock for them. `None`: ask
    /// [`after_attempt`](Self::after_attempt) with the time.
    fn stop_without_time(&mut self, observed: &Observed<'_>) -> Option<StopReason> {
        let Verdict::Final(stop) = observed.verdict else {
            return None;
        };
        if self.accounts.latency.is_some() {
            // The answer's time is measured (and a hedge, if any, settled).
            return None;
        }
        let throttle = match (
            self.accounts.throttle,
            self.admitted.filter(|_| self.on_wire),
        ) {
            (Some(throttle), Some(admitted)) => {
                if !self.counted_at_admission(throttle) {
                    return None;
                }
                Some((throttle, admitted))
            }
            _ => None,
        };
        if self.probe.is_some() {
            return None;
        }
        if let (true, Some(answer)) = (self.policy.rate_limit_fields(), observed.answer) {
            if rate_limit::is_in(answer.headers) {
                return None;
            }
        }
        if let Some((throttle, admitted)) = throttle {
            self.on_wire = false;
            let status = observed.answer.map(|answer| answer.status);
            throttle.finished(admitted, throttle::accepted(status, self.policy));
        }
        self.floor = None;
        self.settle(stop, observed.answer.is_some());
        Some(stop)
    }

    /// Decides what follows the attempt that just ended at `now`: a wait before the next
    /// attempt, or a stop. `wall` is the wall time, for a `Retry-After` date; `rng` draws the
    /// jitter. The throttle learns whether the dependency accepted the attempt, and the quota
    /// what the answer said of it.
    fn after_attempt(
        &mut self,
        observed: Observed<'_>,
        now: Instant,
        wall: &dyn Fn() -> SystemTime,
        rng: &dyn RandomSource,
    ) -> Wait {
        self.settle_hedge();
        self.measure(&observed, now);
        if let (Some(throttle), Some(admitted)) = (self.accounts.throttle, self.off_the_wire()) {
            let at = if self.counted_at_admission(throttle) {
                admitted
            } else {
                now
            };
            let status = observed.answer.map(|answer| answer.status);
            throttle.finished(at, throttle::accepted(status, self.policy));
        }
        let probe = self.probe.take();
        if let (true, Some(answer)) = (self.policy.rate_limit_fields(), observed.answer) {
            let transient = matches!(observed.verdict, Verdict::Transient(_));
            self.take_in_quota(answer, probe.as_deref(), now, transient);
        }
        self.floor = None;
        let kind = match observed.verdict {
            Verdict::Final(stop) => {
                self.settle(stop, observed.answer.is_some());
                return Wait::Stop(stop);
            }
            Verdict::Transient(cause) => cost_kind(cause),
        };
        // What the server asked for (`retry-after-ms`, `x-ms-retry-after-ms` or `Retry-After`)
        // is reported whatever follows; a quota may raise it below.
        self.floor = (observed.answer)
            .filter(|_| self.policy.retry_after_fields())
            .and_then(|answer| self.server_floor(answer.headers, wall));
        if self.transparent_retry(&observed, now) {
            return Wait::Sleep(Duration::ZERO);
        }
        let stop = if self.cap == Cap::NoRetries {
            StopReason::RetriesDisabled
        } else if self.attempt >= self.max_attempts() {
            // A deadline too short for any retry's wait is what allowed the one attempt.
            match self.cap {
                Cap::Deadline => StopReason::DeadlineReached,
                _ => StopReason::AttemptsExhausted,
            }
        } else if let Some(url) = observed.resend {
            match self.schedule(kind, url, now, rng) {
                Ok(delay) => return Wait::Sleep(delay),
                Err(stop) => stop,
            }
        } else {
            StopReason::BodyNotCloneable
        };
        if stop == StopReason::DeadlineReached {
            self.count(Count::DeadlineStop);
        }
        Wait::Stop(stop)
    }

    /// The wait the server asked for on a transient answer, as the rules read it (HTTP's
    /// `retry-after-ms`, `x-ms-retry-after-ms` or `Retry-After`; gRPC's pushback, which starts
    /// the backoff again from its first wait).
    fn server_floor(
        &mut self,
        headers: &HeaderMap,
        wall: &dyn Fn() -> SystemTime,
    ) -> Option<Duration> {
        let said = self.accounts.rules.server_wait(headers, wall);
        if said.restarts_backoff {
            self.backoff_from = u8::try_from(self.attempt).unwrap_or(u8::MAX);
        }
        said.floor
    }

    /// The attempt ended in `observed`: the rules' own account (gRPC's throttling) counts it,
    /// and a retry it does not allow becomes [`StopReason::BudgetExhausted`].
    fn count_end(&self, observed: &mut Observed<'_>) {
        if self.hedged {
            // Each copy was counted as it ended.
            return;
        }
        let allowed = self.accounts.rules.counted(observed);
        if !allowed && matches!(observed.verdict, Verdict::Transient(_)) {
            self.count(Count::BudgetRefusal);
            observed.verdict = Verdict::Final(StopReason::BudgetExhausted);
        }
    }

    /// An outcome that the rules take, at or after the deadline, for the deadline (a gRPC
    /// server's `CANCELLED`) ended at the deadline: [`StopReason::DeadlineReached`], which the
    /// gRPC door hands back as `DEADLINE_EXCEEDED`, as grpc-java's call does. The time is read
    /// only for such an outcome.
    #[inline]
    fn ended_at_deadline(&self, observed: &mut Observed<'_>, now: &dyn Fn() -> Instant) {
        // A success is its own outcome, whenever it came (the common case, asked nothing).
        if observed.verdict == Verdict::Final(StopReason::Succeeded) {
            return;
        }
        if self.accounts.rules.at_deadline(observed) && self.remaining(now()).is_zero() {
            observed.verdict = Verdict::Final(StopReason::DeadlineReached);
        }
    }

    /// The delay between the copies of a request its rules hedge as a call (A6's hedging
    /// policy), unless the request forbade retries.
    fn call_course(&self) -> Option<Duration> {
        let delay = self.accounts.rules.course()?;
        (self.cap == Cap::Policy).then_some(delay)
    }

    /// Whether the request's copies are each an attempt of its own (its rules hedge it as a
    /// call), rather than an attempt's (an HTTP hedge).
    fn copies_are_attempts(&self) -> bool {
        self.accounts.rules.course().is_some()
    }

    /// The course of the attempt about to be sent at `now`, which [`plan`](Self::plan) said
    /// may be hedged after `delay`: a hedged call's (its copies up to the attempts its policy
    /// allows), or a hedged attempt's (one hedge).
    pub(crate) fn course(&self, delay: Duration, now: Instant) -> Course {
        if self.copies_are_attempts() {
            let more = self.max_attempts().saturating_sub(self.attempt + 1);
            Course::call(delay, more, now)
        } else {
            Course::attempt(delay, now)
        }
    }

    /// Whether a further copy of the hedged request may go at `now`, to `resend`: its plan if
    /// so, paid for; else why no copy goes any more. A hedged attempt's hedge as
    /// [`hedge`](Self::hedge) says; a hedged call's copy as [`call_copy`](Self::call_copy)
    /// says. The driver then says whether it went ([`copy_sent`](Self::copy_sent)).
    pub(crate) fn copy(
        &mut self,
        now: Instant,
        resend: Option<&dyn Locate>,
        rng: &dyn RandomSource,
    ) -> Result<Plan, StopReason> {
        if self.copies_are_attempts() {
            return self.call_copy(now, resend);
        }
        let limit = resend.and_then(|resend| self.hedge(now, resend, rng));
        let limit = limit.ok_or(StopReason::AttemptsExhausted)?;
        Ok(Plan {
            number: self.attempt,
            limit,
            left: self.remaining(now),
            keep_copy: true,
            hedge_after: None,
        })
    }

    /// The copy last planned went (`true`: counted, and what it cost stays spent, whatever
    /// becomes of it), or could not (no timer for it: what it withdrew comes back).
    pub(crate) fn copy_sent(&mut self, went: bool) {
        match (went, self.copies_are_attempts()) {
            (true, true) => {
                self.count(Count::Hedge);
                self.attempt_started();
            }
            (true, false) => self.hedge_started(),
            (false, true) => {
                if let (Some(pending), Some(budget)) = (self.pending.take(), self.accounts.budget) {
                    budget.cancel_withdrawal(pending.cost);
                }
            }
            (false, false) => self.hedge_unsent(),
        }
    }

    /// Whether a further copy of the hedged call may go at `now`, to `resend`: its plan if so,
    /// paid for; else why no copy goes any more. In order: the policy's attempts, the
    /// deadline, a copy to send, the channel's throttling (above half of its tokens), the
    /// budget.
    fn call_copy(&mut self, now: Instant, resend: Option<&dyn Locate>) -> Result<Plan, StopReason> {
        self.hedged = true;
        if self.attempt >= self.max_attempts() {
            return Err(StopReason::AttemptsExhausted);
        }
        let left = self.remaining(now);
        if left.is_zero() {
            self.count(Count::DeadlineStop);
            return Err(StopReason::DeadlineReached);
        }
        if resend.is_none() {
            return Err(StopReason::BodyNotCloneable);
        }
        if self.accounts.rules.refuses_copies() {
            self.count(Count::BudgetRefusal);
            return Err(StopReason::BudgetExhausted);
        }
        let Some(cost) = self.withdraw(RetryKind::Other, now) else {
            self.count(Count::BudgetRefusal);
            return Err(StopReason::BudgetExhausted);
        };
        self.pending = Some(Pending {
            cost,
            honours_floor: false,
        });
        Ok(Plan {
            number: self.attempt + 1,
            limit: left,
            left,
            keep_copy: true,
            hedge_after: None,
        })
    }

    /// When a hedged call whose next copy is due at `at` (seen at `now`) is next asked about:
    /// `at`, or the call's deadline if that comes first. A pushback or a hedging delay longer
    /// than what is left sends no further copy: the call waits for the copies out or its
    /// deadline, where [`copy`](Self::copy) refuses the copy and the call ends
    /// `DEADLINE_EXCEEDED`, as grpc-java's hedged call does.
    pub(crate) fn copy_at(&self, at: Instant, now: Instant) -> Instant {
        let left = self.remaining(now);
        if at.saturating_duration_since(now) < left {
            return at;
        }
        now.checked_add(left).unwrap_or(at)
    }

    /// How a copy of the hedged request ended, in `observed`, for its course. A hedged
    /// attempt's copy ends it with a final verdict, else fails (the other copy may answer;
    /// what the attempt's end counts is counted when it ends). A hedged call's copy: the rules'
    /// own account counts it (as it counts an attempt's end); a copy cut at its limit reached
    /// the call's deadline; a non-fatal failure carries the wait the server asked for
    /// (`wall`: the wall time, for rules that read a date).
    pub(crate) fn copy_ended(
        &mut self,
        mut observed: Observed<'_>,
        now: Instant,
        wall: &dyn Fn() -> SystemTime,
    ) -> CopyEnd {
        if !self.copies_are_attempts() {
            return match observed.verdict {
                Verdict::Final(stop) => CopyEnd::Ends(stop),
                Verdict::Transient(_) => CopyEnd::NonFatal(Pushback::Absent),
            };
        }
        self.hedged = true;
        let _ = self.accounts.rules.counted(&observed);
        self.ended_at_deadline(&mut observed, &|| now);
        match observed.verdict {
            Verdict::Final(StopReason::ServerDeclinedRetry) => CopyEnd::NonFatal(Pushback::Stop),
            Verdict::Final(stop) => CopyEnd::Ends(stop),
            Verdict::Transient(_) if observed.timed_out => {
                CopyEnd::Ends(StopReason::DeadlineReached)
            }
            Verdict::Transient(_) => {
                let wait = observed.answer.and_then(|answer| {
                    (self.accounts.rules.server_wait(answer.headers, wall)).floor
                });
                CopyEnd::NonFatal(wait.map_or(Pushback::Absent, Pushback::Wait))
            }
        }
    }

    /// What gRPC's metrics count of the call's attempts: whether one was a transparent retry,
    /// and whether those after the first were hedges.
    pub(crate) fn tally(&self) -> crate::record::Tally {
        crate::record::Tally {
            transparent: self.transparent,
            hedged: self.hedged,
        }
    }

    /// Whether a gRPC call's attempt that sent nothing the server acted on is retried at once,
    /// as A6's transparent retry: once per call, beyond its policy's attempts, without a wait,
    /// unpaid, within its deadline, unless the call forbade retries.
    fn transparent_retry(&mut self, observed: &Observed<'_>, now: Instant) -> bool {
        let may = self.accounts.rules.retries_unsent_at_once()
            && observed.unsent
            && !self.transparent
            && self.cap == Cap::Policy
            && observed.resend.is_some()
            && !self.remaining(now).is_zero();
        if may {
            self.transparent = true;
            self.backoff_from = self.backoff_from.saturating_add(1);
        }
        may
    }

    /// What an answer said of its origin's quota, taken in; a probe's answer clears the quota
    /// it probed unless it says again that it is spent. The wait fields beside it are read
    /// only on a `transient` failure, as everywhere else.
    fn take_in_quota(
        &mut self,
        answer: Answer<'_>,
        probe: Option<&ProbeTicket>,
        now: Instant,
        transient: bool,
    ) {
        let quota = self.accounts.quota;
        if let Some(ticket) = probe {
            quota.clear_probed(ticket, now);
        }
        let waits_read = transient && self.policy.retry_after_fields();
        if let Some(said) = quota_said(answer.headers, waits_read) {
            quota.update(&Origin::of(answer.from.target()), Some(said), now);
        }
    }

    /// The wait before a retry of a transient failure of `kind` (whose `Retry-After` is in
    /// `self.floor`), paid for; or why none.
    fn schedule(
        &mut self,
        kind: RetryKind,
        resend: &dyn Locate,
        now: Instant,
        rng: &dyn RandomSource,
    ) -> Result<Duration, StopReason> {
        let remaining = self.remaining(now);
        if remaining.is_zero() {
            return Err(StopReason::DeadlineReached);
        }
        let retry_after = self.floor;
        // A quota spent at the origin the retry goes to is a floor like `Retry-After`.
        let quota = if self.quota_in_question() {
            self.accounts.quota.floor(&Origin::of(resend.target()), now)
        } else {
            None
        };
        let by_quota = quota > retry_after;
        let floor = retry_after.max(quota);
        self.floor = floor;
        let retry = self.attempt - 1 - u32::from(self.backoff_from).min(self.attempt - 1);
        let previous = match self.last_backoff {
            u64::MAX => self.policy.base_delay(),
            nanos => Duration::from_nanos(nanos),
        };
        let (wait, backoff) = schedule::next_wait(
            (self.policy, self.accounts.rules),
            retry,
            previous,
            floor,
            remaining,
            rng,
        );
        if let Some(backoff) = backoff {
            // One of 584 years or more saturates to the mark of none: no wait that long ends
            // before a deadline, so no later draw reads it.
            self.last_backoff = nanos(backoff);
        }
        let delay = match wait {
            Wait::Stop(StopReason::RetryAfterTooLong) if by_quota => {
                return Err(StopReason::QuotaExhausted);
            }
            Wait::Stop(StopReason::DeadlineReached | StopReason::RetryAfterTooLong)
                if self.accounts.rules.waits_out_the_deadline()
                    && floor.is_none_or(|f| f >= remaining) =>
            {
                // A gRPC call whose next wait (a backoff, a pushback) would cross its deadline
                // waits for the deadline and ends there, `DEADLINE_EXCEEDED`, as grpc-go's and
                // grpc-java's calls do: the wait is cut to what is left, no retry is paid for,
                // and the next plan finds the deadline passed.
                self.asleep = nanos(remaining);
                return Ok(remaining);
            }
            Wait::Stop(stop) => return Err(stop),
            Wait::Sleep(delay) => delay,
        };
        let Some(cost) = self.withdraw(kind, now) else {
            self.count(Count::BudgetRefusal);
            return Err(StopReason::BudgetExhausted);
        };
        self.pending = Some(Pending {
            cost,
            honours_floor: floor.is_some(),
        });
        self.asleep = nanos(delay);
        Ok(delay)
    }

    /// The request's budget, if its dependency has one.
    pub(crate) fn budget(&self) -> Option<&RetryBudget> {
        self.accounts.budget
    }

    /// Withdraws a retry's cost; without a budget every retry is free.
    fn withdraw(&self, kind: RetryKind, now: Instant) -> Option<u64> {
        match self.accounts.budget {
            None => Some(0),
            Some(budget) => budget.try_withdraw(kind, now),
        }
    }

    /// The budget's part in a final outcome: a first attempt the dependency answered (with a
    /// response that is not a transient failure) deposits; a success after retries refunds its
    /// last retry, if the budget refunds. A gRPC call that committed (its head a `200` without
    /// a status: the status follows in its trailers) settles as an HTTP `200` does: the budget
    /// cannot wait for the trailers, and the server answered. (A6's throttling, where a channel
    /// has it, reads the trailers' status instead.)
    fn settle(&self, stop: StopReason, answered: bool) {
        let Some(budget) = self.accounts.budget else {
            return;
        };
        let succeeded = matches!(stop, StopReason::Succeeded | StopReason::Committed);
        if self.attempt == 1 {
            if answered && (succeeded || stop == StopReason::NotRetryable) {
                budget.deposit_first_attempt();
            }
        } else if succeeded {
            budget.refund(self.last_cost);
        }
    }

    /// Whether `throttle` counts an attempt at the instant it admitted it: when no attempt can
    /// outlast a slice of its window (the default: 10 s slices, 10 s attempt timeouts), which
    /// spares a clock reading; at its end otherwise (a window of a few seconds).
    fn counted_at_admission(&self, throttle: &AdaptiveThrottle) -> bool {
        throttle.slice() >= self.policy.attempt_timeout()
    }

    /// The attempt on the wire has ended: when the throttle admitted it, if it did.
    fn off_the_wire(&mut self) -> Option<Instant> {
        std::mem::take(&mut self.on_wire)
            .then_some(self.admitted)
            .flatten()
    }

    /// Returns what no attempt has used: a retry's withdrawal, a probe not sent (an admission
    /// not sent counts nothing).
    fn give_back(&mut self) {
        if let (Some(pending), Some(budget)) = (self.pending.take(), self.accounts.budget) {
            budget.cancel_withdrawal(pending.cost);
        }
        if let Some(hedge) = self.hedging.as_deref_mut().and_then(|h| h.out.take()) {
            // Out when the request was dropped: it was sent, so what it cost stays spent (as a
            // retry's does once sent), and the throttle counts it as given up.
            if let (Some(throttle), Some(admitted)) = (self.accounts.throttle, hedge.admitted) {
                throttle.finished(admitted, false);
            }
        }
        if let Some(ticket) = self.probe.take() {
            self.accounts.quota.give_back(&ticket);
        }
    }
}

impl Drop for Decider<'_> {
    fn drop(&mut self) {
        self.give_back();
        // An attempt on the wire whose caller gave up: a request the dependency did not accept.
        if let (Some(throttle), Some(admitted)) = (self.accounts.throttle, self.off_the_wire()) {
            throttle.finished(admitted, false);
        }
    }
}

/// `d` in nanoseconds, saturating.
fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

mod plan;
pub(crate) use plan::{Facts, Plan, Step};

#[cfg(test)]
mod tests;
