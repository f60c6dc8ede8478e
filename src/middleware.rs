//! The driver: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The driver picks the request's dependency (by
//! host) and policy (or the request's own override), decides its idempotency key, then asks the
//! decision core (`decide`) for each attempt's timeout, sends a copy of the request down the
//! chain racing that timeout on the injected clock, has `classify` judge the outcome, and asks
//! the core what follows: a wait, slept on the clock, or a stop. The core does the budget's
//! accounting and the counting; this module holds no rule of its own.
//!
//! # One layer retries
//!
//! Three layers that each retry three times turn one request into twenty-seven, and a layer
//! whose attempt timeout is shorter than an inner layer's whole loop would retry that loop. So
//! the first instance to see a request (the outermost) marks it as its own while it runs the
//! rest of the chain, and every instance further in that finds the mark passes the request
//! through untouched: one layer retries, whatever the timing, and it can tell the others before
//! anything is sent. The mark is a thread-local holding the address of the request's
//! extensions (see `Claiming`): no allocation, unlike a mark in the extensions themselves, and
//! sound because the rest of a chain cannot leave the task that polls it (`Next` borrows the
//! extensions). The limit: only instances of this crate know each other; retries made by
//! another library in the same chain are not seen.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use http::{Extensions, HeaderValue};
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Level;

use crate::body;
use crate::budget::RetryBudget;
use crate::classifier::{Attempt, Classifier, Outcome, RequestHead, Retryable};
use crate::classify::{self, Fault, Verdict};
use crate::clock::{AttemptTimer, Clock, SharedClock, TokioClock};
use crate::decide::{Decider, Observed};
use crate::dependency::{Dependency, HostMatch, RetryOverride};
use crate::error::{AttemptTimeout, InvalidConfig, RetryError, RetryRecord, StopReason};
use crate::idempotency::{self, IdempotencyKeys};
use crate::observe::{
    AttemptErrorKind, Count, RetryAttempt, RetryCounters, RetryEvent, RetryObserver,
    url_without_query,
};
use crate::policy::RetryPolicy;
use crate::rate_limit;
use crate::retry_after;
use crate::rng::{RandomSource, ThreadRng};
use crate::schedule::Wait;
use crate::shared::Shared;
use crate::throttle::AdaptiveThrottle;
use crate::throttle::ThrottledLocally;

/// An event at a level chosen at run time; `tracing`'s macros take a constant one.
macro_rules! event_at {
    ($level:expr, $($rest:tt)+) => {
        match $level {
            Level::ERROR => tracing::event!(target: TARGET, Level::ERROR, $($rest)+),
            Level::WARN => tracing::event!(target: TARGET, Level::WARN, $($rest)+),
            Level::INFO => tracing::event!(target: TARGET, Level::INFO, $($rest)+),
            Level::DEBUG => tracing::event!(target: TARGET, Level::DEBUG, $($rest)+),
            _ => tracing::event!(target: TARGET, Level::TRACE, $($rest)+),
        }
    };
}

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
/// | idempotency keys | [`IdempotencyKeys::default()`]: a bare random UUID on POST and PATCH ([`with_idempotency_keys`](Self::with_idempotency_keys), [`without_idempotency_keys`](Self::without_idempotency_keys)) |
/// | observer | none ([`with_observer`](Self::with_observer)) |
/// | log levels | INFO for a retry, WARN for a give-up, DEBUG for the rest ([`with_retry_log_level`](Self::with_retry_log_level), [`with_give_up_log_level`](Self::with_give_up_log_level)) |
///
/// In tests, use `FakeClock`, [`SeededRng`](crate::SeededRng) and
/// [`SeededKeys`](crate::SeededKeys).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    default: Dependency,
    routes: Vec<(HostMatch, Dependency)>,
    clock: SharedClock,
    rng: Shared<dyn RandomSource>,
    keys: Option<IdempotencyKeys>,
    observer: Option<Shared<dyn RetryObserver>>,
    log: LogLevels,
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
            clock: SharedClock::new(TokioClock::new()),
            rng: Shared(Arc::new(ThreadRng::new())),
            keys: Some(IdempotencyKeys::default()),
            observer: None,
            log: LogLevels::default(),
        }
    }

    /// Sends requests to `host` (`"api.example.com"`, any port) or `host:port`
    /// (`"127.0.0.1:8080"`, `"[::1]:8080"`) through `dependency` instead of the default. Routes
    /// are tried in the order they were added; the host is compared without regard to case.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
    ///
    /// let payments = Dependency::new("payments", RetryPolicy::default());
    /// let middleware = RetryMiddleware::new(RetryPolicy::default())
    ///     .route("payments.internal:8443", payments)?;
    /// # drop(middleware);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `host` is not a host or `host:port`: a URL
    /// (`"http://127.0.0.1:8080"`), a path, or a port that is not a number up to 65535. The
    /// message says what to write instead.
    pub fn route(mut self, host: &str, dependency: Dependency) -> Result<Self, InvalidConfig> {
        self.routes.push((HostMatch::parse(host)?, dependency));
        Ok(self)
    }

    /// Uses `clock` for every wait and every reading of the time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = SharedClock::new(clock);
        self
    }

    /// Draws jitter from `rng`.
    pub fn with_rng(mut self, rng: impl RandomSource) -> Self {
        self.rng = Shared(Arc::new(rng));
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

    /// Decides which outcomes are transient for the default dependency with `classifier`
    /// instead of the default rules; see [`Classifier`]. The safety rule still holds.
    pub fn with_classifier(mut self, classifier: impl Classifier) -> Self {
        self.default.classifier = Some(Shared(Arc::new(classifier)));
        self
    }

    /// Throttles the default dependency's attempts with `throttle`; see [`AdaptiveThrottle`].
    pub fn with_throttle(mut self, throttle: AdaptiveThrottle) -> Self {
        self.default.throttle = Some(throttle);
        self
    }

    /// Calls `observer` after every attempt with the decision about the next one.
    pub fn with_observer(mut self, observer: impl RetryObserver) -> Self {
        self.observer = Some(Shared(Arc::new(observer)));
        self
    }

    /// The level of the event for an attempt that a retry follows, and of the end of a request
    /// that was retried; INFO by default, so a retry leaves a trace at the usual level. The
    /// other attempts' events, and the end of a request that went as its first attempt went,
    /// stay at DEBUG.
    pub fn with_retry_log_level(mut self, level: Level) -> Self {
        self.log.retry = level;
        self
    }

    /// The level of the end of a request whose failure was not retried, or not again: the
    /// attempts, the deadline or the budget ran out, a `Retry-After` was too long, repeating
    /// was not safe, or nothing could be sent. WARN by default.
    pub fn with_give_up_log_level(mut self, level: Level) -> Self {
        self.log.give_up = level;
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
    /// a new one if the method is stamped. The flag says whether the key was stamped here, and
    /// so is still to be put on every attempt.
    fn key_for(&self, request: &Request) -> Result<Option<(HeaderValue, bool)>, RetryError> {
        let Some(keys) = &self.keys else {
            return Ok(None);
        };
        if let Some(own) = request.headers().get(keys.header_name()) {
            // Sent as it is, so it must already be a valid key: an empty one, or one another
            // parser would read differently, defeats the server's dedupe.
            return match idempotency::check_caller_value(own, keys.format()) {
                Ok(()) => Ok(Some((own.clone(), false))),
                Err(invalid) => Err(RetryError::new(
                    0,
                    StopReason::InvalidIdempotencyKey,
                    None,
                    reqwest_middleware::Error::middleware(invalid),
                )),
            };
        }
        if !keys.stamps(request.method()) {
            return Ok(None);
        }
        match keys.new_value() {
            // Put on each attempt's copy as it is sent, not on the request: the copy kept for a
            // retry then has no header of its own to clone.
            Ok(value) => Ok(Some((value, true))),
            Err(invalid) => Err(RetryError::new(
                0,
                StopReason::InvalidIdempotencyKey,
                None,
                reqwest_middleware::Error::middleware(invalid),
            )),
        }
    }

    /// The logical request: its attempts, waits and outcome. Its future is the one boxed for
    /// the chain, so it is kept small: the request is held once (the copy kept for a retry),
    /// everything of one attempt that is not needed across an `await` is scoped to a block
    /// that ends before it, and the timer is polled in place.
    fn execute<'a>(
        &'a self,
        request: Request,
        extensions: &'a mut Extensions,
        next: Next<'a>,
    ) -> impl Future<Output = reqwest_middleware::Result<Response>> + Send + 'a {
        let dependency = self.dependency_for(request.url());
        let span = tracing::debug_span!(
            target: TARGET,
            "reqwest_safe_retry.request",
            dependency = &*dependency.name,
            method = %request.method(),
            host = request.url().host_str().unwrap_or(""),
            path = request.url().path(),
            http.request.resend_count = tracing::field::Empty,
        );
        // A copy is kept for the next attempt while the request goes out; none is made for the
        // last attempt, and none can be made of a body that is a stream.
        let mut kept = Some(request);
        async move {
            // The future keeps a policy by reference; an override is boxed, which keeps the
            // future small for the requests that have none.
            let (overriding, no_retries) = match extensions.get::<RetryOverride>() {
                None => (None, false),
                Some(RetryOverride::NoRetries) => (None, true),
                Some(other) => match other.policy(&dependency.policy) {
                    Ok(policy) => (policy.map(Box::new), false),
                    Err(invalid) => {
                        let err = RetryError::new(
                            0,
                            StopReason::InvalidOverride,
                            None,
                            reqwest_middleware::Error::middleware(invalid),
                        );
                        return Err(span
                            .in_scope(|| self.log.stopped(0, Duration::ZERO, err))
                            .into());
                    }
                },
            };
            let policy: &RetryPolicy = overriding.as_deref().unwrap_or(&dependency.policy);
            let clock = self.clock.get();
            // A quota the dependency said is spent: wait for its reset, or give up at once.
            if policy.rate_limit_fields() && dependency.quota.maybe_spent() {
                let now = clock.now();
                if let Some(until) = dependency.quota.spent_until(now) {
                    let wait = until.saturating_duration_since(now);
                    if wait > policy.max_retry_after() || wait >= policy.deadline() {
                        let err = RetryError::new(
                            0,
                            StopReason::QuotaExhausted,
                            None,
                            reqwest_middleware::Error::middleware(QuotaSpent { wait }),
                        );
                        return Err(span
                            .in_scope(|| self.log.stopped(0, Duration::ZERO, err))
                            .into());
                    }
                    match self.clock.checked_sleep(wait) {
                        Ok(sleep) => sleep.await,
                        Err(missing) => {
                            let err = RetryError::new(
                                0,
                                StopReason::TimerUnavailable,
                                None,
                                reqwest_middleware::Error::middleware(missing),
                            );
                            return Err(span
                                .in_scope(|| self.log.stopped(0, Duration::ZERO, err))
                                .into());
                        }
                    }
                }
            }
            let mut decider = Decider::start(
                policy,
                dependency.budget.as_ref(),
                &dependency.counters,
                &dependency.metric_keys,
                no_retries,
                clock.now(),
            )
            .with_throttle(dependency.throttle.as_ref());
            let Some(request) = &kept else {
                unreachable!("the request is kept until its first attempt");
            };
            let (key, stamped) = match self.key_for(request) {
                Ok(Some((key, stamped))) => {
                    if stamped {
                        dependency
                            .counters
                            .add(Count::KeyStamped, &dependency.metric_keys);
                    }
                    (Some(key), stamped)
                }
                Ok(None) => (None, false),
                Err(err) => {
                    return Err(span
                        .in_scope(|| self.log.stopped(0, Duration::ZERO, err))
                        .into());
                }
            };
            let repeatable = key.is_some() || classify::is_idempotent(request.method());
            // Only a classifier needs the request after it has gone: its head is kept for it.
            let head = dependency
                .classifier
                .as_ref()
                .map(|classifier| (classifier, Box::new(RequestHead::of(request))));
            // Only an observer needs the method and URL after the request has gone.
            let watched = self
                .observer
                .as_ref()
                .map(|_| Box::new((request.method().clone(), url_without_query(request.url()))));
            let judging = Judging {
                policy,
                repeatable,
                key: key.as_ref(),
                hook: head.as_ref().map(|(c, head)| (*c, &**head)),
            };

            let Ok(mut limit) = decider.next_attempt(clock) else {
                unreachable!("only a retry can find its deadline passed");
            };
            if let Err(stop) = decider.admit(clock, &*self.rng.0) {
                let err = RetryError::new(
                    0,
                    stop,
                    key,
                    reqwest_middleware::Error::middleware(ThrottledLocally),
                );
                return Err(span
                    .in_scope(|| self.log.stopped(0, Duration::ZERO, err))
                    .into());
            }
            // The first timer can tell a paused tokio clock from the start's reading.
            let mut started = Some(decider.started());
            loop {
                // One attempt, in a block that ends before the wait: what it holds takes no
                // room in the future while it sleeps.
                let (previous, delay) = {
                    let timer = match self.clock.timeout(limit, started.take()) {
                        Ok(timer) => timer,
                        Err(missing) => {
                            let err = RetryError::new(
                                decider.attempts(),
                                StopReason::TimerUnavailable,
                                key,
                                reqwest_middleware::Error::middleware(missing),
                            );
                            let err = self.log.stopped(decider.attempts(), decider.waited(), err);
                            return Err(span.in_scope(|| err).into());
                        }
                    };
                    let attempt = {
                        let number = decider.attempts() + 1;
                        if number > 1 {
                            // For the middleware and transport beneath, before they see it.
                            extensions.insert(RetryAttempt { number });
                            span.record("http.request.resend_count", number - 1);
                        }
                        let mut sending = take_attempt(&mut kept, decider.may_retry_after_next());
                        if let (true, Some(keys), Some(value)) = (stamped, &self.keys, &key) {
                            sending
                                .headers_mut()
                                .insert(keys.header_name(), value.clone());
                        }
                        let id = claim_id(extensions);
                        Claiming::new(id, &span, || next.clone().run(sending, extensions))
                    };
                    decider.attempt_started();

                    // The attempt races its timeout on the injected clock; the attempt is polled
                    // first, so an answer that is ready wins over a timeout that is ready too. The
                    // timer ends with the attempt (this block), before any wait: a real-time timer
                    // under a paused tokio clock would otherwise hold up the wait's auto-advance.
                    let (outcome, verdict) = {
                        let mut timer = std::pin::pin!(timer);
                        let timed_out = || {
                            reqwest_middleware::Error::middleware(AttemptTimeout { after: limit })
                        };
                        let mut outcome = race(attempt, timer.as_mut())
                            .await
                            .unwrap_or_else(|| Err(timed_out()));
                        // A body is read only for an answer that will not be retried: a 503's body
                        // would be read in full (up to the limit) only to be thrown away.
                        let mut verdict = self.judge(&outcome, &judging, decider.attempts());
                        if let (Some(limit), true, Verdict::Final(_)) =
                            (policy.buffer_body_limit(), outcome.is_ok(), verdict)
                        {
                            let Ok(response) = outcome else {
                                unreachable!("judged a response")
                            };
                            // Boxed: the reading state is large, and most requests never need
                            // it.
                            let reading = Box::pin(body::buffer(response, limit));
                            outcome = match race(reading, timer.as_mut()).await {
                                // The same status and head: the verdict stands.
                                Some(Ok(read)) => Ok(read),
                                Some(Err(e)) => Err(reqwest_middleware::Error::Reqwest(e)),
                                None => Err(timed_out()),
                            };
                            if outcome.is_err() {
                                // Another outcome, judged anew: a body cut off is transient.
                                verdict = self.judge(&outcome, &judging, decider.attempts());
                            }
                        }
                        (outcome, verdict)
                    };

                    let decision = {
                        let observed = Observed {
                            verdict,
                            answered: outcome.is_ok(),
                            // Looked up only for an answer that may be retried.
                            retry_after: match (&outcome, verdict) {
                                (Ok(r), Verdict::Transient(..)) => {
                                    r.headers().get(http::header::RETRY_AFTER)
                                }
                                _ => None,
                            },
                            can_resend: kept.is_some(),
                        };
                        if decider.throttled() {
                            decider.finished(accepted(&outcome), clock);
                        }
                        if let (true, Ok(response)) = (policy.rate_limit_fields(), &outcome) {
                            if let Some(quota) = rate_limit::of_response(response.headers()) {
                                dependency.quota.update(quota, clock.now());
                            }
                        }
                        let decision = decider.after_attempt(observed, clock, &*self.rng.0);
                        span.in_scope(|| {
                            self.report(
                                &dependency.name,
                                watched.as_deref(),
                                decider.attempts(),
                                &outcome,
                                verdict,
                                decision,
                            );
                        });
                        decision
                    };
                    match decision {
                        Wait::Stop(stop) => {
                            return span.in_scope(|| self.finish(outcome, stop, &decider, key));
                        }
                        // Release the connection before waiting rather than after; the rest is
                        // kept in case the deadline passes during the wait.
                        Wait::Sleep(delay) => (outcome.map(body::head_only), delay),
                    }
                };
                clock.sleep(delay).await;
                match decider
                    .next_attempt(clock)
                    .and_then(|next| decider.admit(clock, &*self.rng.0).map(|()| next))
                {
                    Ok(next) => limit = next,
                    Err(stop) => {
                        return span.in_scope(|| self.finish(previous, stop, &decider, key));
                    }
                }
            }
        }
    }

    /// What the classifier makes of an attempt's outcome.
    fn judge(
        &self,
        outcome: &reqwest_middleware::Result<Response>,
        judging: &Judging<'_>,
        attempt: u32,
    ) -> Verdict {
        let Judging {
            policy,
            repeatable,
            key,
            hook,
        } = *judging;
        let keyed = key.is_some();
        let fault = match outcome {
            Ok(_) => None,
            Err(err) => classify::transport_fault(err),
        };
        let by_default = match outcome {
            Ok(response) => classify::is_transient_status(
                response.status(),
                |s| policy.is_retryable_status(s),
                keyed,
            ),
            Err(_) => fault.is_some(),
        };
        let transient = match hook {
            None => by_default,
            Some((classifier, head)) => {
                let seen = Attempt {
                    method: &head.method,
                    url: &head.url,
                    headers: &head.headers,
                    key,
                    number: attempt,
                    outcome: match outcome {
                        Ok(response) => Outcome::Response(response),
                        Err(err) => Outcome::Error(err),
                    },
                    default: if by_default {
                        Retryable::Transient
                    } else {
                        Retryable::Fatal
                    },
                };
                classifier.0.classify(&seen) == Retryable::Transient
            }
        };
        match outcome {
            Ok(response) => classify::status_verdict(response.status(), transient, repeatable),
            Err(_) => classify::error_verdict(fault, transient, repeatable),
        }
    }

    /// The caller's outcome: the response with its record, or the error wrapped with the count
    /// and the reason.
    fn finish(
        &self,
        outcome: reqwest_middleware::Result<Response>,
        stop: StopReason,
        decider: &Decider<'_>,
        key: Option<HeaderValue>,
    ) -> reqwest_middleware::Result<Response> {
        let (attempts, waited) = (decider.attempts(), decider.waited());
        match outcome {
            Ok(mut response) => {
                let status = Some(response.status().as_u16());
                self.log.trace_stop(attempts, stop, waited, status);
                // The most common outcome, a first attempt's success without a key, carries
                // no record: `RetryRecord::of` infers it, and the success path is spared an
                // allocation and a map insertion.
                if attempts > 1 || stop != StopReason::Succeeded || key.is_some() {
                    response.extensions_mut().insert(RetryRecord {
                        attempts,
                        stop,
                        waited,
                        key,
                        replayed: false,
                    });
                }
                Ok(response)
            }
            Err(err) => {
                let err = RetryError::new(attempts, stop, key, err);
                Err(self.log.stopped(attempts, waited, err).into())
            }
        }
    }

    /// Traces one attempt and tells the observer.
    fn report(
        &self,
        dependency: &str,
        watched: Option<&(http::Method, String)>,
        attempt: u32,
        outcome: &reqwest_middleware::Result<Response>,
        verdict: Verdict,
        decision: Wait,
    ) {
        let (status, error) = match outcome {
            Ok(r) => (Some(r.status().as_u16()), None),
            Err(e) => (
                e.status().map(|s| s.as_u16()),
                Some(classify::transport_fault(e).map_or(AttemptErrorKind::Permanent, Fault::kind)),
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
        };
        let level = if delay.is_some() {
            self.log.retry
        } else {
            Level::DEBUG
        };
        event_at!(
            level,
            attempt,
            status,
            error = error.map(|e| e.as_str()),
            decision,
            delay_ms = delay.map(millis),
            "attempt finished"
        );
        if let (Some(observer), Some((method, url))) = (&self.observer, watched) {
            let retry_after = outcome
                .as_ref()
                .ok()
                .and_then(|r| r.headers().get(http::header::RETRY_AFTER))
                .and_then(|v| retry_after::parse(v.as_bytes(), self.clock.get().wall_now()));
            observer.0.on_decision(&RetryEvent {
                dependency,
                method,
                url,
                attempt,
                status,
                error,
                retry_after,
                delay,
                stop,
            });
        }
    }
}

// Written out rather than with `async_trait`, whose future would hold the request twice more
// (as a capture and as a local) and the logical request's future inside its own: this boxes
// that future alone, and a request an outer instance already retries costs no box at all.
impl Middleware for RetryMiddleware {
    fn handle<'life0, 'life1, 'life2, 'async_trait>(
        &'life0 self,
        request: Request,
        extensions: &'life1 mut Extensions,
        next: Next<'life2>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        'life1: 'async_trait,
        'life2: 'async_trait,
        Self: 'async_trait,
    {
        if CLAIMED.get() == claim_id(extensions) {
            // An instance further out on this request's path makes the attempts and retries.
            return next.run(request, extensions);
        }
        Box::pin(self.execute(request, extensions, next))
    }
}

/// What judging an attempt's outcome takes, fixed for the logical request.
#[derive(Clone, Copy)]
struct Judging<'a> {
    policy: &'a RetryPolicy,
    /// The method is idempotent, or the request carries a key.
    repeatable: bool,
    key: Option<&'a HeaderValue>,
    /// The dependency's classifier, and the request's head for it to see.
    hook: Option<(&'a Shared<dyn Classifier>, &'a RequestHead)>,
}

/// The error inside the [`RetryError`] of a request that did not wait for a spent quota.
#[derive(Debug, thiserror::Error)]
#[error("the dependency's quota is spent for {wait:?} more, longer than the request may wait")]
struct QuotaSpent {
    wait: Duration,
}

/// Whether the dependency accepted an attempt, for the adaptive throttle: it answered, with a
/// status other than the throttling and overload ones.
fn accepted(outcome: &reqwest_middleware::Result<Response>) -> bool {
    outcome
        .as_ref()
        .is_ok_and(|r| !matches!(r.status().as_u16(), 429 | 502 | 503 | 504))
}

/// The request for the next attempt, from what is kept: a copy when another attempt may follow
/// (the original stays kept), else the original itself, and the original too when it cannot be
/// copied (nothing is then kept).
fn take_attempt(kept: &mut Option<Request>, copy: bool) -> Request {
    if let Some(copy) = kept.as_ref().filter(|_| copy).and_then(Request::try_clone) {
        return copy;
    }
    let Some(original) = kept.take() else {
        unreachable!("a request is kept for every attempt that is made");
    };
    original
}

thread_local! {
    /// Which request's chain is being run on this thread, if any: the address of its
    /// extensions, set by the instance that makes its attempts while it runs the rest of the
    /// chain (0: none).
    static CLAIMED: Cell<usize> = const { Cell::new(0) };
}

/// What identifies a request's passage through the chain: every middleware of it is handed the
/// same extensions, which stay at one address while the request is in the chain, and a
/// middleware's future cannot move the rest of the chain to another task (it borrows them).
fn claim_id(extensions: &Extensions) -> usize {
    std::ptr::from_ref(extensions) as usize
}

/// The rest of the chain for one attempt, run with its request marked as claimed on the
/// thread, so that instances nearer the transport pass it through instead of retrying it again.
/// Costs no allocation, unlike a mark in the extensions; the mark is the extensions' address,
/// so a request that a middleware of the chain makes of its own (a token refresh, say) through
/// another client is not mistaken for this one.
///
/// The logical request's span is entered for as long as the rest of the chain runs, so the
/// spans and events of the middleware and transport beneath are its children.
struct Claiming<'s, F> {
    id: usize,
    span: &'s tracing::Span,
    run: F,
}

impl<'s, F> Claiming<'s, F> {
    /// Starts the rest of the chain (`start`) with the request already marked: a middleware may
    /// do work before its future is first polled.
    fn new(id: usize, span: &'s tracing::Span, start: impl FnOnce() -> F) -> Self {
        let _marked = Mark::set(id);
        let run = span.in_scope(start);
        Claiming { id, span, run }
    }
}

impl<F: Future + Unpin> Future for Claiming<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let _marked = Mark::set(self.id);
        let _entered = self.span.enter();
        Pin::new(&mut self.run).poll(cx)
    }
}

/// Marks a request as claimed until dropped, then puts back the mark it replaced (a chain may
/// run inside another's, for a request of its own).
struct Mark(usize);

impl Mark {
    fn set(id: usize) -> Mark {
        Mark(CLAIMED.replace(id))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        CLAIMED.set(self.0);
    }
}

/// Polls `work` until it finishes, or `timer` fires first (`None`). `work` is polled first.
fn race<F: Future + Unpin>(
    mut work: F,
    mut timer: Pin<&mut AttemptTimer>,
) -> impl Future<Output = Option<F::Output>> {
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(done) = Pin::new(&mut work).poll(cx) {
            return Poll::Ready(Some(done));
        }
        timer.as_mut().poll(cx).map(|()| None)
    })
}

/// The levels of the middleware's events; see [`RetryMiddleware::with_retry_log_level`].
#[derive(Debug, Clone, Copy)]
struct LogLevels {
    /// An attempt that a retry follows, and the end of a request that was retried.
    retry: Level,
    /// The end of a request whose failure was not retried (or not again).
    give_up: Level,
}

impl Default for LogLevels {
    fn default() -> Self {
        LogLevels {
            retry: Level::INFO,
            give_up: Level::WARN,
        }
    }
}

impl LogLevels {
    /// The level of a request's end: a give-up at `give_up`, the end of a retried request at
    /// `retry`, a request that went as its first attempt went at DEBUG.
    fn of_stop(&self, attempts: u32, stop: StopReason) -> Level {
        match stop {
            StopReason::Succeeded | StopReason::NotRetryable if attempts > 1 => self.retry,
            StopReason::Succeeded | StopReason::NotRetryable => Level::DEBUG,
            _ => self.give_up,
        }
    }

    /// Traces the end of a logical request, and hands back its error.
    fn stopped(&self, attempts: u32, waited: Duration, err: RetryError) -> RetryError {
        self.trace_stop(
            attempts,
            err.stop_reason(),
            waited,
            err.status().map(|s| s.as_u16()),
        );
        err
    }

    fn trace_stop(&self, attempts: u32, stop: StopReason, waited: Duration, status: Option<u16>) {
        event_at!(
            self.of_stop(attempts, stop),
            attempts,
            reason = stop.as_str(),
            status,
            waited_ms = millis(waited),
            "retrying stopped"
        );
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The tracing target of every span and event, whatever module emits them.
const TARGET: &str = "reqwest_safe_retry";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_middleware_gives_back_its_default_dependency_s_parts() {
        let policy = RetryPolicy::builder().max_attempts(5).build().unwrap();
        let budget = RetryBudget::aws_like();
        let middleware = RetryMiddleware::new(policy).with_budget(budget.clone());
        assert_eq!(*middleware.policy(), policy);
        assert!(middleware.budget().unwrap().same_bucket(&budget));
        assert!(middleware.clone().without_budget().budget().is_none());
        let counters = middleware.counters().clone();
        counters.add(Count::Request, &middleware.default.metric_keys);
        assert_eq!(middleware.counters().snapshot().requests, 1);
        let url = reqwest::Url::parse("http://unrouted.example/").unwrap();
        assert_eq!(middleware.dependency_for(&url).name(), "default");
        let observed = middleware.with_observer(|_: &RetryEvent<'_>| {});
        let debug = format!("{observed:?}");
        assert!(debug.contains("observer: Some(RetryObserver)"), "{debug}");
        assert!(debug.contains("clock: Clock"), "{debug}");
        assert!(debug.contains("rng: RandomSource"), "{debug}");
    }
}
