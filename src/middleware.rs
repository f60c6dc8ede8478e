//! The attempt loop: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The loop clones the request for each attempt
//! (the original is kept for the next one), sets the attempt's timeout, sends it down the chain,
//! asks [`classify`](crate::classify) whether the outcome is a transient failure that is safe to
//! repeat, and if so draws the wait from the backoff and sleeps on the injected clock. Every other
//! decision is made by the pure modules below it.

use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Instrument;

use crate::backoff;
use crate::body;
use crate::classify;
use crate::clock::{Clock, SharedClock, TokioClock};
use crate::error::{RetryError, RetryRecord, StopReason};
use crate::policy::RetryPolicy;
use crate::rng::{Rng, SharedRng, ThreadRng};

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
/// The clock is [`TokioClock`] and the random source [`ThreadRng`]; replace them with
/// [`with_clock`](Self::with_clock) and [`with_rng`](Self::with_rng), for example with
/// `FakeClock` and [`SeededRng`](crate::SeededRng) in tests.
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    policy: RetryPolicy,
    clock: SharedClock,
    rng: SharedRng,
}

impl RetryMiddleware {
    /// Creates the middleware with `policy`, tokio's clock and the thread-local random source.
    pub fn new(policy: RetryPolicy) -> Self {
        RetryMiddleware {
            policy,
            clock: SharedClock(std::sync::Arc::new(TokioClock::new())),
            rng: SharedRng(std::sync::Arc::new(ThreadRng::new())),
        }
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

    async fn execute(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let policy = &self.policy;
        let max_attempts = policy.max_attempts();
        let idempotent = classify::is_idempotent(request.method());
        let keyed = false;

        let mut attempt: u32 = 0;
        let mut waited = Duration::ZERO;
        let mut pending = request;
        loop {
            attempt += 1;
            let spare = if attempt < max_attempts {
                pending.try_clone()
            } else {
                None
            };
            let mut sending = pending;
            limit_timeout(&mut sending, policy.attempt_timeout());

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
            let stop = match verdict {
                Verdict::Final(stop) => Some(stop),
                Verdict::Transient(_) if attempt >= max_attempts => {
                    Some(StopReason::AttemptsExhausted)
                }
                Verdict::Transient(_) if spare.is_none() => Some(StopReason::BodyNotCloneable),
                Verdict::Transient(_) => None,
            };
            let next_request = match (stop, spare) {
                (None, Some(next_request)) => next_request,
                (stop, _) => {
                    let stop = stop.unwrap_or(StopReason::BodyNotCloneable);
                    log_attempt(attempt, &outcome, verdict, None);
                    tracing::debug!(
                        attempts = attempt,
                        reason = stop.as_str(),
                        "retrying stopped"
                    );
                    return finish(outcome, attempt, stop, waited, extensions);
                }
            };

            let delay = backoff::full_jitter(
                policy.base_delay(),
                policy.max_delay(),
                attempt - 1,
                &*self.rng.0,
            );
            log_attempt(attempt, &outcome, verdict, Some(delay));
            // Release the connection before waiting rather than after.
            drop(outcome);
            self.clock.0.sleep(delay).await;
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
    /// A transient failure, safe to repeat; the reason for the trace.
    Transient(&'static str),
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
                Verdict::Transient("status")
            } else {
                Verdict::Final(StopReason::NotSafeToRetry)
            }
        }
        Err(err) => match classify::transport_fault(err) {
            None => Verdict::Final(StopReason::NotRetryable),
            Some(fault) if repeatable || fault.nothing_sent() => Verdict::Transient(fault.as_str()),
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
    delay: Option<Duration>,
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
    let decision = match verdict {
        Verdict::Transient(why) if delay.is_some() => why,
        Verdict::Transient(_) => "transient",
        Verdict::Final(stop) => stop.as_str(),
    };
    tracing::debug!(
        attempt,
        status,
        error,
        decision,
        delay_ms = delay.map(|d| d.as_millis() as u64),
        "attempt finished"
    );
}

fn finish(
    outcome: reqwest_middleware::Result<Response>,
    attempts: u32,
    stop: StopReason,
    waited: Duration,
    extensions: &mut Extensions,
) -> reqwest_middleware::Result<Response> {
    let record = RetryRecord {
        attempts,
        stop,
        waited,
    };
    extensions.insert(record);
    match outcome {
        Ok(mut response) => {
            response.extensions_mut().insert(record);
            Ok(response)
        }
        Err(err) => Err(RetryError::new(attempts, stop, err).into()),
    }
}
