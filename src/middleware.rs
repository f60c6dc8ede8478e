//! The attempt loop: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The loop picks the request's dependency (by
//! host) and policy (or the request's own override), decides its idempotency key, then for each
//! attempt: clones the request (the original is kept for the next one), sends it down the chain
//! within the attempt's timeout (the policy's, cut to what the deadline leaves), asks
//! `classify` whether the outcome is a transient failure that is safe to repeat, and if so asks
//! `schedule` for the wait (backoff, `Retry-After` floor, deadline), pays the budget, and sleeps
//! on the injected clock. Every decision is made by the pure modules below it.
//!
//! # One layer retries
//!
//! Three layers that each retry three times turn one request into twenty-seven. When an instance
//! of this middleware gets back an outcome that another instance, nearer the transport, has
//! already finished with (a response carrying a [`RetryRecord`], or a [`RetryError`]), it
//! passes that outcome through untouched: it neither retries it nor wraps it. So however many
//! instances sit on one request path, the one nearest the transport does the retrying and the
//! backend sees at most its `max_attempts` per logical request. The limit: only instances of
//! this crate know each other; retries made by another library in the same chain are not seen.

use std::sync::Arc;
use std::time::Duration;

use http::{Extensions, HeaderValue};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Instrument;

use crate::body;
use crate::budget::{RetryBudget, RetryKind};
use crate::classify::{self, Fault};
use crate::clock::{Clock, SharedClock, TokioClock};
use crate::dependency::{Dependency, HostMatch, RetryOverride};
use crate::error::{AttemptTimeout, RetryError, RetryRecord, StopReason};
use crate::idempotency::IdempotencyKeys;
use crate::observe::{Count, RetryCounters, RetryEvent, RetryObserver};
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
/// | dependency | one, named `default`, with the policy given to [`new`](Self::new); [`for_dependency`](Self::for_dependency) names it, [`route`](Self::route) adds others by host |
/// | retry budget | a new [`RetryBudget::default()`] per dependency: about 10 % extra load ([`with_budget`](Self::with_budget), [`without_budget`](Self::without_budget)) |
/// | clock | [`TokioClock`] ([`with_clock`](Self::with_clock)) |
/// | random source | [`ThreadRng`] ([`with_rng`](Self::with_rng)) |
/// | idempotency keys | [`IdempotencyKeys::default()`]: a quoted random UUID on POST and PATCH ([`with_idempotency_keys`](Self::with_idempotency_keys), [`without_idempotency_keys`](Self::without_idempotency_keys)) |
/// | observer | none ([`with_observer`](Self::with_observer)) |
///
/// In tests, use `FakeClock`, [`SeededRng`](crate::SeededRng) and
/// [`SeededKeys`](crate::SeededKeys).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    default: Dependency,
    routes: Vec<(HostMatch, Dependency)>,
    clock: SharedClock,
    rng: SharedRng,
    keys: Option<IdempotencyKeys>,
    observer: Option<SharedObserver>,
}

impl RetryMiddleware {
    /// Creates the middleware with `policy` for every request, as a dependency named `default`.
    pub fn new(policy: RetryPolicy) -> Self {
        RetryMiddleware::for_dependency(Dependency::new("default", policy))
    }

    /// Creates the middleware with `dependency` for every request not routed elsewhere.
    pub fn for_dependency(dependency: Dependency) -> Self {
        RetryMiddleware {
            default: dependency,
            routes: Vec::new(),
            clock: SharedClock(Arc::new(TokioClock::new())),
            rng: SharedRng(Arc::new(ThreadRng::new())),
            keys: Some(IdempotencyKeys::default()),
            observer: None,
        }
    }

    /// Sends requests to `host` (`"api.example.com"`, any port) or `host:port`
    /// (`"127.0.0.1:8080"`, `"[::1]:8080"`) through `dependency` instead of the default. Routes
    /// are tried in the order they were added; the host is compared without regard to case.
    pub fn route(mut self, host: &str, dependency: Dependency) -> Self {
        self.routes.push((HostMatch::parse(host), dependency));
        self
    }

    /// Uses `clock` for every wait and every reading of the time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = SharedClock(Arc::new(clock));
        self
    }

    /// Draws jitter from `rng`.
    pub fn with_rng(mut self, rng: impl Rng) -> Self {
        self.rng = SharedRng(Arc::new(rng));
        self
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

    /// Draws the default dependency's retries from `budget`. Pass clones of one budget to every
    /// middleware that calls the same dependency, so they share one account.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.default.budget = Some(budget);
        self
    }

    /// Retries the default dependency without a budget: only the attempt limit and the deadline
    /// bound them. During an outage every request then makes `max_attempts` attempts.
    pub fn without_budget(mut self) -> Self {
        self.default.budget = None;
        self
    }

    /// Calls `observer` after every attempt with the decision about the next one.
    pub fn with_observer(mut self, observer: impl RetryObserver) -> Self {
        self.observer = Some(SharedObserver(Arc::new(observer)));
        self
    }

    /// The default dependency's policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.default.policy
    }

    /// The default dependency's budget, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.default.budget.as_ref()
    }

    /// The default dependency's counters; clones share the counts.
    pub fn counters(&self) -> &RetryCounters {
        &self.default.counters
    }

    /// The dependency a request to `url` goes through.
    pub fn dependency_for(&self, url: &reqwest::Url) -> &Dependency {
        self.routes
            .iter()
            .find(|(host, _)| host.matches(url))
            .map_or(&self.default, |(_, dependency)| dependency)
    }

    /// Decides the request's key before the first attempt: the caller's own, kept as it is, or
    /// a new one if the method is stamped. The flag says whether the key was stamped here.
    fn key_for(&self, request: &mut Request) -> Result<Option<(HeaderValue, bool)>, RetryError> {
        let Some(keys) = &self.keys else {
            return Ok(None);
        };
        if let Some(own) = request.headers().get(keys.header_name()) {
            return Ok(Some((own.clone(), false)));
        }
        if !keys.stamps(request.method()) {
            return Ok(None);
        }
        match keys.new_value() {
            Ok(value) => {
                request
                    .headers_mut()
                    .insert(keys.header_name(), value.clone());
                Ok(Some((value, true)))
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
        dependency: &Dependency,
    ) -> reqwest_middleware::Result<Response> {
        let counters = &dependency.counters;
        let count = |c: Count| counters.add(c, &dependency.metric_keys);
        count(Count::Request);

        // The future keeps a policy by reference; an override is boxed, which keeps the future
        // small for the requests that have none.
        let (overriding, no_retries) = match extensions.get::<RetryOverride>() {
            Some(RetryOverride::Policy(policy)) => (Some(Box::new(*policy)), false),
            Some(RetryOverride::NoRetries) => (None, true),
            None => (None, false),
        };
        let policy: &RetryPolicy = overriding.as_deref().unwrap_or(&dependency.policy);
        let max_attempts = if no_retries { 1 } else { policy.max_attempts() };
        let budget = dependency.budget.as_ref();
        let idempotent = classify::is_idempotent(request.method());
        let key = match self.key_for(&mut request) {
            Ok(Some((key, stamped))) => {
                if stamped {
                    count(Count::KeyStamped);
                }
                Some(key)
            }
            Ok(None) => None,
            Err(err) => {
                tracing::debug!(
                    target: TARGET,
                    attempts = 0,
                    reason = err.stop_reason().as_str(),
                    waited_ms = 0u64,
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
        // A copy is kept for the next attempt while the request goes out; none is made for the
        // last attempt, and none can be made of a body that is a stream.
        let mut kept = Some(request);
        loop {
            attempt += 1;
            count(Count::Attempt);
            let Some(sending) = kept.take() else {
                unreachable!("a request is kept for every attempt that is made");
            };
            if attempt < max_attempts {
                kept = sending.try_clone();
            }
            // The deadline cannot have been reached before the first attempt: no clock reading.
            let limit = if attempt == 1 {
                policy.attempt_timeout().min(policy.deadline())
            } else {
                policy.attempt_timeout().min(remaining())
            };
            // Enforced here, in real time, rather than as the request's own timeout: reqwest would
            // then replace a timeout the caller set on the client, and box a timer per request.
            let now = tokio::time::Instant::now();
            // A limit beyond the `Instant` range (a policy of `Duration::MAX`) means "no limit"
            // in practice: thirty years, as tokio does.
            let ends = now
                .checked_add(limit)
                .unwrap_or_else(|| now + Duration::from_secs(30 * 365 * 24 * 3600));
            let timed_out =
                || reqwest_middleware::Error::middleware(AttemptTimeout { after: limit });
            let mut outcome = tokio::time::timeout_at(ends, next.clone().run(sending, extensions))
                .await
                .unwrap_or_else(|_| Err(timed_out()));
            if let (Some(buffer), Ok(_)) = (policy.buffer_body_limit(), &outcome) {
                if let Ok(response) = outcome {
                    // Boxed: the reading state is large, and most requests never need it.
                    let reading = Box::pin(body::buffer(response, buffer));
                    outcome = match tokio::time::timeout_at(ends, reading).await {
                        Ok(read) => read.map_err(reqwest_middleware::Error::Reqwest),
                        Err(_) => Err(timed_out()),
                    };
                }
            }

            let verdict = judge(policy, &outcome, idempotent, keyed);
            // Read the clock only when a retry is in question: a success needs no deadline.
            let left = match verdict {
                Verdict::Transient(..) => remaining(),
                _ => Duration::MAX,
            };
            let mut floor = None;
            let decision = match verdict {
                Verdict::Final(stop) => Wait::Stop(stop),
                // Another instance nearer the transport has finished with this request.
                Verdict::InnerLayer => Wait::Stop(StopReason::NotRetryable),
                Verdict::Transient(..) if no_retries => Wait::Stop(StopReason::RetriesDisabled),
                Verdict::Transient(..) if attempt >= max_attempts => {
                    Wait::Stop(StopReason::AttemptsExhausted)
                }
                Verdict::Transient(..) if kept.is_none() => {
                    Wait::Stop(StopReason::BodyNotCloneable)
                }
                Verdict::Transient(..) if left.is_zero() => Wait::Stop(StopReason::DeadlineReached),
                Verdict::Transient(kind, _) => {
                    floor = outcome.as_ref().ok().and_then(|response| {
                        let value = response.headers().get(http::header::RETRY_AFTER)?;
                        retry_after::parse(value.as_bytes(), clock.wall_now())
                    });
                    match schedule::next_wait(policy, attempt - 1, floor, left, &*self.rng.0) {
                        // Charge before sleeping: a retry that waits has already been paid for.
                        Wait::Sleep(delay) => match budget {
                            None => Wait::Sleep(delay),
                            Some(budget) => match budget.try_withdraw(kind, clock.now()) {
                                Some(cost) => {
                                    last_cost = cost;
                                    Wait::Sleep(delay)
                                }
                                None => {
                                    count(Count::BudgetRefusal);
                                    Wait::Stop(StopReason::BudgetExhausted)
                                }
                            },
                        },
                        stop => stop,
                    }
                }
            };
            if let (
                Some(budget),
                Verdict::Final(StopReason::Succeeded | StopReason::NotRetryable),
            ) = (budget, verdict)
            {
                if attempt == 1 {
                    budget.deposit_first_attempt();
                } else {
                    budget.refund(last_cost);
                }
            }
            self.report(&dependency.name, attempt, &outcome, verdict, decision);

            let delay = match (decision, &kept) {
                (Wait::Sleep(delay), Some(_)) => delay,
                (decision, _) => {
                    let stop = match decision {
                        Wait::Stop(stop) => stop,
                        Wait::Sleep(_) => StopReason::BodyNotCloneable,
                    };
                    if stop == StopReason::DeadlineReached {
                        count(Count::DeadlineStop);
                    }
                    tracing::debug!(
                        target: TARGET,
                        attempts = attempt,
                        reason = stop.as_str(),
                        waited_ms = millis(waited),
                        "retrying stopped"
                    );
                    if matches!(verdict, Verdict::InnerLayer) {
                        return outcome;
                    }
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
            count(Count::Retry);
            if floor.is_some() {
                count(Count::RetryAfterHonoured);
            }
            // Release the connection before waiting rather than after.
            drop(outcome);
            clock.sleep(delay).await;
            waited = waited.saturating_add(delay);
        }
    }

    /// Traces one attempt and tells the observer.
    fn report(
        &self,
        dependency: &str,
        attempt: u32,
        outcome: &reqwest_middleware::Result<Response>,
        verdict: Verdict,
        decision: Wait,
    ) {
        let (status, error) = match outcome {
            Ok(r) => (Some(r.status().as_u16()), None),
            Err(e) => (
                e.status().map(|s| s.as_u16()),
                Some(match (verdict, classify::transport_fault(e)) {
                    (Verdict::InnerLayer, _) => "inner_layer",
                    (_, Some(f)) => f.as_str(),
                    (_, None) => "permanent",
                }),
            ),
        };
        let (delay, stop) = match decision {
            Wait::Sleep(delay) => (Some(delay), None),
            Wait::Stop(stop) => (None, Some(stop)),
        };
        let decision = match (verdict, decision) {
            (Verdict::Transient(_, why), Wait::Sleep(_)) => why,
            (_, Wait::Stop(stop)) => stop.as_str(),
            (Verdict::Final(stop), _) => stop.as_str(),
            (Verdict::InnerLayer, _) => "inner_layer",
        };
        tracing::debug!(
            target: TARGET,
            attempt,
            status,
            error,
            decision,
            delay_ms = delay.map(millis),
            "attempt finished"
        );
        if let Some(observer) = &self.observer {
            observer.0.on_decision(&RetryEvent {
                dependency,
                attempt,
                status,
                error,
                delay,
                stop,
            });
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
        let dependency = self.dependency_for(request.url());
        let span = tracing::debug_span!(
            target: TARGET,
            "reqwest_safe_retry.request",
            dependency = &*dependency.name,
            method = %request.method(),
            host = request.url().host_str().unwrap_or(""),
            path = request.url().path(),
        );
        self.execute(request, extensions, next, dependency)
            .instrument(span)
            .await
    }
}

/// The observer as the middleware stores it.
#[derive(Clone)]
struct SharedObserver(Arc<dyn RetryObserver>);

impl std::fmt::Debug for SharedObserver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RetryObserver")
    }
}

/// What an attempt's outcome calls for.
#[derive(Debug, Clone, Copy)]
enum Verdict {
    /// A transient failure, safe to repeat: what a retry costs, and the reason for the trace.
    Transient(RetryKind, &'static str),
    /// No retry, for this reason.
    Final(StopReason),
    /// An outcome another instance of this middleware, nearer the transport, has finished with.
    InnerLayer,
}

fn judge(
    policy: &RetryPolicy,
    outcome: &reqwest_middleware::Result<Response>,
    idempotent: bool,
    keyed: bool,
) -> Verdict {
    let repeatable = idempotent || keyed;
    match outcome {
        Ok(response) if RetryRecord::of(response).is_some() => Verdict::InnerLayer,
        Err(err) if RetryError::of(err).is_some() => Verdict::InnerLayer,
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

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The tracing target of every span and event, whatever module emits them.
const TARGET: &str = "reqwest_safe_retry";

/// The header a server following the Stripe convention sets on a replayed response.
const REPLAYED: http::HeaderName = http::HeaderName::from_static("idempotent-replayed");

fn finish(
    outcome: reqwest_middleware::Result<Response>,
    mut record: RetryRecord,
) -> reqwest_middleware::Result<Response> {
    match outcome {
        Ok(mut response) => {
            record.replayed = response
                .headers()
                .get(&REPLAYED)
                .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"));
            response.extensions_mut().insert(record);
            Ok(response)
        }
        Err(err) => Err(RetryError::new(record.attempts, record.stop, record.key, err).into()),
    }
}
