//! Per dependency and per request: which policy, which budget, which counters.
//!
//! A service calls several dependencies with different needs: a payment API that wants keys and
//! a long deadline, an internal cache that wants one fast retry. Each [`Dependency`] carries its
//! own policy, budget and counters. A middleware has a default dependency and may route requests
//! to others by host (and port); the usual alternative is one middleware, and one client, per
//! dependency. A [`RetryOverride`] in a request's extensions changes the policy for that call
//! alone.

use std::sync::Arc;
use std::time::Duration;

use crate::engine::attempt_headers::{self, AttemptHeaders};
use crate::engine::budget::RetryBudget;
use crate::engine::classifier::{Attempt, Classifier, Retryable};
use crate::engine::decide::{Accounts, Cap};
#[cfg(feature = "grpc")]
use crate::engine::grpc::PathTable;
use crate::engine::idempotency::IdempotencyKeys;
use crate::engine::latency::LatencyWindow;
use crate::engine::policy::RetryPolicy;
use crate::engine::rate_limit::QuotaState;
use crate::engine::rules::{Http, Rules};
use crate::engine::seen::{Locate, Target};
use crate::engine::throttle::AdaptiveThrottle;
use crate::error::InvalidConfig;
use crate::observe::{CounterSnapshot, MetricKeys, RetryCounters};
use crate::shared::Shared;

/// One dependency's retry settings: a name (for counters, metrics and logs), a policy, a budget
/// of its own unless one is shared on purpose, counters, idempotency keys, and optionally a
/// classifier and a throttle. Hand it to [`RetryMiddleware::new`](crate::RetryMiddleware::new)
/// or [`route`](crate::RetryMiddleware::route).
///
/// Clones share everything that changes while requests run: the budget, the counters, the
/// throttle and what the server's `RateLimit` fields said. Keep a clone to read
/// [`counters`](Self::counters) after handing one to the middleware.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy, classify::Retryable};
///
/// let payments = Dependency::new("payments", RetryPolicy::default())
///     .with_budget(RetryBudget::aws_like());
/// // A second client of the same service shares the budget: it is a clone of the dependency.
/// let inventory = Dependency::new(
///     "inventory",
///     RetryPolicy::builder().max_attempts(4).deadline(Duration::from_secs(5)).build()?,
/// )
/// .with_classifier(|attempt| match attempt.status() {
///     // This service answers 500 while a node restarts.
///     Some(status) if status.as_u16() == 500 => Retryable::Transient,
///     _ => attempt.default_verdict(),
/// });
/// let middleware = RetryMiddleware::new(payments.clone())
///     .route("inventory.internal", inventory.clone())?;
/// assert_eq!(payments.counters().requests, 0);
/// # drop(middleware);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone)]
pub struct Dependency {
    pub(crate) name: Arc<str>,
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) counters: RetryCounters,
    pub(crate) metric_keys: MetricKeys,
    pub(crate) classifier: Option<Shared<dyn Classifier>>,
    pub(crate) throttle: Option<AdaptiveThrottle>,
    pub(crate) keys: Option<IdempotencyKeys>,
    /// What the dependency's `RateLimit` fields last said; clones share it.
    pub(crate) quota: Arc<QuotaState>,
    /// The attempt number and time-left headers, if any are sent.
    pub(crate) attempt_headers: AttemptHeaders,
    /// What the dependency's attempts take, when its policy measures it; clones share it.
    pub(crate) latency: Option<Arc<LatencyWindow>>,
    /// The rules its requests are judged and scheduled by: HTTP's, or those of the protocol
    /// the door that made it speaks (`engine::rules`).
    pub(crate) rules: Arc<dyn Rules>,
}

impl From<RetryPolicy> for Dependency {
    /// A dependency named `default` with `policy`, as [`Dependency::new`] makes it: so that
    /// [`RetryMiddleware::new`](crate::RetryMiddleware::new) takes a policy alone.
    fn from(policy: RetryPolicy) -> Self {
        Dependency::new("default", policy)
    }
}

impl Dependency {
    /// A dependency named `name` with `policy`, a new default budget ([`RetryBudget::default()`])
    /// of its own, new counters, the default idempotency keys ([`IdempotencyKeys::default()`]:
    /// a random UUID on each POST and PATCH), no classifier and no throttle.
    pub fn new(name: &str, policy: RetryPolicy) -> Self {
        Dependency {
            name: Arc::from(name),
            policy,
            budget: Some(RetryBudget::default()),
            counters: RetryCounters::new(),
            metric_keys: MetricKeys::new(name),
            classifier: None,
            throttle: None,
            keys: Some(IdempotencyKeys::default()),
            quota: Arc::default(),
            attempt_headers: AttemptHeaders::default(),
            latency: policy
                .measures_latency()
                .then(|| Arc::new(LatencyWindow::new(&policy))),
            rules: Arc::new(Http),
        }
    }

    /// Draws this dependency's retries from `budget`. Pass clones of one budget to dependencies
    /// that call the same service through different names, so their retries share one account.
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Retries without a budget: only the attempt limit and the deadline bound them, so during
    /// an outage every request makes all its attempts. For a dependency whose load you own.
    pub fn without_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// Decides which of this dependency's outcomes are transient with `classify` instead of the
    /// default rules. It answers only whether a failure may go differently next time:
    /// [`Attempt::default_verdict`] is what the default rules say, to return for every case it
    /// has no rule of its own for.
    ///
    /// The default rules call a timeout, a host name that could not be resolved, a refused or
    /// reset connection, a response cut short, and a status in the policy's set (408, 429, 502,
    /// 503, 504 by default; 409 under a key sent before) transient, and everything else final. Whether
    /// repeating is *safe* stays the middleware's rule, and a classifier cannot loosen it: a
    /// request that is neither idempotent nor keyed is repeated only when nothing of it reached
    /// the server, however loudly `classify` says "transient". The attempt limit, the deadline,
    /// `Retry-After` and the budget apply as always. It runs once per attempt, on the request's
    /// task: keep it quick. With the policy's `buffer_body`, it runs after the answer's body was
    /// read and sees it ([`Attempt::body`]); without it, it sees the head alone.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, RetryPolicy, classify::Retryable};
    ///
    /// // 503s from the report endpoint are final (it sheds load for minutes); 500s from the
    /// // search endpoint are transient; the default rules for everything else.
    /// let api = Dependency::new("api", RetryPolicy::default()).with_classifier(|attempt| {
    ///     match (attempt.uri().path(), attempt.status().map(|s| s.as_u16())) {
    ///         ("/reports", Some(503)) => Retryable::Fatal,
    ///         ("/search", Some(500)) => Retryable::Transient,
    ///         _ => attempt.default_verdict(),
    ///     }
    /// });
    /// # drop(api);
    /// ```
    pub fn with_classifier<F>(mut self, classify: F) -> Self
    where
        F: Fn(&Attempt<'_>) -> Retryable + Send + Sync + 'static,
    {
        self.classifier = Some(Shared(Arc::new(crate::engine::classifier::Hook {
            classify,
            told: std::sync::atomic::AtomicBool::new(false),
        })));
        self
    }

    /// Throttles this dependency's attempts with `throttle` (pass a clone to share one account
    /// between dependencies); see [`AdaptiveThrottle`]. Off by default.
    pub fn with_throttle(mut self, throttle: AdaptiveThrottle) -> Self {
        self.throttle = Some(throttle);
        self
    }

    /// Stamps and recognises this dependency's idempotency keys as `keys` says: another header
    /// name, the quoted form, other methods, your own key source.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, IdempotencyKeys, RetryPolicy};
    ///
    /// let keys = IdempotencyKeys::builder().header_name("X-Request-Key").build()?;
    /// let payments = Dependency::new("payments", RetryPolicy::default()).with_idempotency_keys(keys)?;
    /// # drop(payments);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when the keys' header is already the dependency's attempt or deadline
    /// header ([`with_attempt_header`](Self::with_attempt_header),
    /// [`with_deadline_header`](Self::with_deadline_header)): the attempt's number or the time
    /// left would replace the key on every attempt, so each would carry a key of its own. Give
    /// each header its own name, in whichever order the setters come.
    pub fn with_idempotency_keys(mut self, keys: IdempotencyKeys) -> Result<Self, InvalidConfig> {
        let name = keys.header_name();
        let clash = [
            ("attempt", self.attempt_headers.attempt.as_ref()),
            ("deadline", self.attempt_headers.deadline.as_ref()),
        ]
        .into_iter()
        .find(|(_, taken)| *taken == Some(name));
        if let Some((what, _)) = clash {
            return Err(InvalidConfig::new(
                "attempt headers",
                format!(
                    "idempotency key header {:?} is already the dependency's {what} header: \
                     give each its own name",
                    name.as_str()
                ),
            ));
        }
        self.keys = Some(keys);
        Ok(self)
    }

    /// Neither stamps nor looks for idempotency keys, for a server that refuses unknown
    /// headers: whether a request may be repeated then depends on its method alone, so POST and
    /// PATCH are retried only when nothing of them was sent.
    pub fn without_idempotency_keys(mut self) -> Self {
        self.keys = None;
        self
    }

    /// Sends the attempt's number (`1`, `2`, `3`...) in the header `name` on every attempt, so
    /// the server can tell a retry from a first attempt: to count retries, or to turn them away
    /// first when it is overloaded. Servers use their own names for it (`x-envoy-attempt-count`,
    /// `gccl-attempt-count`, `x-stainless-retry-count` counts from 0); pick the one yours reads.
    /// Off by default. The value replaces a header of the same name the caller set.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, RetryPolicy};
    ///
    /// let search = Dependency::new("search", RetryPolicy::default())
    ///     .with_attempt_header("x-attempt")?
    ///     .with_deadline_header("x-deadline-ms")?;
    /// # drop(search);
    /// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
    /// ```
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a valid header name, is a standard field
    /// (`Content-Type`, `Authorization`...), or is the name of the dependency's idempotency key
    /// or deadline header.
    pub fn with_attempt_header(mut self, name: &str) -> Result<Self, InvalidConfig> {
        let taken = [self.key_header(), self.attempt_headers.deadline.as_ref()];
        self.attempt_headers.attempt = Some(attempt_headers::header_name("attempt", name, &taken)?);
        Ok(self)
    }

    /// Sends, in the header `name` on every attempt, the whole milliseconds left before the
    /// request's deadline when the attempt is sent (`29950`), so the server can drop work the
    /// client will have given up on, as Envoy's `x-envoy-expected-rq-timeout-ms` does. It
    /// decreases from the deadline across attempts; an attempt's own timeout may end it
    /// sooner. Off by default. The value replaces a header of the same name the caller set.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] when `name` is not a valid header name, is a standard field, or is the
    /// name of the dependency's idempotency key or attempt header.
    pub fn with_deadline_header(mut self, name: &str) -> Result<Self, InvalidConfig> {
        let taken = [self.key_header(), self.attempt_headers.attempt.as_ref()];
        self.attempt_headers.deadline =
            Some(attempt_headers::header_name("deadline", name, &taken)?);
        Ok(self)
    }

    fn key_header(&self) -> Option<&http::HeaderName> {
        self.keys.as_ref().map(IdempotencyKeys::header_name)
    }

    /// The name used in counters, metrics and logs.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The budget, if any: its [`balance`](RetryBudget::balance) shows how much retrying is left.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// The adaptive throttle, if any.
    pub fn throttle(&self) -> Option<&AdaptiveThrottle> {
        self.throttle.as_ref()
    }

    /// The counts so far of every request through this dependency and its clones: requests,
    /// attempts, retries, budget refusals and the rest. With the `metrics` feature the same
    /// counts also go to the `metrics` facade.
    pub fn counters(&self) -> CounterSnapshot {
        self.counters.snapshot()
    }

    /// What the decision core keeps for this dependency's requests.
    pub(crate) fn accounts(&self) -> Accounts<'_> {
        Accounts {
            budget: self.budget.as_ref(),
            counters: &self.counters,
            metric_keys: &self.metric_keys,
            throttle: self.throttle.as_ref(),
            quota: &self.quota,
            latency: self.latency.as_deref(),
            rules: &*self.rules,
        }
    }
}

/// The dependencies of one middleware: the default, and others by host, tried in the order they
/// were added.
#[derive(Debug, Clone)]
pub(crate) struct Routes {
    default: Dependency,
    routes: Vec<(HostMatch, Dependency)>,
    /// By the request's path, before any host (the gRPC door's methods): a method's, else its
    /// service's, found by name in time independent of their number.
    #[cfg(feature = "grpc")]
    paths: PathTable<Dependency>,
}

impl Routes {
    pub(crate) fn new(default: Dependency) -> Self {
        Routes {
            default,
            routes: Vec::new(),
            #[cfg(feature = "grpc")]
            paths: PathTable::default(),
        }
    }

    /// The dependency named `name`, if one is.
    #[cfg(feature = "grpc")]
    pub(crate) fn named(&self, name: &str) -> Option<&Dependency> {
        let routed = self.routes.iter().map(|(_, d)| d);
        std::iter::once(&self.default)
            .chain(routed)
            .chain(self.paths.values())
            .find(|d| &*d.name == name)
    }

    /// Every dependency, to change: the default, those by host, those by path.
    #[cfg(feature = "grpc")]
    pub(crate) fn each_mut(&mut self, mut change: impl FnMut(&mut Dependency)) {
        change(&mut self.default);
        self.routes.iter_mut().for_each(|(_, d)| change(d));
        self.paths.values_mut().for_each(change);
    }

    /// Sends the calls of `service`'s `method` (or of every method of `service`) through
    /// `dependency`, before any host route.
    #[cfg(feature = "grpc")]
    pub(crate) fn add_path(&mut self, service: &str, method: Option<&str>, dependency: Dependency) {
        self.paths.insert(service, method, dependency);
    }

    /// Sends requests to `host` through `dependency`; see
    /// [`RetryMiddleware::route`](crate::RetryMiddleware::route).
    pub(crate) fn add(&mut self, host: &str, dependency: Dependency) -> Result<(), InvalidConfig> {
        self.routes.push((HostMatch::parse(host)?, dependency));
        Ok(())
    }

    /// The dependency a request to `to` goes through (its target is read only when there
    /// are routes).
    pub(crate) fn pick<'p>(&self, to: &dyn Locate, path: impl FnOnce() -> &'p str) -> &Dependency {
        #[cfg(feature = "grpc")]
        if !self.paths.is_empty() {
            if let Some(dependency) = self.paths.get(path()) {
                return dependency;
            }
        }
        #[cfg(not(feature = "grpc"))]
        let _ = path;
        if self.routes.is_empty() {
            return &self.default;
        }
        let target = to.target();
        self.routes
            .iter()
            .find(|(host, _)| host.matches(target))
            .map_or(&self.default, |(_, dependency)| dependency)
    }
}

/// Which requests a routed dependency serves: a host, and optionally a port.
#[derive(Debug, Clone)]
pub(crate) struct HostMatch {
    host: String,
    port: Option<u16>,
}

impl HostMatch {
    /// Reads `host` or `host:port` (`[v6]` or `[v6]:port` for IPv6), or says what is wrong.
    pub(crate) fn parse(spec: &str) -> Result<HostMatch, InvalidConfig> {
        let invalid = |why: String| InvalidConfig::new("route", why);
        let spec = spec.trim().to_ascii_lowercase();
        if let Some((_, rest)) = spec.split_once("://") {
            let host = rest.split(['/', '?', '#']).next().unwrap_or("");
            return Err(invalid(format!(
                "{spec:?} is a URL, not a host: route by its host and port, \"{host}\""
            )));
        }
        let (host, port) = match spec.rsplit_once(':') {
            // A colon inside brackets belongs to an IPv6 address, not to a port.
            Some((host, port)) if !host.contains(':') || host.ends_with(']') => {
                let port = port.parse::<u16>().map_err(|_| {
                    invalid(format!(
                        "{spec:?} has no valid port after ':': write \"host\" or \"host:port\" \
                         with a port from 0 to 65535"
                    ))
                })?;
                (host, Some(port))
            }
            _ => (spec.as_str(), None),
        };
        let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
        let name = !host.is_empty()
            && host
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.');
        let v6 = bracketed
            && host[1..host.len() - 1]
                .parse::<std::net::Ipv6Addr>()
                .is_ok();
        if !(name || v6) {
            return Err(invalid(format!(
                "{spec:?} is not a host: write a name or address such as \"api.example.com\", \
                 \"127.0.0.1:8080\" or \"[::1]:8080\""
            )));
        }
        Ok(HostMatch {
            host: host.to_owned(),
            port,
        })
    }

    pub(crate) fn matches(&self, target: Target<'_>) -> bool {
        target.host.eq_ignore_ascii_case(&self.host)
            && self.port.is_none_or(|p| target.port == Some(p))
    }
}

/// A per-request change of retry behaviour, set in the request's extensions: one value that
/// says everything this call changes, each setting over the dependency's policy, the rest kept.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::RetryOverride;
///
/// // One call that must not be repeated, whatever the policy says. It goes in the request's
/// // extensions: `.with_extension(..)` on a reqwest-middleware request, `.extension(..)` on
/// // an `http::Request` for the tower layer.
/// let once = RetryOverride::new().no_retries();
/// let report = http::Request::get("http://127.0.0.1:8080/once").extension(once).body(())?;
///
/// // One call that may try harder and longer than the dependency's policy says.
/// let patient = RetryOverride::new()
///     .max_attempts(6)
///     .deadline(Duration::from_secs(60));
/// let long = http::Request::get("http://127.0.0.1:8080/report").extension(patient).body(())?;
/// # drop((report, long));
/// # Ok::<(), http::Error>(())
/// ```
///
/// A request carries at most one (extensions hold one value per type: a second
/// `with_extension` replaces the first), so say everything in one. An override is checked
/// before anything is sent: one that contradicts itself (`no_retries` with `max_attempts` other
/// than 1) or makes the policy invalid (0 attempts, an attempt timeout under a millisecond)
/// fails the request with [`StopReason::InvalidOverride`](crate::StopReason::InvalidOverride)
/// and a message that names the setting and says what to change. A deadline never fails a call
/// (see [`deadline`](Self::deadline)).
///
/// Only this type is read from a request's extensions. A [`RetryPolicy`], a
/// [`RetryPolicyBuilder`](crate::RetryPolicyBuilder), a [`Dependency`], a [`RetryBudget`] or
/// [`IdempotencyKeys`] put there fails the request before sending, with
/// [`StopReason::InvalidOverride`](crate::StopReason::InvalidOverride) and a message that says
/// to use this type (or a dependency of its own), rather than being ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RetryOverride {
    no_retries: bool,
    max_attempts: Option<u32>,
    deadline: Option<Duration>,
    attempt_timeout: Option<Duration>,
}

impl RetryOverride {
    /// An override that changes nothing yet: the dependency's policy as it is.
    pub const fn new() -> Self {
        RetryOverride {
            no_retries: false,
            max_attempts: None,
            deadline: None,
            attempt_timeout: None,
        }
    }

    /// Send once, with the dependency's timeouts; never retry (nor hedge). The record and the
    /// error say [`StopReason::RetriesDisabled`](crate::StopReason::RetriesDisabled), so a log
    /// tells a call that must not be repeated from one whose attempts ran out. The same as
    /// `max_attempts(1)` in every other way; with another `max_attempts` it is a contradiction,
    /// refused before sending.
    ///
    /// A POST or PATCH sent this way still gets an idempotency key stamped: the one copy may
    /// be sent again later by the caller (or a queue), and the server dedupes on the key. A
    /// request that must carry none goes through a dependency without keys
    /// ([`Dependency::without_idempotency_keys`]).
    pub const fn no_retries(mut self) -> Self {
        self.no_retries = true;
        self
    }

    /// At most this many attempts, the first included (at least 1; 0 stops the request before
    /// sending with [`StopReason::InvalidOverride`](crate::StopReason::InvalidOverride)).
    pub const fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// This total deadline instead of the policy's, from the call to `send()`, and everything
    /// that follows from it: the attempt timeouts are cut to what it leaves, and a
    /// `max_retry_after` left to follow the deadline (the default) follows this one; one set
    /// apart from the deadline is kept, lowered to this deadline if it is above it.
    ///
    /// It never fails a call. A deadline under a millisecond is a millisecond. One no longer
    /// than the policy's `base_delay` leaves no room for a retry's wait: the request makes one
    /// attempt, and if that attempt fails in a way that would have been retried, the record and
    /// the error say [`StopReason::DeadlineReached`](crate::StopReason::DeadlineReached) (the
    /// deadline is what ended it), and the `deadline_stops` counter counts it. On a gRPC
    /// call through `GrpcRetryLayer` (feature `grpc`) the deadline is the call's,
    /// if shorter than its `grpc-timeout` (which then tells the server this one), and its
    /// waits are cut at it instead: the call ends there `DEADLINE_EXCEEDED`, as gRPC's do.
    pub const fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = Some(deadline);
        self
    }

    /// The deadline this override sets, if it sets one.
    #[cfg(feature = "grpc")]
    pub(crate) fn deadline_set(&self) -> Option<Duration> {
        self.deadline
    }

    /// The attempts this override sets, if it sets them.
    #[cfg(feature = "grpc")]
    pub(crate) fn attempts_set(&self) -> Option<u32> {
        self.max_attempts
    }

    /// This per-attempt timeout instead of the policy's (at least 1 ms), still cut to what the
    /// deadline leaves. It is the request's own word: on a dependency that takes its timeout
    /// from measured latency ([`RetryPolicyBuilder::timeout_from_latency`](crate::RetryPolicyBuilder::timeout_from_latency)),
    /// this request's attempts get exactly this timeout, not the measured one.
    pub const fn attempt_timeout(mut self, timeout: Duration) -> Self {
        self.attempt_timeout = Some(timeout);
        self
    }

    /// The override a request carries in its `extensions`, for its `dependency`: the policy it
    /// runs under (`None`: the dependency's), what caps its attempts, and the error that
    /// refuses it when the override is invalid.
    #[inline]
    pub(crate) fn of_request(
        extensions: &http::Extensions,
        dependency: &Dependency,
    ) -> (Option<Box<RetryPolicy>>, Cap, Option<InvalidConfig>) {
        match Self::plan(extensions, (&dependency.policy, &*dependency.rules)) {
            Ok((policy, cap)) => (policy, cap, None),
            Err(invalid) => (None, Cap::Policy, Some(invalid)),
        }
    }

    /// The plan of a request with these `extensions` under its dependency's `policy` and
    /// `rules`: the policy it runs under (`None`: the dependency's own), and what caps its
    /// attempts. The policy is boxed: the requests without an override, nearly all, do not
    /// carry room for one.
    #[inline]
    pub(crate) fn plan(
        extensions: &http::Extensions,
        of: (&RetryPolicy, &dyn Rules),
    ) -> Result<(Option<Box<RetryPolicy>>, Cap), InvalidConfig> {
        if extensions.is_empty() {
            return Ok((None, Cap::Policy));
        }
        Self::planned(extensions, of)
    }

    fn planned(
        extensions: &http::Extensions,
        (policy, rules): (&RetryPolicy, &dyn Rules),
    ) -> Result<(Option<Box<RetryPolicy>>, Cap), InvalidConfig> {
        misplaced(extensions)?;
        match extensions.get::<RetryOverride>() {
            None => Ok((None, Cap::Policy)),
            Some(over) => over
                .policy(policy, rules)
                .map(|(changed, cap)| (changed.map(Box::new), cap)),
        }
    }

    /// The policy a request with this override runs under, from its dependency's `policy`
    /// (`None`: unchanged), and what caps its attempts.
    pub(crate) fn policy(
        &self,
        policy: &RetryPolicy,
        rules: &dyn Rules,
    ) -> Result<(Option<RetryPolicy>, Cap), InvalidConfig> {
        let refuse = |message: String| InvalidConfig::new("retry override", message);
        if let (true, Some(attempts @ (0 | 2..))) = (self.no_retries, self.max_attempts) {
            return Err(refuse(format!(
                "no_retries() and max_attempts({attempts}) contradict each other: keep one"
            )));
        }
        if self.max_attempts == Some(0) {
            return Err(refuse(
                "max_attempts(0) leaves no attempt: use at least 1 (1 sends once)".to_owned(),
            ));
        }
        let mut cap = if self.no_retries {
            Cap::NoRetries
        } else {
            Cap::Policy
        };
        // `no_retries` is one attempt, which the decider enforces: the policy changes only
        // for what else is said.
        let attempts = self.max_attempts.filter(|_| !self.no_retries);
        if attempts.is_none() && self.deadline.is_none() && self.attempt_timeout.is_none() {
            return Ok((None, cap));
        }
        let mut changed = policy.to_builder();
        if self.no_retries {
            changed = changed.max_attempts(1);
        }
        if let Some(attempts) = attempts {
            changed = changed.max_attempts(attempts);
        }
        let attempts = attempts.unwrap_or(policy.max_attempts());
        let mut new_deadline = None;
        if let Some(deadline) = self.deadline {
            // Rules that wait out to the deadline (gRPC's) keep the attempts: A6 sends some
            // copies at once (a transparent retry, the next hedge after a non-fatal failure),
            // and a wait that would cross the deadline is waited to it (`Decider::schedule`).
            let waits_cut = rules.waits_out_the_deadline();
            if !waits_cut && policy.base_delay() >= deadline && attempts > 1 && !self.no_retries {
                changed = changed.max_attempts(1);
                cap = Cap::Deadline;
            }
            new_deadline = Some(deadline);
        }
        if let Some(timeout) = self.attempt_timeout {
            // The request's own word: the measured limit, the dependency's guess, gives way.
            changed = changed
                .attempt_timeout(timeout)
                .without_timeout_from_latency();
        }
        let mut changed = changed
            .build()
            .map_err(|e| refuse(format!("{}: {}", self.said(), e.message())))?;
        if let Some(deadline) = new_deadline {
            // Set on the policy built: the rule above decided what a deadline shorter than
            // the backoff leaves.
            changed = changed.with_deadline(deadline);
        }
        Ok((Some(changed), cap))
    }

    /// What this override says, as it was written: `max_attempts(6).deadline(60s)`.
    fn said(&self) -> String {
        let mut said = Vec::new();
        if self.no_retries {
            said.push("no_retries()".to_owned());
        }
        if let Some(attempts) = self.max_attempts {
            said.push(format!("max_attempts({attempts})"));
        }
        if let Some(deadline) = self.deadline {
            said.push(format!("deadline({deadline:?})"));
        }
        if let Some(timeout) = self.attempt_timeout {
            said.push(format!("attempt_timeout({timeout:?})"));
        }
        said.join(".")
    }
}

/// A value of this crate's own in a request's extensions that is not read there: refused, so
/// that a setting the caller meant is never silently ignored.
fn misplaced(extensions: &http::Extensions) -> Result<(), InvalidConfig> {
    let found = if extensions.get::<RetryPolicy>().is_some() {
        "a RetryPolicy"
    } else if extensions
        .get::<crate::engine::policy::RetryPolicyBuilder>()
        .is_some()
    {
        "a RetryPolicyBuilder"
    } else if extensions.get::<Dependency>().is_some() {
        "a Dependency"
    } else if extensions.get::<RetryBudget>().is_some() {
        "a RetryBudget"
    } else if extensions.get::<IdempotencyKeys>().is_some() {
        "an IdempotencyKeys"
    } else {
        return Ok(());
    };
    Err(InvalidConfig::new(
        "retry override",
        format!(
            "{found} in a request's extensions is not read: say what this request changes with \
             a RetryOverride (RetryOverride::new().max_attempts(6).deadline(..)), or send it \
             through a Dependency of its own (RetryMiddleware::route)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_dependency_whose_policy_measures_latency_keeps_a_window() {
        let ms = Duration::from_millis;
        assert!(
            Dependency::new("a", RetryPolicy::default())
                .latency
                .is_none()
        );
        let timeouts = RetryPolicy::builder().timeout_from_latency(2.0, ms(5));
        let hedges = RetryPolicy::builder().hedge_reads(0.05, ms(50));
        for measuring in [timeouts, hedges] {
            let dependency = Dependency::new("b", measuring.build().unwrap());
            assert!(dependency.latency.is_some());
            // Clones share it.
            let clone = dependency.clone();
            assert!(std::sync::Arc::ptr_eq(
                dependency.latency.as_ref().unwrap(),
                clone.latency.as_ref().unwrap()
            ));
        }
    }

    /// The target of the absolute URI `s`, as a door makes it.
    fn url(s: &str) -> Target<'static> {
        let uri: &'static http::Uri = Box::leak(Box::new(s.parse().unwrap()));
        Target::new(
            uri.scheme_str().unwrap(),
            uri.host().unwrap(),
            uri.port_u16(),
        )
    }

    #[test]
    fn a_dependency_gives_back_what_it_was_built_with_and_its_clones_share_the_counts() {
        let policy = RetryPolicy::builder().max_attempts(5).build().unwrap();
        let budget = RetryBudget::aws_like();
        let dependency = Dependency::new("payments", policy).with_budget(budget.clone());
        assert_eq!(dependency.name(), "payments");
        assert_eq!(*dependency.policy(), policy);
        assert!(dependency.budget().unwrap().same_bucket(&budget));
        let clone = dependency.clone();
        clone.counters.add(
            crate::observe::Count::Request,
            &MetricKeys::new("payments"),
            None,
        );
        assert_eq!(dependency.counters().requests, 1, "the same counters");
        assert!(dependency.clone().without_budget().budget().is_none());
        assert!(dependency.throttle().is_none());
        assert!(dependency.keys.is_some(), "keys by default");
        assert!(dependency.clone().without_idempotency_keys().keys.is_none());
        let throttle = AdaptiveThrottle::builder().build().unwrap();
        let throttled = dependency.with_throttle(throttle.clone());
        assert!(throttled.throttle().unwrap().same_account(&throttle));
        let fresh = Dependency::new("x", policy);
        assert!(fresh.budget().is_some(), "a budget of its own");
        assert!(!fresh.budget().unwrap().same_bucket(&budget));
        let from_policy = Dependency::from(policy);
        assert_eq!(
            (from_policy.name(), *from_policy.policy()),
            ("default", policy)
        );
    }

    #[test]
    fn requests_go_to_the_first_matching_route_or_the_default() {
        let policy = RetryPolicy::default();
        let payments = Dependency::new("payments", policy);
        let mut routes = Routes::new(payments.clone());
        routes
            .add("api.example.com", Dependency::new("api", policy))
            .unwrap();
        routes
            .add("api.example.com:8080", Dependency::new("later", policy))
            .unwrap();
        routes
            .add("127.0.0.1:9000", Dependency::new("local", policy))
            .unwrap();
        let pick = |s: &str| routes.pick(&url(s), || "/").name().to_owned();
        assert_eq!(pick("http://unrouted.example/"), "payments");
        assert_eq!(
            pick("http://API.example.com:8080/x"),
            "api",
            "the first match wins"
        );
        assert_eq!(pick("http://127.0.0.1:9000/"), "local");
        assert_eq!(pick("http://127.0.0.1:9001/"), "payments");
        let unrouted = routes.pick(&url("http://unrouted.example/"), || "/");
        unrouted
            .counters
            .add(crate::observe::Count::Request, &unrouted.metric_keys, None);
        assert_eq!(
            payments.counters().requests,
            1,
            "the dependency given, shared"
        );
        assert!(routes.add("http://x.example", payments).is_err());
    }

    /// Issue 64, defect 3: a gRPC call's deadline shorter than its backoff leaves its attempts
    /// as they are (A6 sends some copies at once; its waits are cut at the deadline), where an
    /// HTTP request's means one attempt.
    #[cfg(feature = "grpc")]
    #[test]
    fn a_grpc_call_s_short_deadline_keeps_its_attempts() {
        let ms = Duration::from_millis;
        let grpc = crate::engine::grpc::config::GrpcRetryPolicy::builder()
            .max_attempts(4)
            .initial_backoff(ms(100))
            .max_backoff(ms(1000))
            .retryable_codes([14])
            .build()
            .unwrap()
            .to_policy();
        for deadline in [ms(1), ms(50), ms(100)] {
            let over = RetryOverride::new().deadline(deadline);
            let (changed, cap) = over.policy(&grpc.0, &grpc.1).unwrap();
            let changed = changed.expect("the deadline changes the policy");
            assert_eq!(cap, Cap::Policy, "{deadline:?}");
            assert_eq!((changed.max_attempts(), changed.deadline()), (4, deadline));
            let http = RetryPolicy::default();
            assert_eq!(
                over.policy(&http, &Http).unwrap().1,
                Cap::Deadline,
                "{deadline:?}"
            );
        }
    }

    #[test]
    fn its_debug_names_the_classifier_without_asking_one_of_the_user_s_type() {
        let plain = Dependency::new("api", RetryPolicy::default());
        assert!(
            format!("{plain:?}").contains("classifier: None"),
            "{plain:?}"
        );
        let hooked = plain.with_classifier(|a| a.default_verdict());
        let debug = format!("{hooked:?}");
        assert!(debug.contains("classifier: Some(Classifier)"), "{debug}");
    }

    #[test]
    fn a_deadline_override_never_fails_and_too_short_a_one_means_one_attempt() {
        let ms = Duration::from_millis;
        let policy = RetryPolicy::default(); // base 100 ms, 3 attempts
        let of = |d| {
            RetryOverride::new()
                .deadline(d)
                .policy(&policy, &Http)
                .unwrap()
        };
        for (deadline, effective, attempts, cap) in [
            (Duration::ZERO, ms(1), 1, Cap::Deadline),
            (ms(1), ms(1), 1, Cap::Deadline),
            (ms(100), ms(100), 1, Cap::Deadline),
            (ms(101), ms(101), 3, Cap::Policy),
        ] {
            let (overridden, got) = of(deadline);
            let overridden = overridden.unwrap();
            assert_eq!(
                (overridden.deadline(), overridden.max_attempts(), got),
                (effective, attempts, cap),
                "{deadline:?}"
            );
            assert_eq!(
                overridden.max_retry_after(),
                effective,
                "follows the deadline"
            );
            assert_eq!(overridden.base_delay(), policy.base_delay());
        }
        // One attempt by the caller's own choice is not the deadline's doing.
        let (_, cap) = RetryOverride::new()
            .max_attempts(1)
            .deadline(ms(50))
            .policy(&policy, &Http)
            .unwrap();
        assert_eq!(cap, Cap::Policy);
        let (_, cap) = RetryOverride::new()
            .no_retries()
            .deadline(ms(50))
            .policy(&policy, &Http)
            .unwrap();
        assert_eq!(cap, Cap::NoRetries);
    }

    #[test]
    fn a_deadline_override_moves_a_following_max_retry_after_and_cuts_a_set_one() {
        let secs = Duration::from_secs;
        let of = |d, p: &RetryPolicy| {
            RetryOverride::new()
                .deadline(d)
                .policy(p, &Http)
                .unwrap()
                .0
                .unwrap()
        };
        let moved = of(secs(120), &RetryPolicy::default());
        assert_eq!(
            (moved.deadline(), moved.max_retry_after()),
            (secs(120), secs(120))
        );
        let set = RetryPolicy::builder()
            .max_retry_after(secs(20))
            .build()
            .unwrap();
        assert_eq!(of(secs(120), &set).max_retry_after(), secs(20), "kept");
        assert_eq!(
            of(secs(10), &set).max_retry_after(),
            secs(10),
            "cut to the deadline"
        );
    }

    #[test]
    fn settings_combine_and_a_contradiction_or_an_invalid_one_is_named() {
        let secs = Duration::from_secs;
        let policy = RetryPolicy::default();
        let measured = RetryPolicy::builder()
            .timeout_from_latency(2.0, Duration::from_millis(20))
            .build()
            .unwrap();
        let (combined, cap) = RetryOverride::new()
            .max_attempts(6)
            .deadline(secs(60))
            .attempt_timeout(secs(2))
            .policy(&policy, &Http)
            .unwrap();
        let combined = combined.unwrap();
        assert_eq!(
            (
                combined.max_attempts(),
                combined.deadline(),
                combined.attempt_timeout(),
                cap
            ),
            (6, secs(60), secs(2), Cap::Policy)
        );
        assert_eq!(combined.base_delay(), policy.base_delay(), "the rest kept");
        assert_eq!(
            RetryOverride::new().policy(&policy, &Http).unwrap(),
            (None, Cap::Policy),
            "nothing to change: the dependency's own policy"
        );
        assert_eq!(
            RetryOverride::new()
                .no_retries()
                .max_attempts(1)
                .policy(&policy, &Http)
                .unwrap(),
            (None, Cap::NoRetries)
        );
        for (over, message) in [
            (
                RetryOverride::new().no_retries().max_attempts(6),
                "invalid retry override: no_retries() and max_attempts(6) contradict each \
                 other: keep one",
            ),
            (
                RetryOverride::new().max_attempts(0).deadline(secs(5)),
                "invalid retry override: max_attempts(0) leaves no attempt: use at least 1 \
                 (1 sends once)",
            ),
            (
                RetryOverride::new().attempt_timeout(Duration::from_micros(10)),
                "invalid retry override: attempt_timeout(10µs): attempt_timeout",
            ),
        ] {
            let err = (over.policy(&policy, &Http))
                .and_then(|_| over.policy(&measured, &Http))
                .unwrap_err()
                .to_string();
            assert!(err.starts_with(message), "{err}");
        }
        // A request's own attempt timeout is its fixed timeout, under the measured limit's
        // floor too: the measured limit gives way to it.
        let own = RetryOverride::new()
            .max_attempts(4)
            .attempt_timeout(Duration::from_millis(5));
        let (changed, _) = own.policy(&measured, &Http).unwrap();
        let changed = changed.unwrap();
        assert_eq!(changed.attempt_timeout(), Duration::from_millis(5));
        assert_eq!(changed.timeout_from_latency(), None);
        assert!(measured.timeout_from_latency().is_some());
        // An override that leaves the attempt timeout alone keeps the measured limit.
        let (changed, _) = RetryOverride::new()
            .max_attempts(4)
            .policy(&measured, &Http)
            .unwrap();
        assert_eq!(
            changed.unwrap().timeout_from_latency(),
            measured.timeout_from_latency()
        );
    }

    #[test]
    fn a_host_matches_any_port_and_any_case() {
        let m = HostMatch::parse("API.example.com").unwrap();
        assert!(m.matches(url("http://api.example.com/x")));
        assert!(m.matches(url("https://api.EXAMPLE.com:8443/x")));
        assert!(!m.matches(url("http://other.example.com/x")));
    }

    #[test]
    fn a_host_with_a_port_matches_that_port_only() {
        let m = HostMatch::parse("127.0.0.1:8080").unwrap();
        assert!(m.matches(url("http://127.0.0.1:8080/")));
        assert!(!m.matches(url("http://127.0.0.1:8081/")));
        let https = HostMatch::parse("api.example.com:443").unwrap();
        assert!(https.matches(url("https://api.example.com/")));
    }

    #[test]
    fn ipv6_hosts_keep_their_colons() {
        let any_port = HostMatch::parse("[::1]").unwrap();
        assert!(any_port.matches(url("http://[::1]:9000/")));
        let one_port = HostMatch::parse("[::1]:9000").unwrap();
        assert!(one_port.matches(url("http://[::1]:9000/")));
        assert!(!one_port.matches(url("http://[::1]:9001/")));
    }

    #[test]
    fn what_is_not_a_host_is_refused_with_what_to_write() {
        let cases = [
            (
                "http://127.0.0.1:8080",
                "\"http://127.0.0.1:8080\" is a URL, not a host: route by its host and port, \"127.0.0.1:8080\"",
            ),
            (
                "https://api.example.com/v1?x=1",
                "\"https://api.example.com/v1?x=1\" is a URL, not a host: route by its host and port, \"api.example.com\"",
            ),
            (
                "api.example.com:http",
                "\"api.example.com:http\" has no valid port after ':': write \"host\" or \"host:port\" with a port from 0 to 65535",
            ),
            (
                "api.example.com:70000",
                "\"api.example.com:70000\" has no valid port after ':': write \"host\" or \"host:port\" with a port from 0 to 65535",
            ),
            (
                "api.example.com/v1",
                "\"api.example.com/v1\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
            (
                "",
                "\"\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
            (
                "[::1",
                "\"[::1\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
            (
                "[",
                "\"[\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
            (
                "[]",
                "\"[]\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
            (
                "[zz]:80",
                "\"[zz]:80\" is not a host: write a name or address such as \"api.example.com\", \"127.0.0.1:8080\" or \"[::1]:8080\"",
            ),
        ];
        for (spec, message) in cases {
            let err = HostMatch::parse(spec).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("invalid route: {message}"),
                "{spec}"
            );
        }
    }
}
