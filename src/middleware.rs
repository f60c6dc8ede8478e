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
use reqwest::{Request, Response, Url};
use reqwest_middleware::{Middleware, Next};
use tracing::Level;

use crate::body;
use crate::chain::{self, Claiming};
use crate::classifier::{Classifier, RequestHead};
use crate::classify::{self, Judging};
use crate::clock::{Clock, SharedClock, TokioClock};
use crate::decide::{Cap, Decider, Next as Step, Observed};
use crate::dependency::{Dependency, RetryOverride, Routes};
use crate::error::{InvalidConfig, StopReason, nothing_sent};
use crate::hedge;
use crate::idempotency::{self, Key, NaturalKey};
use crate::observe::{Observer, RetryEvent};
use crate::policy::RetryPolicy;
use crate::record::RetryRecord;
use crate::rng::{RandomSource, ThreadRng};
use crate::schedule::Wait;
use crate::shared::Shared;
use crate::trace::{self, LogLevels, Watcher};

/// A [`reqwest_middleware::Middleware`] that retries transient failures when repeating is safe.
///
/// Hand it a [`RetryPolicy`] for one dependency with its defaults, or a [`Dependency`] that names
/// it and carries its own budget, classifier, throttle and idempotency keys; [`route`](Self::route)
/// sends other hosts through other dependencies. Everything per dependency is set on
/// [`Dependency`]; the middleware's own setters are for what all of its dependencies share: the
/// clock, the random source, the observer and the log levels.
///
/// ```
/// use reqwest_middleware::ClientBuilder;
/// use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
///
/// // One dependency with every default.
/// let simple = ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(RetryPolicy::default()))
///     .build();
///
/// // A named one: keep a clone to read its counters.
/// let payments = Dependency::new("payments", RetryPolicy::default());
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(RetryMiddleware::new(payments.clone()))
///     .build();
/// assert_eq!(payments.counters().requests, 0);
/// # drop((simple, client));
/// ```
///
/// # Default
///
/// | part | default |
/// |---|---|
/// | dependency | the one given to [`new`](Self::new) (a policy alone is a dependency named `default` with the [`Dependency::new`] defaults); [`route`](Self::route) adds others by host |
/// | clock | tokio's timer and the system's wall clock ([`with_clock`](Self::with_clock)) |
/// | random source | the thread's generator ([`with_rng`](Self::with_rng)) |
/// | observer | none ([`with_observer`](Self::with_observer)) |
/// | log levels | INFO for a retry, WARN for a give-up, DEBUG for the rest ([`with_retry_log_level`](Self::with_retry_log_level), [`with_give_up_log_level`](Self::with_give_up_log_level)) |
///
/// In tests, use `FakeClock` (feature `test-util`) and [`SeededRng`](crate::SeededRng).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    dependencies: Routes,
    clock: SharedClock,
    rng: Shared<dyn RandomSource>,
    observer: Option<Shared<dyn Observer>>,
    log: LogLevels,
}

impl Default for RetryMiddleware {
    /// The middleware for [`RetryPolicy::default()`], as [`new`](Self::new) makes it.
    fn default() -> Self {
        RetryMiddleware::new(RetryPolicy::default())
    }
}

impl RetryMiddleware {
    /// Creates the middleware with `dependency` for every request not [routed](Self::route)
    /// elsewhere: a [`Dependency`], or a [`RetryPolicy`] alone (a dependency named `default`
    /// with a budget, counters and idempotency keys of its own).
    pub fn new(dependency: impl Into<Dependency>) -> Self {
        RetryMiddleware {
            dependencies: Routes::new(dependency.into()),
            clock: SharedClock::new(TokioClock::new()),
            rng: Shared(Arc::new(ThreadRng::new())),
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
        self.dependencies.add(host, dependency)?;
        Ok(self)
    }

    /// Uses `clock` for every wait and every reading of the time, for all dependencies. Tests
    /// pass a `FakeClock` (feature `test-util`); under tokio's paused clock the default already
    /// takes no real time.
    pub fn with_clock(mut self, clock: impl Clock) -> Self {
        self.clock = SharedClock::new(clock);
        self
    }

    /// Draws jitter from `rng`: a [`SeededRng`](crate::SeededRng) makes every wait repeat
    /// exactly from run to run.
    pub fn with_rng(mut self, rng: impl RandomSource) -> Self {
        self.rng = Shared(Arc::new(rng));
        self
    }

    /// Calls `observer` after every attempt with the decision about the next one: to record
    /// waits and stops in a test, or to export them as your own metrics. For counts alone,
    /// [`Dependency::counters`] needs no hook.
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use reqwest_safe_retry::{RetryMiddleware, RetryPolicy};
    ///
    /// let delays = Arc::new(Mutex::new(Vec::new()));
    /// let seen = delays.clone();
    /// let middleware = RetryMiddleware::new(RetryPolicy::default()).with_observer(move |event| {
    ///     seen.lock().unwrap().extend(event.delay);
    /// });
    /// # drop(middleware);
    /// ```
    pub fn with_observer<F>(mut self, observer: F) -> Self
    where
        F: Fn(&RetryEvent<'_>) + Send + Sync + 'static,
    {
        self.observer = Some(Shared(Arc::new(observer)));
        self
    }

    /// The level of the event for an attempt that a retry follows, and of the end of a request
    /// that was retried and then succeeded; INFO by default, so a retry leaves a trace at the
    /// usual level. A success is never logged above INFO, whatever this says. The other
    /// attempts' events, and the end of a request that went as its first attempt went, stay at
    /// DEBUG.
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

    /// The logical request: its holds, attempts, waits and outcome.
    ///
    /// Its future is the one boxed for the chain, so it is kept small (its bound is
    /// `tests/all/future_size.rs`'s, which says why): the request is held once
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
        let dependency = self.dependencies.pick(request.url());
        let span = trace::request_span(&dependency.name, &request);
        // A copy is kept for the next attempt while the request goes out; none is made for the
        // last attempt, and none can be made of a body that is a stream.
        let mut kept = Some(request);
        async move {
            let (overriding, cap, refused) =
                match RetryOverride::plan(extensions, &dependency.policy) {
                    Ok((policy, cap)) => (policy, cap, None),
                    Err(invalid) => (None, Cap::Policy, Some(middleware(invalid))),
                };
            let policy: &RetryPolicy = overriding.as_deref().unwrap_or(&dependency.policy);
            let mut now = self.clock.get().now();
            let Some(request) = &kept else {
                unreachable!("the request is kept until its first attempt");
            };
            let accounts = dependency.accounts();
            let mut decider = Decider::start(policy, accounts, cap, request.method(), now);
            let mut sent =
                match self.prepare(dependency, request, extensions, refused, &mut decider) {
                    Ok(prepared) => prepared,
                    Err((stop, cause, watcher)) => {
                        let ends = (None, watcher.as_deref(), Some(request.url()));
                        return self.finish(&span, Err(cause), stop, &decider, ends);
                    }
                };
            // The request's URL once the request itself went out as its last attempt: for an
            // error that has none. Boxed, as only a last attempt needs it.
            let mut gone: Option<Box<Url>> = None;
            loop {
                let url = kept.as_ref().map(Request::url);
                let limit = match decider.next_attempt(now, url, &*self.rng.0) {
                    Step::Send(limit) => limit,
                    Step::Hold(hold) => {
                        if let Err(missing) = self.clock.wait(hold).await {
                            return self.no_timer(
                                &span,
                                missing,
                                &decider,
                                sent,
                                url_of(&kept, &gone),
                            );
                        }
                        now = self.clock.get().now();
                        continue;
                    }
                    Step::Stop(stop) => {
                        let outcome = sent.last_outcome(stop);
                        let ends = sent.ends(url_of(&kept, &gone));
                        return self.finish(&span, outcome, stop, &decider, ends);
                    }
                };
                drop(sent.previous.take());
                // One attempt, in a block that ends before the wait (see above).
                let delay = {
                    let timer = match self.clock.timeout(limit, Some(now)) {
                        Ok(timer) => timer,
                        Err(missing) => {
                            return self.no_timer(
                                &span,
                                missing,
                                &decider,
                                sent,
                                url_of(&kept, &gone),
                            );
                        }
                    };
                    let mut timer = std::pin::pin!(timer);
                    let (outcome, delay) = {
                        let number = decider.attempts() + 1;
                        chain::announce(extensions, &span, number);
                        let judging = sent.judging(policy);
                        let headers = &dependency.attempt_headers;
                        let (outcome, verdict) = if let Some(after) = decider.hedge_after() {
                            // Boxed: only a hedged read needs room for two copies.
                            let hedged = hedge::Hedged {
                                kept: &mut kept,
                                extensions,
                                next: &next,
                                span: &span,
                                number,
                                limit,
                                after,
                                headers,
                                left: decider.remaining(now),
                                judging: &judging,
                            };
                            let (clock, rng) = (&self.clock, &*self.rng.0);
                            let attempt =
                                hedge::attempt(hedged, &mut decider, clock, rng, timer.as_mut());
                            Box::pin(attempt).await
                        } else {
                            let attempt = {
                                let copy = decider.may_retry_after_next();
                                let mut sending = chain::take_attempt(&mut kept, copy);
                                if kept.is_none() {
                                    // The last attempt: its URL, for an error without one.
                                    gone = Some(Box::new(sending.url().clone()));
                                }
                                idempotency::put_on(
                                    dependency.keys.as_ref(),
                                    sent.key.as_ref(),
                                    &mut sending,
                                );
                                if headers.are_on() {
                                    headers.put_on(&mut sending, number, decider.remaining(now));
                                }
                                let id = chain::claim_id(extensions);
                                Claiming::new(id, &span, || next.clone().run(sending, extensions))
                            };
                            decider.attempt_started();
                            let mut limit = limit;
                            // At its limit, the core cuts the attempt or lets it run on (once:
                            // then it has the fixed timeout).
                            let at_limit = || {
                                let now = self.clock.get().now();
                                let more = decider.at_limit(now)?;
                                let longer = self.clock.timeout(more, Some(now)).ok()?;
                                limit += more;
                                Some(longer)
                            };
                            let outcome = chain::race_on(attempt, timer.as_mut(), at_limit).await;
                            let outcome = outcome.unwrap_or_else(|| Err(chain::timed_out(limit)));
                            if policy.buffer_body_limit().is_none() {
                                let verdict = judging.verdict(&outcome, number);
                                (outcome, verdict)
                            } else {
                                // Boxed: only a body read needs room for its state.
                                let how = (&judging, number, limit);
                                Box::pin(chain::judged(outcome, how, timer.as_mut())).await
                            }
                        };
                        if sent.key.is_some() && !sent.key_sent {
                            sent.key_sent = classify::may_have_reached(&outcome);
                        }
                        let seen = Observed::of(&outcome, verdict, kept.as_ref().map(Request::url));
                        let decision = self.decide_after(&mut decider, seen);
                        if let Some(watcher) = sent.watcher.as_deref() {
                            let traced = (number, &outcome, verdict, decision, decider.floor());
                            span.in_scope(|| self.log.attempt(watcher, traced));
                        }
                        match decision {
                            Wait::Stop(stop) => {
                                let ends = sent.ends(url_of(&kept, &gone));
                                return self.finish(&span, outcome, stop, &decider, ends);
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
                    return self.no_timer(&span, missing, &decider, sent, url_of(&kept, &gone));
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
        extensions: &Extensions,
        refused: Option<reqwest_middleware::Error>,
        decider: &mut Decider<'_>,
    ) -> Result<Sent<'a>, Unsent<'a>> {
        // Who watches: the observer, and the events when a subscriber takes them; only then is
        // the request's name (method, host, path) copied for them.
        let watcher = (self.observer.is_some() || self.log.enabled()).then(|| {
            Box::new(Watcher::of(
                self.observer.as_ref().map(|observer| &*observer.0),
                &dependency.name,
                request,
            ))
        });
        if let Some(cause) = refused {
            return Err((StopReason::InvalidOverride, cause, watcher));
        }
        let key = match idempotency::key_for(
            dependency.keys.as_ref(),
            request.method(),
            request.headers(),
            extensions.get::<NaturalKey>(),
        ) {
            Ok(key) => key,
            Err(e) => return Err((StopReason::InvalidIdempotencyKey, middleware(e), watcher)),
        };
        if key.as_ref().is_some_and(|key| key.stamped) {
            decider.key_stamped();
        }
        if dependency.latency.is_some() && classify::may_be_hedged(request, key.is_some()) {
            decider.allow_hedges();
        }
        Ok(Sent {
            repeatable: key.is_some() || classify::is_idempotent(request.method()),
            key_sent: key.as_ref().is_some_and(|key| !key.fresh),
            key,
            // Only a classifier needs the request after it has gone: its head is kept for it.
            head: (dependency.classifier.as_ref()).map(|c| (c, Box::new(RequestHead::of(request)))),
            watcher,
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
                decider.after_attempt(observed, clock.now(), &|| clock.wall_now(), &*self.rng.0)
            }
        }
    }

    /// The end of a request whose clock has no timer to wait or time an attempt with.
    fn no_timer(
        &self,
        span: &tracing::Span,
        missing: crate::clock::TimerUnavailable,
        decider: &Decider<'_>,
        mut sent: Sent<'_>,
        url: Option<&Url>,
    ) -> reqwest_middleware::Result<Response> {
        let cause = Err(middleware(missing));
        let stop = StopReason::TimerUnavailable;
        self.finish(span, cause, stop, decider, sent.ends(url))
    }

    /// The caller's outcome, traced in the request's span: the response with its record, or the
    /// error wrapped with the count and the reason.
    fn finish(
        &self,
        span: &tracing::Span,
        outcome: reqwest_middleware::Result<Response>,
        stop: StopReason,
        decider: &Decider<'_>,
        (key, watcher, url): Ends<'_, '_>,
    ) -> reqwest_middleware::Result<Response> {
        let (attempts, waited) = (decider.attempts(), decider.waited());
        if let Some(watcher) = watcher {
            span.in_scope(|| (self.log).trace_stop(watcher, attempts, stop, waited, &outcome));
        }
        let key = key.map(|key| key.value);
        let record = RetryRecord {
            attempts,
            stop,
            waited,
            key,
            replayed: false,
            answered_by_hedge: decider.hedge_answered(),
        };
        record.hand_back(outcome, url)
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

/// A request stopped before its first attempt: why, the error that says so, and who watches.
type Unsent<'a> = (
    StopReason,
    reqwest_middleware::Error,
    Option<Box<Watcher<'a>>>,
);

/// What a request's end needs of it besides its outcome: its key, who watches, and its URL.
type Ends<'s, 'a> = (Option<Key>, Option<&'s Watcher<'a>>, Option<&'s Url>);

/// What one logical request keeps of itself while its attempts go, decided before the first.
struct Sent<'a> {
    key: Option<Key>,
    /// The key has been sent: a caller's own or a derived one (perhaps by an earlier run), or
    /// a new one once an attempt may have reached the server.
    key_sent: bool,
    /// The method is idempotent, or the request carries a key.
    repeatable: bool,
    /// The dependency's classifier, and the request's head for it to see.
    head: Option<(&'a Shared<dyn Classifier>, Box<RequestHead>)>,
    watcher: Option<Box<Watcher<'a>>>,
    /// The last outcome, kept through a wait for a stop that may follow it; boxed, as only a
    /// retry needs room for it.
    previous: Option<Box<reqwest_middleware::Result<Response>>>,
}

impl<'a> Sent<'a> {
    /// What the request's end needs, with its URL.
    fn ends<'s>(&'s mut self, url: Option<&'s Url>) -> Ends<'s, 'a> {
        (self.key.take(), self.watcher.as_deref(), url)
    }

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
            key_sent: self.key_sent,
            hook: self.head.as_ref().map(|(c, head)| (*c, &**head)),
        }
    }
}

/// The request's URL: from the request still kept, or the one that went as the last attempt.
fn url_of<'s>(kept: &'s Option<Request>, gone: &'s Option<Box<Url>>) -> Option<&'s Url> {
    kept.as_ref().map(Request::url).or(gone.as_deref())
}

fn middleware(cause: impl std::error::Error + Send + Sync + 'static) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(cause)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observe::RetryEvent;

    #[test]
    fn the_middleware_s_debug_names_its_hooks_without_asking_them() {
        let observed = RetryMiddleware::default().with_observer(|_: &RetryEvent<'_>| {});
        let debug = format!("{observed:?}");
        assert!(debug.contains("name: \"default\""), "{debug}");
        assert!(debug.contains("observer: Some(Observer)"), "{debug}");
        assert!(debug.contains("clock: Clock"), "{debug}");
        assert!(debug.contains("rng: RandomSource"), "{debug}");
    }
}
