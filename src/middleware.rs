//! The driver: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The driver picks the request's dependency (by
//! host) and policy (or the request's own override), starts the request in the decision core
//! (`decide`) with the time, has `idempotency` decide its key, then asks the core what each
//! attempt may do (send within a timeout, hold for a spent quota, stop), sends a copy of the
//! request down the chain racing that timeout on the injected clock, has `classify` judge the
//! outcome, and hands the core the outcome and the time: it answers a wait, slept on the clock,
//! or a stop. The core does the budget, quota and throttle accounting and the counting; this
//! module holds no rule of its own.
//!
//! How one layer of several retries, and the others pass through, is `chain`'s; what to do next
//! is `decide`'s; whether an outcome is transient and safe to repeat is `classify`'s; the key is
//! `idempotency`'s; what is traced is `trace`'s.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};
use tracing::Level;

use crate::body;
use crate::budget::RetryBudget;
use crate::chain::{self, Claiming};
use crate::classifier::{Classifier, RequestHead};
use crate::classify::{self, Judging};
use crate::clock::{Clock, SharedClock, TokioClock};
use crate::decide::{Answer, Decider, Next as Step, Observed};
use crate::dependency::{Dependency, HostMatch, RetryOverride};
use crate::error::{InvalidConfig, RetryError, RetryRecord, StopReason};
use crate::idempotency::{self, IdempotencyKeys, Key};
use crate::observe::{RetryAttempt, RetryCounters, RetryObserver, url_without_query};
use crate::policy::RetryPolicy;
use crate::rng::{RandomSource, ThreadRng};
use crate::schedule::Wait;
use crate::shared::Shared;
use crate::throttle::AdaptiveThrottle;
use crate::trace::{self, LogLevels, Watcher};

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

    /// The logical request: its holds, attempts, waits and outcome. Its future is the one boxed
    /// for the chain, so it is kept small: the request is held once (the copy kept for a retry),
    /// everything of one attempt that is not needed across an `await` is scoped to a block that
    /// ends before it, and the timer is polled in place.
    fn execute<'a>(
        &'a self,
        request: Request,
        extensions: &'a mut Extensions,
        next: Next<'a>,
    ) -> impl Future<Output = reqwest_middleware::Result<Response>> + Send + 'a {
        let dependency = self.dependency_for(request.url());
        let span = trace::request_span(&dependency.name, &request);
        // A copy is kept for the next attempt while the request goes out; none is made for the
        // last attempt, and none can be made of a body that is a stream.
        let mut kept = Some(request);
        async move {
            // An override is boxed, which keeps the future small for the requests that have none.
            let (overriding, no_retries, refused) =
                match RetryOverride::plan(extensions.get(), &dependency.policy) {
                    Ok((policy, no_retries)) => (policy, no_retries, None),
                    Err(invalid) => (None, false, Some(middleware(invalid))),
                };
            let policy: &RetryPolicy = overriding.as_deref().unwrap_or(&dependency.policy);
            let mut decider = Decider::start(
                policy,
                dependency.accounts(),
                no_retries,
                self.clock.get().now(),
            );
            let Some(request) = &kept else {
                unreachable!("the request is kept until its first attempt");
            };
            let key = match refused.map_or_else(
                || {
                    idempotency::key_for(self.keys.as_ref(), request.method(), request.headers())
                        .map_err(|e| (StopReason::InvalidIdempotencyKey, middleware(e)))
                },
                |cause| Err((StopReason::InvalidOverride, cause)),
            ) {
                Ok(key) => key,
                Err((stop, cause)) => return self.finish(&span, Err(cause), stop, &decider, None),
            };
            if key.as_ref().is_some_and(|key| key.stamped) {
                decider.key_stamped();
            }
            // Only a classifier needs the request after it has gone: its head is kept for it.
            let head = dependency
                .classifier
                .as_ref()
                .map(|c| (c, Box::new(RequestHead::of(request))));
            let watcher = self.observer.as_ref().map(|observer| {
                Box::new(Watcher {
                    observer: &*observer.0,
                    dependency: &dependency.name,
                    method: request.method().clone(),
                    url: url_without_query(request.url()),
                })
            });
            let judging = Judging {
                policy,
                repeatable: key.is_some() || classify::is_idempotent(request.method()),
                key: key.as_ref().map(|key| &key.value),
                hook: head.as_ref().map(|(c, head)| (*c, &**head)),
            };
            // The last outcome, kept through a wait for a stop that may follow it; boxed, as only
            // a retry needs room for it.
            let mut previous: Option<Box<reqwest_middleware::Result<Response>>> = None;
            let mut now = decider.started();
            loop {
                let limit = match decider.next_attempt(
                    now,
                    kept.as_ref().map(Request::url),
                    &*self.rng.0,
                ) {
                    Step::Send(limit) => limit,
                    Step::Hold(hold) => {
                        if let Err(missing) = self.pause(hold).await {
                            let cause = Err(middleware(missing));
                            return self.finish(
                                &span,
                                cause,
                                StopReason::TimerUnavailable,
                                &decider,
                                key,
                            );
                        }
                        now = self.clock.get().now();
                        continue;
                    }
                    Step::Stop(stop) => {
                        let outcome = previous
                            .take()
                            .map_or_else(|| Err(crate::error::nothing_sent(stop)), |kept| *kept);
                        return self.finish(&span, outcome, stop, &decider, key);
                    }
                };
                drop(previous.take());
                // One attempt, in a block that ends before the wait: what it holds takes no room
                // in the future while it sleeps, and its timer (a real-time one under a paused
                // tokio clock) does not hold up the wait's auto-advance.
                let delay = {
                    let timer = match self.clock.timeout(limit, Some(now)) {
                        Ok(timer) => timer,
                        Err(missing) => {
                            let cause = Err(middleware(missing));
                            return self.finish(
                                &span,
                                cause,
                                StopReason::TimerUnavailable,
                                &decider,
                                key,
                            );
                        }
                    };
                    let mut timer = std::pin::pin!(timer);
                    // What is judged of the attempt ends with this block, before the body kept
                    // through the wait is read: it takes no room in the future then.
                    let (outcome, delay) = {
                        let number = decider.attempts() + 1;
                        if number > 1 {
                            // For the middleware and transport beneath, before they see it.
                            extensions.insert(RetryAttempt { number });
                            span.record("http.request.resend_count", number - 1);
                        }
                        // Scoped: the copy sent is the chain's once it runs, and takes no room
                        // in the future while the attempt is awaited.
                        let attempt = {
                            let mut sending =
                                chain::take_attempt(&mut kept, decider.may_retry_after_next());
                            if let (
                                Some(keys),
                                Some(Key {
                                    value,
                                    stamped: true,
                                }),
                            ) = (&self.keys, &key)
                            {
                                sending
                                    .headers_mut()
                                    .insert(keys.header_name(), value.clone());
                            }
                            let id = chain::claim_id(extensions);
                            Claiming::new(id, &span, || next.clone().run(sending, extensions))
                        };
                        decider.attempt_started();
                        let (outcome, verdict) = {
                            let outcome = chain::race(attempt, timer.as_mut()).await;
                            let outcome = outcome.unwrap_or_else(|| Err(timed_out(limit)));
                            let verdict = judging.verdict(&outcome, number);
                            match body::to_read(policy, &outcome, verdict) {
                                None => (outcome, verdict),
                                // Boxed: the reading state is large, and most requests never
                                // need it.
                                Some(max) => {
                                    let read = read_body(
                                        outcome,
                                        verdict,
                                        max,
                                        timer.as_mut(),
                                        &judging,
                                        number,
                                        limit,
                                    );
                                    Box::pin(read).await
                                }
                            }
                        };
                        let observed = Observed {
                            verdict,
                            answer: outcome.as_ref().ok().map(|r| Answer {
                                status: r.status(),
                                headers: r.headers(),
                                url: r.url(),
                            }),
                            resend: kept.as_ref().map(Request::url),
                        };
                        let decision = match decider.stop_without_time(&observed) {
                            Some(stop) => Wait::Stop(stop),
                            None => decider.after_attempt(
                                observed,
                                self.clock.get().now(),
                                self.clock.get().wall_now(),
                                &*self.rng.0,
                            ),
                        };
                        let floor = decider.floor();
                        span.in_scope(|| {
                            self.log.attempt(
                                watcher.as_deref(),
                                number,
                                &outcome,
                                verdict,
                                decision,
                                floor,
                            )
                        });
                        match decision {
                            Wait::Stop(stop) => {
                                return self.finish(&span, outcome, stop, &decider, key);
                            }
                            Wait::Sleep(delay) => (outcome, delay),
                        }
                    };
                    // Boxed: the reading state is large, and only a retry needs it.
                    previous = Some(Box::new(match outcome {
                        Ok(answer) => Ok(Box::pin(body::keep(answer, body::KEPT, timer)).await),
                        Err(err) => Err(err),
                    }));
                    delay
                };
                if let Err(missing) = self.pause(delay).await {
                    let cause = Err(middleware(missing));
                    return self.finish(&span, cause, StopReason::TimerUnavailable, &decider, key);
                }
                now = self.clock.get().now();
            }
        }
    }

    /// A wait on the clock: a hold before an attempt (which may come before any timer of the
    /// request was made), or the wait before a retry.
    async fn pause(&self, wait: std::time::Duration) -> Result<(), crate::TimerUnavailable> {
        self.clock.checked_sleep(wait)?.await;
        Ok(())
    }

    /// The caller's outcome, traced in the request's span: the response with its record, or the
    /// error wrapped with the count and the reason.
    fn finish(
        &self,
        span: &tracing::Span,
        outcome: reqwest_middleware::Result<Response>,
        stop: StopReason,
        decider: &Decider<'_>,
        key: Option<Key>,
    ) -> reqwest_middleware::Result<Response> {
        let _entered = span.enter();
        let (attempts, waited) = (decider.attempts(), decider.waited());
        let key = key.map(|key| key.value);
        match outcome {
            Ok(mut response) => {
                let status = Some(response.status().as_u16());
                self.log.trace_stop(attempts, stop, waited, status);
                // The most common outcome, a first attempt's success without a key, carries
                // no record: `RetryRecord::of` infers it, and the success path is spared an
                // allocation and a map insertion.
                if attempts > 1
                    || stop != StopReason::Succeeded
                    || key.is_some()
                    || !waited.is_zero()
                {
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
        if chain::claimed(extensions) {
            // An instance further out on this request's path makes the attempts and retries.
            return next.run(request, extensions);
        }
        Box::pin(self.execute(request, extensions, next))
    }
}

/// The body of an attempt's answer read inside the attempt (the policy's `buffer_body`), racing
/// the attempt's timer; judged again if reading it failed: a body cut off is transient.
async fn read_body(
    outcome: reqwest_middleware::Result<Response>,
    verdict: classify::Verdict,
    max: usize,
    timer: Pin<&mut crate::clock::AttemptTimer>,
    judging: &Judging<'_>,
    number: u32,
    limit: std::time::Duration,
) -> (reqwest_middleware::Result<Response>, classify::Verdict) {
    let Ok(response) = outcome else {
        return (outcome, verdict);
    };
    let reading = std::pin::pin!(body::buffer(response, max));
    let outcome = match chain::race(reading, timer).await {
        // The same status and head: the verdict stands.
        Some(Ok(read)) => return (Ok(read), verdict),
        Some(Err(e)) => Err(reqwest_middleware::Error::Reqwest(e)),
        None => Err(timed_out(limit)),
    };
    let verdict = judging.verdict(&outcome, number);
    (outcome, verdict)
}

/// The error of an attempt that ran out of its time.
fn timed_out(limit: std::time::Duration) -> reqwest_middleware::Error {
    middleware(crate::error::AttemptTimeout { after: limit })
}

fn middleware(cause: impl std::error::Error + Send + Sync + 'static) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(cause)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::{Count, RetryEvent};

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
