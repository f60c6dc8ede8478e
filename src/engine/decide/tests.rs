//! The decision core, without a socket or a runtime: one test per stop reason and per
//! precedence between them, the budget's rules, the give-back on drop, and a model-based test
//! of whole scripts against a reference model of the contract.

use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant, SystemTime};

use http::{HeaderMap, HeaderValue, StatusCode};

use super::*;
use crate::engine::rules::Http;
use crate::engine::seen::Target;
use crate::observe::CounterSnapshot;

#[cfg(feature = "grpc")]
mod grpc;
mod hedges;
mod model;
mod quota;

/// Time for the core: moved by hand, never by itself. The core is handed readings of it.
#[derive(Debug)]
pub(super) struct Time {
    now: Mutex<Instant>,
    wall: SystemTime,
}

impl Time {
    pub(super) fn new() -> Time {
        Time {
            now: Mutex::new(Instant::now()),
            wall: SystemTime::UNIX_EPOCH + Duration::from_secs(1_767_225_600),
        }
    }

    pub(super) fn advance(&self, by: Duration) {
        *self.now.lock().unwrap() += by;
    }

    pub(super) fn now(&self) -> Instant {
        *self.now.lock().unwrap()
    }
}

/// Where the tests' requests go.
pub(super) const URL: Target<'static> = Target {
    scheme: "http",
    host: "a.test",
    port: Some(80),
};

/// The target of the absolute URL `url`, as a door reads it.
pub(super) fn target(url: &str) -> Target<'static> {
    let uri: &'static http::Uri = Box::leak(Box::new(url.parse().unwrap()));
    Target::new(
        uri.scheme_str().unwrap(),
        uri.host().unwrap(),
        uri.port_u16(),
    )
}
static NO_HEADERS: LazyLock<HeaderMap> = LazyLock::new(HeaderMap::new);

/// An answer from [`URL`] with `status` and `headers`.
pub(super) fn answer(status: u16, headers: &HeaderMap) -> Answer<'_> {
    Answer {
        status: StatusCode::from_u16(status).unwrap(),
        headers,
        from: &URL,
    }
}

/// Headers with one `Retry-After`.
fn retry_after(value: &'static str) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(http::header::RETRY_AFTER, HeaderValue::from_static(value));
    headers
}

/// The driver's calls, with readings of a [`Time`].
pub(super) trait Drive {
    /// The next attempt's timeout, or why it is not made; a hold is a test failure.
    fn next(&mut self, time: &Time) -> Result<Duration, StopReason>;
    fn after(&mut self, observed: Observed<'_>, time: &Time, rng: &dyn RandomSource) -> Wait;
}

impl Drive for Decider<'_> {
    fn next(&mut self, time: &Time) -> Result<Duration, StopReason> {
        match self.next_attempt(time.now(), Some(&URL), TOP) {
            Next::Send(timeout) => Ok(timeout),
            Next::Stop(stop) => Err(stop),
            Next::Hold(hold) => panic!("held {hold:?}"),
        }
    }

    fn after(&mut self, observed: Observed<'_>, time: &Time, rng: &dyn RandomSource) -> Wait {
        self.after_attempt(observed, time.now(), &|| time.wall, rng)
    }
}

pub(super) const MS: Duration = Duration::from_millis(1);

pub(super) fn secs(s: u64) -> Duration {
    Duration::from_secs(s)
}

/// Everything a decider borrows.
pub(super) struct Setup {
    pub(super) policy: RetryPolicy,
    pub(super) budget: Option<RetryBudget>,
    pub(super) counters: RetryCounters,
    keys: MetricKeys,
    pub(super) throttle: Option<AdaptiveThrottle>,
    pub(super) quota: QuotaState,
    pub(super) latency: Option<LatencyWindow>,
    pub(super) rules: Arc<dyn Rules>,
    pub(super) time: Time,
}

impl Setup {
    pub(super) fn new(policy: RetryPolicy, budget: Option<RetryBudget>) -> Setup {
        Setup {
            policy,
            budget,
            counters: RetryCounters::new(),
            keys: MetricKeys::new("test"),
            throttle: None,
            quota: QuotaState::default(),
            latency: None,
            rules: Arc::new(Http),
            time: Time::new(),
        }
    }

    fn default() -> Setup {
        Setup::new(RetryPolicy::default(), Some(RetryBudget::default()))
    }

    pub(super) fn decider(&self, retries_disabled: bool) -> Decider<'_> {
        Decider::start(
            &self.policy,
            self.accounts(),
            if retries_disabled {
                Cap::NoRetries
            } else {
                Cap::Policy
            },
            &http::Method::GET,
            self.time.now(),
        )
    }

    pub(super) fn accounts(&self) -> Accounts<'_> {
        Accounts {
            budget: self.budget.as_ref(),
            counters: &self.counters,
            metric_keys: &self.keys,
            throttle: self.throttle.as_ref(),
            quota: &self.quota,
            latency: self.latency.as_ref(),
            rules: &*self.rules,
        }
    }

    pub(super) fn counts(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    fn balance(&self) -> u64 {
        self.budget.as_ref().unwrap().balance_milli()
    }
}

pub(super) fn transient() -> Observed<'static> {
    Observed {
        verdict: Verdict::Transient(Cause::Status { throttled: false }),
        answer: Some(answer(503, &NO_HEADERS)),
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    }
}

/// A transient failure whose answer carried these headers.
fn asking(headers: &HeaderMap) -> Observed<'_> {
    Observed {
        answer: Some(answer(503, headers)),
        ..transient()
    }
}

/// A transient failure whose request cannot be sent again.
fn not_resendable() -> Observed<'static> {
    Observed {
        resend: None,
        ..transient()
    }
}

pub(super) fn final_(stop: StopReason, answered: bool) -> Observed<'static> {
    Observed {
        verdict: Verdict::Final(stop),
        answer: answered.then(|| answer(200, &NO_HEADERS)),
        resend: Some(&URL),
        timed_out: false,
        unsent: false,
    }
}

/// The largest draw: every jittered wait takes its full ceiling.
pub(super) const TOP: &dyn RandomSource = &|| u64::MAX;

/// Starts the next attempt, which must be allowed; returns its timeout.
pub(super) fn begin(d: &mut Decider<'_>, time: &Time) -> Duration {
    let timeout = d.next(time).expect("the attempt is allowed");
    d.attempt_started();
    timeout
}

pub(super) fn policy(
    f: impl FnOnce(
        crate::engine::policy::RetryPolicyBuilder,
    ) -> crate::engine::policy::RetryPolicyBuilder,
) -> RetryPolicy {
    f(RetryPolicy::builder()).build().unwrap()
}

#[test]
fn a_first_attempt_gets_the_attempt_timeout_cut_to_the_deadline() {
    let s = Setup::new(
        policy(|p| p.attempt_timeout(secs(10)).deadline(secs(4))),
        None,
    );
    let mut d = s.decider(false);
    assert_eq!(begin(&mut d, &s.time), secs(4));
    let s = Setup::default();
    let mut d = s.decider(false);
    assert_eq!(begin(&mut d, &s.time), secs(10));
}

#[test]
fn a_success_stops_and_a_first_attempt_answered_deposits() {
    let s = Setup::default();
    let spent = s.budget.as_ref().unwrap();
    assert!(spent.try_withdraw(RetryKind::Other, s.time.now()).is_some());
    let before = s.balance();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(final_(StopReason::Succeeded, true), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::Succeeded));
    assert_eq!(s.balance(), before + 100);
}

#[test]
fn an_answer_that_is_not_retryable_earns_but_an_error_earns_nothing() {
    let s = Setup::new(
        RetryPolicy::default(),
        Some(RetryBudget::builder().initial(0.0).build().unwrap()),
    );
    for _ in 0..10 {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        // A permanent error: another middleware's, a redirect loop; no answer came back.
        let next = d.after(final_(StopReason::NotRetryable, false), &s.time, TOP);
        assert_eq!(next, Wait::Stop(StopReason::NotRetryable));
    }
    assert_eq!(s.balance(), 0);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    d.after(final_(StopReason::NotRetryable, true), &s.time, TOP);
    assert_eq!(s.balance(), 100, "a 404 is an answer");
}

#[test]
fn a_committed_call_settles_as_a_success_does() {
    // A first attempt that committed deposits.
    let s = Setup::new(
        RetryPolicy::default(),
        Some(RetryBudget::builder().initial(0.0).build().unwrap()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(final_(StopReason::Committed, true), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::Committed));
    assert_eq!(s.balance(), 100);
    // After a retry, a budget that refunds successes refunds the committed call's last retry.
    let s = Setup::new(
        RetryPolicy::default(),
        Some(
            RetryBudget::builder()
                .refund_on_success(true)
                .build()
                .unwrap(),
        ),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert!(matches!(d.after(transient(), &s.time, TOP), Wait::Sleep(_)));
    let paid = s.balance();
    s.time.advance(100 * MS);
    begin(&mut d, &s.time);
    d.after(final_(StopReason::Committed, true), &s.time, TOP);
    assert_eq!(s.balance(), paid + 1_000, "the retry's token back");
}

#[test]
fn a_transient_failure_unsafe_to_repeat_stops_and_earns_nothing() {
    let s = Setup::new(
        RetryPolicy::default(),
        Some(RetryBudget::builder().initial(0.0).build().unwrap()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(final_(StopReason::NotSafeToRetry, true), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::NotSafeToRetry));
    assert_eq!(s.balance(), 0);
}

#[test]
fn a_transient_failure_is_paid_for_before_the_wait_and_counted_when_the_retry_starts() {
    let s = Setup::default();
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(transient(), &s.time, TOP);
    assert_eq!(next, Wait::Sleep(100 * MS));
    assert_eq!(s.balance(), 9_000, "paid before the wait");
    assert_eq!(s.counts().retries, 0, "no retry yet");
    s.time.advance(100 * MS);
    begin(&mut d, &s.time);
    assert_eq!(s.counts().retries, 1);
    assert_eq!(s.counts().attempts, 2);
    assert_eq!(d.waited(), 100 * MS);
    assert_eq!(s.budget.as_ref().unwrap().retries(), 1);
}

#[test]
fn a_retry_gets_the_attempt_timeout_cut_to_what_the_deadline_leaves() {
    let s = Setup::new(
        policy(|p| p.attempt_timeout(secs(10)).deadline(secs(12))),
        None,
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(5));
    assert_eq!(d.after(transient(), &s.time, TOP), Wait::Sleep(100 * MS));
    s.time.advance(100 * MS);
    assert_eq!(begin(&mut d, &s.time), secs(7) - 100 * MS);
}

#[test]
fn dropping_the_request_during_its_wait_gives_the_tokens_back_and_counts_no_retry() {
    let s = Setup::default();
    {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        assert!(matches!(d.after(transient(), &s.time, TOP), Wait::Sleep(_)));
        assert_eq!(s.balance(), 9_000);
    }
    assert_eq!(s.balance(), 10_000);
    assert_eq!(s.budget.as_ref().unwrap().retries(), 0);
    let counts = s.counts();
    assert_eq!((counts.attempts, counts.retries), (1, 0));
}

#[test]
fn dropping_the_request_during_a_retry_keeps_the_tokens_spent() {
    let s = Setup::default();
    {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        d.after(transient(), &s.time, TOP);
        begin(&mut d, &s.time);
    }
    assert_eq!(s.balance(), 9_000, "the retry was made");
    assert_eq!(s.counts().retries, 1);
}

#[test]
fn a_deadline_that_passed_during_the_wait_stops_before_the_attempt_and_gives_back() {
    let s = Setup::new(
        policy(|p| p.deadline(secs(1))),
        Some(RetryBudget::default()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(d.after(transient(), &s.time, TOP), Wait::Sleep(100 * MS));
    // The real clock overslept, past the deadline.
    s.time.advance(secs(2));
    assert_eq!(d.next(&s.time), Err(StopReason::DeadlineReached));
    assert_eq!(s.balance(), 10_000);
    let counts = s.counts();
    assert_eq!(
        (counts.attempts, counts.retries, counts.deadline_stops),
        (1, 0, 1)
    );
}

#[test]
fn retries_disabled_stops_a_transient_failure_and_nothing_else() {
    let s = Setup::default();
    let mut d = s.decider(true);
    assert!(!d.may_retry_after_next(), "no copy needed");
    begin(&mut d, &s.time);
    let next = d.after(not_resendable(), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::RetriesDisabled));
    let mut d = s.decider(true);
    begin(&mut d, &s.time);
    let next = d.after(final_(StopReason::Succeeded, true), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::Succeeded));
    assert_eq!(s.balance(), 10_000);
}

/// A request whose deadline left room for no retry's wait (the override cut it to one
/// attempt): its transient failure stops with the deadline as the reason, counted as a
/// deadline stop; a final outcome keeps its own reason.
#[test]
fn one_attempt_allowed_by_a_short_deadline_ends_with_the_deadline() {
    let s = Setup::new(
        policy(|p| p.max_attempts(1).deadline(Duration::from_millis(50))),
        Some(RetryBudget::default()),
    );
    let mut d = Decider::start(
        &s.policy,
        s.accounts(),
        Cap::Deadline,
        &http::Method::GET,
        s.time.now(),
    );
    begin(&mut d, &s.time);
    assert_eq!(
        d.after(transient(), &s.time, TOP),
        Wait::Stop(StopReason::DeadlineReached)
    );
    assert_eq!(s.counts().deadline_stops, 1);
    let mut d = Decider::start(
        &s.policy,
        s.accounts(),
        Cap::Deadline,
        &http::Method::GET,
        s.time.now(),
    );
    begin(&mut d, &s.time);
    let next = d.after(final_(StopReason::Succeeded, true), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::Succeeded));
    assert_eq!(s.counts().deadline_stops, 1);
    assert_eq!(s.balance(), 10_000);
}

#[test]
fn attempts_exhausted_comes_before_a_body_that_cannot_be_resent_and_the_deadline() {
    let s = Setup::new(
        policy(|p| p.max_attempts(2).deadline(secs(1))),
        Some(RetryBudget::default()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert!(!d.may_retry_after_next(), "the second attempt is the last");
    d.after(transient(), &s.time, TOP);
    begin(&mut d, &s.time);
    s.time.advance(secs(5));
    let next = d.after(not_resendable(), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::AttemptsExhausted));
    assert_eq!(s.counts().deadline_stops, 0);
}

#[test]
fn a_body_that_cannot_be_resent_comes_before_the_deadline_and_costs_no_token() {
    let s = Setup::new(
        policy(|p| p.deadline(secs(1))),
        Some(RetryBudget::default()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(5));
    let next = d.after(not_resendable(), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::BodyNotCloneable));
    assert_eq!(s.balance(), 10_000);
    assert_eq!(s.counts().deadline_stops, 0);
}

#[test]
fn a_deadline_already_reached_comes_before_retry_after_and_the_budget() {
    let s = Setup::new(
        policy(|p| p.deadline(secs(1))),
        Some(RetryBudget::builder().initial(0.0).build().unwrap()),
    );
    let long = retry_after("3600");
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(1));
    let next = d.after(asking(&long), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::DeadlineReached));
    let counts = s.counts();
    assert_eq!((counts.deadline_stops, counts.budget_refusals), (1, 0));
}

#[test]
fn a_retry_after_too_long_comes_before_the_budget_and_costs_no_token() {
    let s = Setup::new(
        RetryPolicy::default(),
        Some(RetryBudget::builder().initial(0.0).build().unwrap()),
    );
    for value in ["3600", "30"] {
        // 3600 s is over max_retry_after; 30 s is at the deadline (30 s).
        let header = retry_after(value);
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        let next = d.after(asking(&header), &s.time, TOP);
        assert_eq!(next, Wait::Stop(StopReason::RetryAfterTooLong), "{value}");
    }
    let counts = s.counts();
    assert_eq!((counts.budget_refusals, counts.deadline_stops), (0, 0));
}

#[test]
fn a_wait_that_would_end_past_the_deadline_stops_and_costs_no_token() {
    let s = Setup::new(
        policy(|p| p.base_delay(secs(2)).max_delay(secs(2)).deadline(secs(3))),
        Some(RetryBudget::default()),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    s.time.advance(secs(1));
    let next = d.after(transient(), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::DeadlineReached));
    assert_eq!(s.balance(), 10_000);
    assert_eq!(s.counts().deadline_stops, 1);
}

#[test]
fn the_budget_refuses_last_and_counts_the_refusal() {
    let s = Setup::new(
        RetryPolicy::default(),
        Some(
            RetryBudget::builder()
                .initial(0.0)
                .floor_per_sec(0.0)
                .build()
                .unwrap(),
        ),
    );
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(transient(), &s.time, TOP);
    assert_eq!(next, Wait::Stop(StopReason::BudgetExhausted));
    assert_eq!(s.counts().budget_refusals, 1);
    assert_eq!(s.budget.as_ref().unwrap().refusals(), 1);
}

#[test]
fn without_a_budget_every_retry_is_free() {
    let s = Setup::new(RetryPolicy::default(), None);
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    assert_eq!(d.after(transient(), &s.time, TOP), Wait::Sleep(100 * MS));
    begin(&mut d, &s.time);
    assert_eq!(d.after(transient(), &s.time, TOP), Wait::Sleep(200 * MS));
    begin(&mut d, &s.time);
    assert_eq!(
        d.after(transient(), &s.time, TOP),
        Wait::Stop(StopReason::AttemptsExhausted)
    );
    assert_eq!(s.counts().retries, 2);
}

#[test]
fn kinds_cost_what_the_budget_says() {
    let s = Setup::new(RetryPolicy::default(), Some(RetryBudget::aws_like()));
    for (cause, cost) in [
        (Cause::Status { throttled: false }, 5_000),
        (Cause::Fault(Fault::Reset), 5_000),
        (Cause::Classifier, 5_000),
        (Cause::Fault(Fault::Timeout), 10_000),
        (Cause::Status { throttled: true }, 1_000),
    ] {
        let before = s.balance();
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        let observed = Observed {
            verdict: Verdict::Transient(cause),
            ..transient()
        };
        assert!(matches!(d.after(observed, &s.time, TOP), Wait::Sleep(_)));
        begin(&mut d, &s.time);
        assert_eq!(before - s.balance(), cost, "{cause:?}");
    }
}

#[test]
fn only_a_success_after_retries_refunds() {
    let s = Setup::new(RetryPolicy::default(), Some(RetryBudget::aws_like()));
    let run = |last: Observed<'static>| {
        let mut d = s.decider(false);
        begin(&mut d, &s.time);
        d.after(transient(), &s.time, TOP);
        begin(&mut d, &s.time);
        d.after(last, &s.time, TOP)
    };
    assert_eq!(
        run(final_(StopReason::NotRetryable, true)),
        Wait::Stop(StopReason::NotRetryable)
    );
    assert_eq!(s.balance(), 495_000, "a 404 after a retry refunds nothing");
    run(final_(StopReason::Succeeded, true));
    assert_eq!(s.balance(), 495_000, "paid 5, refunded 5");
}

#[test]
fn a_retry_after_floor_is_honoured_and_counted_when_the_retry_starts() {
    let s = Setup::default();
    let header = retry_after("7");
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(asking(&header), &s.time, TOP);
    assert_eq!(next, Wait::Sleep(secs(7) + 100 * MS));
    assert_eq!(s.counts().retry_after_honoured, 0);
    begin(&mut d, &s.time);
    assert_eq!(s.counts().retry_after_honoured, 1);
}

#[test]
fn an_invalid_retry_after_falls_back_to_the_backoff() {
    let s = Setup::default();
    let header = retry_after("soon");
    let mut d = s.decider(false);
    begin(&mut d, &s.time);
    let next = d.after(asking(&header), &s.time, TOP);
    assert_eq!(next, Wait::Sleep(100 * MS));
    begin(&mut d, &s.time);
    assert_eq!(s.counts().retry_after_honoured, 0);
}

#[test]
fn counters_count_requests_and_attempts_as_they_start() {
    let s = Setup::default();
    let d = s.decider(false);
    assert_eq!(s.counts().requests, 1);
    assert_eq!(s.counts().attempts, 0);
    drop(d);
    assert_eq!(s.counts().attempts, 0);
}
