//! The driver: the only code in the crate that sends, awaits or sleeps.
//!
//! One call to `send()` is one logical request. The driver picks the request's dependency (by
//! host) and policy (or the request's own override), starts the request in the decision core
//! (`decide`) with the time, has `idempotency` decide its key, then asks the core what each
//! attempt may do (send within a timeout, hold for a spent quota, stop), sends a copy of the
//! request down the chain racing that timeout on the injected clock, has `classify` judge the
//! outcome, and hands the core the outcome and the time: it answers a wait, slept on the clock,
//! or a stop. This module holds no rule of its own: one layer retries (`chain`), the budget,
//! quota and throttle accounting (`decide`), the verdict (`classify`), the key (`idempotency`).

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
use crate::decide::{Decider, Next as Step, Observed};
use crate::dependency::{Dependency, HostMatch, RetryOverride};
use crate::error::{InvalidConfig, RetryRecord, StopReason, nothing_sent};
use crate::idempotency::{self, IdempotencyKeys, Key};
use crate::observe::{RetryCounters, RetryObserver, url_without_query};
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

    /// The logical request: its holds, attempts, waits and outcome.
    ///
    /// Its future is the one boxed for the chain, so it is kept small (at most 1,032 bytes, the
    /// largest size glibc's allocator keeps in its per-thread cache): the request is held once
    /// (the copy kept for a retry); each attempt is a block that ends before the wait, so what
    /// it holds takes no room while the request sleeps, and its timer (a real-time one under a
    /// paused tokio clock) does not hold up the wait's auto-advance; inside it, the copy sent is
    /// scoped out of the attempt's await, and what is judged ends before the body kept through
    /// the wait is read; the rare states (an override, a body read, a kept answer) are boxed;
    /// the timer is polled in place.
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
            let (overriding, no_retries, refused) =
                match RetryOverride::plan(extensions.get(), &dependency.policy) {
                    Ok((policy, no_retries)) => (policy, no_retries, None),
                    Err(invalid) => (None, false, Some(middleware(invalid))),
                };
            let policy: &RetryPolicy = overriding.as_deref().unwrap_or(&dependency.policy);
            let mut now = self.clock.get().now();
            let mut decider = Decider::start(policy, dependency.accounts(), no_retries, now);
            let Some(request) = &kept else {
                unreachable!("the request is kept until its first attempt");
            };
            let mut sent = match self.prepare(dependency, request, refused, &mut decider) {
                Ok(prepared) => prepared,
                Err((stop, cause)) => return self.finish(&span, Err(cause), stop, &decider, None),
            };
            loop {
                let url = kept.as_ref().map(Request::url);
                let limit = match decider.next_attempt(now, url, &*self.rng.0) {
                    Step::Send(limit) => limit,
                    Step::Hold(hold) => {
                        if let Err(missing) = self.clock.wait(hold).await {
                            return self.no_timer(&span, missing, &decider, sent.key);
                        }
                        now = self.clock.get().now();
                        continue;
                    }
                    Step::Stop(stop) => {
                        let outcome = sent.last_outcome(stop);
                        return self.finish(&span, outcome, stop, &decider, sent.key);
                    }
                };
                drop(sent.previous.take());
                // One attempt, in a block that ends before the wait (see above).
                let delay = {
                    let timer = match self.clock.timeout(limit, Some(now)) {
                        Ok(timer) => timer,
                        Err(missing) => return self.no_timer(&span, missing, &decider, sent.key),
                    };
                    let mut timer = std::pin::pin!(timer);
                    let (outcome, delay) = {
                        let number = decider.attempts() + 1;
                        chain::announce(extensions, &span, number);
                        let attempt = {
                            let copy = decider.may_retry_after_next();
                            let mut sending = chain::take_attempt(&mut kept, copy);
                            idempotency::put_on(
                                self.keys.as_ref(),
                                sent.key.as_ref(),
                                &mut sending,
                            );
                            let id = chain::claim_id(extensions);
                            Claiming::new(id, &span, || next.clone().run(sending, extensions))
                        };
                        decider.attempt_started();
                        let judging = sent.judging(policy);
                        let outcome = chain::race(attempt, timer.as_mut()).await;
                        let outcome = outcome.unwrap_or_else(|| Err(chain::timed_out(limit)));
                        let verdict = judging.verdict(&outcome, number);
                        let (outcome, verdict) = match body::to_read(policy, &outcome, verdict) {
                            None => (outcome, verdict),
                            Some(max) => {
                                let read = (outcome, verdict, max, (&judging, number, limit));
                                Box::pin(chain::read_body(read, timer.as_mut())).await
                            }
                        };
                        let seen = Observed::of(&outcome, verdict, kept.as_ref().map(Request::url));
                        let decision = self.decide_after(&mut decider, seen);
                        let traced = (number, &outcome, verdict, decision, decider.floor());
                        span.in_scope(|| self.log.attempt(sent.watcher.as_deref(), traced));
                        match decision {
                            Wait::Stop(stop) => {
                                return self.finish(&span, outcome, stop, &decider, sent.key);
                            }
                            Wait::Sleep(delay) => (outcome, delay),
                        }
                    };
                    // Boxed: the reading state is large, and only a retry needs it.
                    let kept_body = body::keep(outcome, body::KEPT, timer);
                    sent.previous = Some(Box::new(Box::pin(kept_body).await));
                    delay
                };
                if let Err(missing) = self.clock.wait(delay).await {
                    return self.no_timer(&span, missing, &decider, sent.key);
                }
                now = self.clock.get().now();
            }
        }
    }

    /// What a request needs after it has gone, decided before its first attempt: its key, whether
    /// it may be repeated, and what the classifier and the observer see of it.
    #[inline]
    fn prepare<'a>(
        &'a self,
        dependency: &'a Dependency,
        request: &Request,
        refused: Option<reqwest_middleware::Error>,
        decider: &mut Decider<'_>,
    ) -> Result<Sent<'a>, (StopReason, reqwest_middleware::Error)> {
        if let Some(cause) = refused {
            return Err((StopReason::InvalidOverride, cause));
        }
        let key = idempotency::key_for(self.keys.as_ref(), request.method(), request.headers())
            .map_err(|e| (StopReason::InvalidIdempotencyKey, middleware(e)))?;
        if key.as_ref().is_some_and(|key| key.stamped) {
            decider.key_stamped();
        }
        Ok(Sent {
            repeatable: key.is_some() || classify::is_idempotent(request.method()),
            key,
            // Only a classifier needs the request after it has gone: its head is kept for it.
            head: (dependency.classifier.as_ref()).map(|c| (c, Box::new(RequestHead::of(request)))),
            watcher: self.observer.as_ref().map(|observer| {
                Box::new(Watcher {
                    observer: &*observer.0,
                    dependency: &dependency.name,
                    method: request.method().clone(),
                    url: url_without_query(request.url()),
                })
            }),
            previous: None,
        })
    }

    /// What follows an attempt, from the core: at once when nothing needs the time.
    #[inline]
    fn decide_after(&self, decider: &mut Decider<'_>, observed: Observed<'_>) -> Wait {
        match decider.stop_without_time(&observed) {
            Some(stop) => Wait::Stop(stop),
            None => {
                let clock = self.clock.get();
                decider.after_attempt(observed, clock.now(), clock.wall_now(), &*self.rng.0)
            }
        }
    }

    /// The end of a request whose clock has no timer to wait or time an attempt with.
    fn no_timer(
        &self,
        span: &tracing::Span,
        missing: crate::TimerUnavailable,
        decider: &Decider<'_>,
        key: Option<Key>,
    ) -> reqwest_middleware::Result<Response> {
        let cause = Err(middleware(missing));
        self.finish(span, cause, StopReason::TimerUnavailable, decider, key)
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
        let status = match &outcome {
            Ok(response) => Some(response.status()),
            Err(err) => err.status(),
        };
        self.log
            .trace_stop(attempts, stop, waited, status.map(|s| s.as_u16()));
        let key = key.map(|key| key.value);
        let record = RetryRecord {
            attempts,
            stop,
            waited,
            key,
            replayed: false,
        };
        record.hand_back(outcome)
    }
}

// Not `async_trait`, whose future would hold the request twice more and box this one inside its
// own: the logical request's future alone is boxed, and a request passed through costs none.
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

/// What one logical request keeps of itself while its attempts go, decided before the first.
struct Sent<'a> {
    key: Option<Key>,
    /// The method is idempotent, or the request carries a key.
    repeatable: bool,
    /// The dependency's classifier, and the request's head for it to see.
    head: Option<(&'a Shared<dyn Classifier>, Box<RequestHead>)>,
    watcher: Option<Box<Watcher<'a>>>,
    /// The last outcome, kept through a wait for a stop that may follow it; boxed, as only a
    /// retry needs room for it.
    previous: Option<Box<reqwest_middleware::Result<Response>>>,
}

impl Sent<'_> {
    /// What a stop before an attempt hands back: the last outcome, or what says nothing was sent.
    fn last_outcome(&mut self, stop: StopReason) -> reqwest_middleware::Result<Response> {
        self.previous
            .take()
            .map_or_else(|| Err(nothing_sent(stop)), |outcome| *outcome)
    }

    #[inline]
    fn judging<'j>(&'j self, policy: &'j RetryPolicy) -> Judging<'j> {
        Judging {
            policy,
            repeatable: self.repeatable,
            key: self.key.as_ref().map(|key| &key.value),
            hook: self.head.as_ref().map(|(c, head)| (*c, &**head)),
        }
    }
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
