//! The middleware itself: what every logical request it drives shares (its dependencies, the
//! clock, the random source, the observer and the log levels), and how a user sets it up. What
//! one request does is `phases`.

use std::sync::Arc;

use tracing::Level;

use crate::clock::{Clock, SharedClock};
use crate::driver::trace::LogLevels;
use crate::engine::dependency::{Dependency, Routes};
use crate::engine::policy::RetryPolicy;
use crate::error::InvalidConfig;
use crate::observe::{Observer, RetryEvent};
use crate::rng::{RandomSource, ThreadRng};
use crate::shared::Shared;

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
/// In tests, use `FakeClock` (feature `test-util`) and [`SeededRng`](crate::rng::SeededRng).
#[derive(Debug, Clone)]
pub struct RetryMiddleware {
    pub(super) dependencies: Routes,
    pub(super) clock: SharedClock,
    pub(super) rng: Shared<dyn RandomSource>,
    pub(super) observer: Option<Shared<dyn Observer>>,
    pub(super) log: LogLevels,
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
            clock: SharedClock::production(),
            rng: Shared(Arc::new(ThreadRng::new())),
            observer: None,
            log: LogLevels::default(),
        }
    }

    /// The middleware for `routes`, with the defaults' clock, random source and observer (the
    /// gRPC door's, whose dependencies are its methods').
    #[cfg(feature = "grpc")]
    pub(crate) fn routed(routes: Routes) -> Self {
        RetryMiddleware {
            dependencies: routes,
            ..RetryMiddleware::default()
        }
    }

    /// This middleware with `change` made to each of its dependencies (the gRPC door's: one
    /// channel's throttling in their rules), the rest shared with this one (counters, budget,
    /// clock).
    #[cfg(feature = "grpc")]
    pub(crate) fn with_each_dependency(
        &self,
        change: impl FnMut(&mut Dependency),
    ) -> RetryMiddleware {
        let mut middleware = self.clone();
        middleware.dependencies.each_mut(change);
        middleware
    }

    /// The dependency named `name`, if this middleware has one.
    #[cfg(feature = "grpc")]
    pub(crate) fn dependency_named(&self, name: &str) -> Option<&Dependency> {
        self.dependencies.named(name)
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

    /// Draws jitter from `rng`: a [`SeededRng`](crate::rng::SeededRng) makes every wait repeat
    /// exactly from run to run.
    ///
    /// So a test can state a schedule from the policy and the seed alone (full jitter, as
    /// [`Jitter::Full`](crate::Jitter::Full) says):
    ///
    /// ```
    /// use std::time::Duration;
    /// use reqwest_middleware::ClientBuilder;
    /// use reqwest_safe_retry::{FakeClock, RandomSource, RetryMiddleware, RetryPolicy, SeededRng};
    /// use wiremock::{matchers::any, Mock, MockServer, ResponseTemplate};
    ///
    /// /// Full jitter's wait before retry `k`, by `Jitter::Full`'s rule.
    /// fn full_jitter(policy: &RetryPolicy, k: u32, x: u64) -> Duration {
    ///     let c = policy.base_delay().saturating_mul(1 << k).min(policy.max_delay());
    ///     let nanos = (u128::from(x) * (c.as_nanos() + 1)) >> 64;
    ///     Duration::from_nanos(nanos as u64)
    /// }
    ///
    /// # #[tokio::main(flavor = "current_thread")]
    /// # async fn main() -> Result<(), Box<dyn std::error::Error>> {
    /// let policy = RetryPolicy::builder().max_attempts(4).build()?; // base 100 ms, cap 10 s
    /// let draws = SeededRng::new(42);
    /// let expected: Vec<Duration> = (0..3).map(|k| full_jitter(&policy, k, draws.next_u64())).collect();
    ///
    /// let server = MockServer::start().await;
    /// Mock::given(any()).respond_with(ResponseTemplate::new(503)).mount(&server).await;
    /// let clock = FakeClock::new();
    /// let client = ClientBuilder::new(reqwest::Client::new())
    ///     .with(RetryMiddleware::new(policy).with_clock(clock.clone()).with_rng(SeededRng::new(42)))
    ///     .build();
    /// client.get(server.uri()).send().await?;
    ///
    /// assert_eq!(clock.sleeps(), expected);
    /// let millis: Vec<u128> = expected.iter().map(Duration::as_millis).collect();
    /// assert_eq!(millis, [74, 31, 111]);
    /// # Ok(()) }
    /// ```
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
    /// DEBUG. `level` is a `tracing::Level` (add the `tracing` crate to name one).
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
}

#[cfg(test)]
mod tests {
    use super::*;

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
