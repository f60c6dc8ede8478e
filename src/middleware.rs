//! The attempt loop: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The loop clones the request for each attempt
//! (the original is kept for the next one), sets the attempt's timeout (the policy's, cut to what
//! the deadline leaves), sends it down the chain, asks `classify` whether the outcome is a
//! transient failure that is safe to repeat, and if so asks `schedule` for the wait (backoff,
//! `Retry-After` floor, deadline) and sleeps on the injected clock. Every decision is made by the
//! pure modules below it.

use std::time::Duration;

use http::{Extensions, HeaderValue};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Instrument;

use crate::body;
use crate::budget::{RetryBudget, RetryKind};
use crate::classify::{self, Fault};
use crate::clock::{Clock, SharedClock, TokioClock};
use crate::error::{RetryError, RetryRecord, StopReason};
use crate::idempotency::IdempotencyKeys;
use crate::policy::RetryPolicy;
use crate::retry_after;
use crate::rng::{Rng, SharedRng, ThreadRng};
use crate::schedule::{self, Wait};

/// A [`reqwest_middleware::Middleware`] that retries transient failures when repeating is safe.
///
/// ```
/// use reqwest_middleware::ClientBuilder;
/// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
///
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryPolicy::default()))
///     .build();
/// # drop(client);
/// ```
///
/// # Default
///
/// | part | default |
/// |---|---|
/// | clock | [`TokioClock`] ([`with_clock`](Self::with_clock)) |
/// | random source | [`ThreadRng`] ([`with_rng`](Self::with_rng)) |
/// | retry budget | a new [`RetryBudget::default()`] per middleware: about 10 % extra load ([`with_budget`](Self::with_budget), [`without_budget`](Self::without_budget)) |
/// | idempotency keys | [`IdempotencyKeys::default()`]: a quoted random UUID on POST and PATCH ([`with_idempotency_keys`](Self::with_idempotency_keys), [`without_idempotency_keys`](Self::without_idempotency_keys)) |
///
/// In tests, use `FakeClock`, [`SeededRng`](crate::SeededRng) and
/// [`SeededKeys`](crate::SeededKeys).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    policy: RetryPolicy,
    clock: SharedClock,
    rng: SharedRng,
    keys: Option<IdempotencyKeys>,
    budget: Option<RetryBudget>,
}

impl RetryMiddleware {
    /// Creates the middleware with `policy`, tokio's clock and the thread-local random source.
    pub fn new(policy: RetryPolicy) -> Self {
        RetryMiddleware {
            policy,
            clock: SharedClock(std::sync::Arc::new(TokioClock::new())),
            rng: SharedRng(std::sync::Arc::new(ThreadRng::new())),
            keys: Some(IdempotencyKeys::default()),
            budget: Some(RetryBudget::default()),
        }
    }

    /// Draws every retry from `budget`. Pass clones of one budget to every middleware that calls
    /// the same dependency, so they share one account.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Retries without a budget: only the attempt limit and the deadline bound them. During an
    /// outage every request then makes `max_attempts` attempts.
    pub fn without_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// The budget retries are drawn from, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// Stamps and recognises idempotency keys as `keys` says.
    pub fn with_idempotency_keys(mut self, keys: IdempotencyKeys) -> Self {
        self.keys = Some(keys);
        self
    }

    /// Neither stamps nor looks for idempotency keys: whether a request may be repeated depends
    /// on its method alone, and POST and PATCH are retried only on connect errors.
    pub fn without_idempotency_keys(mut self) -> Self {
        self.keys = None;
        self
    }

    /// Uses `clock` for every wait and every reading of the time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = SharedClock(std::sync::Arc::new(clock));
        self
    }

    /// Draws jitter from `rng`.
    pub fn with_rng(mut self, rng: impl Rng) -> Self {
        self.rng = SharedRng(std::sync::Arc::new(rng));
        self
    }

    /// The policy this middleware applies.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// Decides the request's key before the first attempt: the caller's own, kept as it is, or
    /// a new one if the method is stamped.
    fn key_for(&self, request: &mut Request) -> Result<Option<HeaderValue>, RetryError> {
        let Some(keys) = &self.keys else {
            return Ok(None);
        };
        if let Some(own) = request.headers().get(keys.header_name()) {
            return Ok(Some(own.clone()));
        }
        if !keys.stamps(request.method()) {
            return Ok(None);
        }
        match keys.new_value() {
            Ok(value) => {
                request
                    .headers_mut()
                    .insert(keys.header_name(), value.clone());
                Ok(Some(value))
            }
            Err(invalid) => Err(RetryError::new(
                0,
                StopReason::InvalidIdempotencyKey,
                None,
                reqwest_middleware::Error::middleware(invalid),
            )),
        }
    }

    async fn execute(
        &self,
        mut request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let policy = &self.policy;
        let max_attempts = policy.max_attempts();
        let idempotent = classify::is_idempotent(request.method());
        let key = match self.key_for(&mut request) {
            Ok(key) => key,
            Err(err) => {
                tracing::debug!(
                    attempts = 0,
                    reason = err.stop_reason().as_str(),
                    "retrying stopped"
                );
                return Err(err.into());
            }
        };
        let keyed = key.is_some();
        let clock = &*self.clock.0;
        let started = clock.now();
        let remaining = || {
            policy
                .deadline()
                .saturating_sub(clock.now().saturating_duration_since(started))
        };

        let mut attempt: u32 = 0;
        let mut waited = Duration::ZERO;
        let mut last_cost = 0;
        let mut pending = request;
        loop {
            attempt += 1;
            let spare = if attempt < max_attempts {
                pending.try_clone()
            } else {
                None
            };
            let mut sending = pending;
            limit_timeout(&mut sending, policy.attempt_timeout().min(remaining()));

            let mut outcome = next.clone().run(sending, extensions).await;
            if let (Some(limit), Ok(_)) = (policy.buffer_body_limit(), &outcome) {
                outcome = match outcome {
                    Ok(response) => body::buffer(response, limit)
                        .await
                        .map_err(reqwest_middleware::Error::Reqwest),
                    err => err,
                };
            }

            let verdict = judge(policy, &outcome, idempotent, keyed);
            let left = remaining();
            let decision = match verdict {
                Verdict::Final(stop) => Wait::Stop(stop),
                Verdict::Transient(..) if attempt >= max_attempts => {
                    Wait::Stop(StopReason::AttemptsExhausted)
                }
                Verdict::Transient(..) if spare.is_none() => {
                    Wait::Stop(StopReason::BodyNotCloneable)
                }
                Verdict::Transient(..) if left.is_zero() => Wait::Stop(StopReason::DeadlineReached),
                Verdict::Transient(kind, _) => {
                    let floor = outcome.as_ref().ok().and_then(|response| {
                        let value = response.headers().get(http::header::RETRY_AFTER)?;
                        retry_after::parse(value.as_bytes(), clock.wall_now())
                    });
                    match schedule::next_wait(policy, attempt - 1, floor, left, &*self.rng.0) {
                        // Charge before sleeping: a retry that waits has already been paid for.
                        Wait::Sleep(delay) => match &self.budget {
                            None => Wait::Sleep(delay),
                            Some(budget) => match budget.try_withdraw(kind, clock.now()) {
                                Some(cost) => {
                                    last_cost = cost;
                                    Wait::Sleep(delay)
                                }
                                None => Wait::Stop(StopReason::BudgetExhausted),
                            },
                        },
                        stop => stop,
                    }
                }
            };
            if let (
                Some(budget),
                Verdict::Final(StopReason::Succeeded | StopReason::NotRetryable),
            ) = (&self.budget, verdict)
            {
                if attempt == 1 {
                    budget.deposit_first_attempt();
                } else {
                    budget.refund(last_cost);
                }
            }
            log_attempt(attempt, &outcome, verdict, decision);
            let (delay, next_request) = match (decision, spare) {
                (Wait::Sleep(delay), Some(next_request)) => (delay, next_request),
                (decision, _) => {
                    let stop = match decision {
                        Wait::Stop(stop) => stop,
                        Wait::Sleep(_) => StopReason::BodyNotCloneable,
                    };
                    tracing::debug!(
                        attempts = attempt,
                        reason = stop.as_str(),
                        "retrying stopped"
                    );
                    let record = RetryRecord {
                        attempts: attempt,
                        stop,
                        waited,
                        key,
                        replayed: false,
                    };
                    return finish(outcome, record);
                }
            };
            // Release the connection before waiting rather than after.
            drop(outcome);
            clock.sleep(delay).await;
            waited = waited.saturating_add(delay);
            pending = next_request;
        }
    }
}

#[async_trait::async_trait]
impl Middleware for RetryMiddleware {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let span = tracing::debug_span!(
            "retry",
            method = %request.method(),
            host = request.url().host_str().unwrap_or(""),
            path = request.url().path(),
        );
        self.execute(request, extensions, next)
            .instrument(span)
            .await
    }
}

/// What an attempt's outcome calls for.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// A transient failure, safe to repeat: what a retry costs, and the reason for the trace.
    Transient(RetryKind, &'static str),
    /// No retry, for this reason.
    Final(StopReason),
}

fn judge(
    policy: &RetryPolicy,
    outcome: &reqwest_middleware::Result<Response>,
    idempotent: bool,
    keyed: bool,
) -> Verdict {
    let repeatable = idempotent || keyed;
    match outcome {
        Ok(response) => {
            let status = response.status();
            if !classify::is_transient_status(status, |s| policy.is_retryable_status(s), keyed) {
                return Verdict::Final(if status.as_u16() < 400 {
                    StopReason::Succeeded
                } else {
                    StopReason::NotRetryable
                });
            }
            if repeatable {
                let kind = if status == http::StatusCode::TOO_MANY_REQUESTS {
                    RetryKind::Throttled
                } else {
                    RetryKind::Other
                };
                Verdict::Transient(kind, "status")
            } else {
                Verdict::Final(StopReason::NotSafeToRetry)
            }
        }
        Err(err) => match classify::transport_fault(err) {
            None => Verdict::Final(StopReason::NotRetryable),
            Some(fault) if repeatable || fault.nothing_sent() => {
                let kind = if fault == Fault::Timeout {
                    RetryKind::Timeout
                } else {
                    RetryKind::Other
                };
                Verdict::Transient(kind, fault.as_str())
            }
            Some(_) => Verdict::Final(StopReason::NotSafeToRetry),
        },
    }
}

/// Gives the attempt the policy's timeout, unless the request already has a shorter one.
fn limit_timeout(request: &mut Request, limit: Duration) {
    let timeout = request.timeout_mut();
    *timeout = Some(timeout.map_or(limit, |t| t.min(limit)));
}

fn log_attempt(
    attempt: u32,
    outcome: &reqwest_middleware::Result<Response>,
    verdict: Verdict,
    decision: Wait,
) {
    let (status, error) = match outcome {
        Ok(r) => (Some(r.status().as_u16()), None),
        Err(e) => (
            e.status().map(|s| s.as_u16()),
            Some(match classify::transport_fault(e) {
                Some(f) => f.as_str(),
                None => "permanent",
            }),
        ),
    };
    let (decision, delay_ms) = match (verdict, decision) {
        (Verdict::Transient(_, why), Wait::Sleep(delay)) => (
            why,
            Some(u64::try_from(delay.as_millis()).unwrap_or(u64::MAX)),
        ),
        (_, Wait::Stop(stop)) => (stop.as_str(), None),
        (Verdict::Final(stop), _) => (stop.as_str(), None),
    };
    tracing::debug!(
        attempt,
        status,
        error,
        decision,
        delay_ms,
        "attempt finished"
    );
}

/// The header a server following the Stripe convention sets on a replayed response.
const REPLAYED: &str = "idempotent-replayed";

fn finish(
    outcome: reqwest_middleware::Result<Response>,
    mut record: RetryRecord,
) -> reqwest_middleware::Result<Response> {
    match outcome {
        Ok(mut response) => {
            record.replayed = response
                .headers()
                .get(REPLAYED)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            response.extensions_mut().insert(record);
            Ok(response)
        }
        Err(err) => Err(RetryError::new(record.attempts, record.stop, record.key, err).into()),
    }
}
