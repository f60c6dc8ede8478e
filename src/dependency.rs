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

use crate::attempt_headers::{self, AttemptHeaders};
use crate::budget::RetryBudget;
use crate::classifier::{Attempt, Classifier, Retryable};
use crate::decide::Accounts;
use crate::error::InvalidConfig;
use crate::idempotency::IdempotencyKeys;
use crate::latency::LatencyWindow;
use crate::observe::{CounterSnapshot, MetricKeys, RetryCounters};
use crate::policy::RetryPolicy;
use crate::rate_limit::QuotaState;
use crate::shared::Shared;
use crate::throttle::AdaptiveThrottle;

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
/// use reqwest_middleware::ClientBuilder;
/// use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy, Retryable};
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
/// let client = ClientBuilder::new(reqwest::Client::new()).with(middleware).build();
/// assert_eq!(payments.counters().requests, 0);
/// # drop(client);
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
    /// `Retry-After` and the budget apply as always. It runs once per attempt (with
    /// `buffer_body`, once more if reading the body fails), on the request's task: keep it quick.
    ///
    /// ```
    /// use reqwest_safe_retry::{Dependency, Retryable, RetryPolicy};
    ///
    /// // 503s from the report endpoint are final (it sheds load for minutes); 500s from the
    /// // search endpoint are transient; the default rules for everything else.
    /// let api = Dependency::new("api", RetryPolicy::default()).with_classifier(|attempt| {
    ///     match (attempt.url().path(), attempt.status().map(|s| s.as_u16())) {
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
        self.classifier = Some(Shared(Arc::new(classify)));
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
        }
    }
}

/// The dependencies of one middleware: the default, and others by host, tried in the order they
/// were added.
#[derive(Debug, Clone)]
pub(crate) struct Routes {
    default: Dependency,
    routes: Vec<(HostMatch, Dependency)>,
}

impl Routes {
    pub(crate) fn new(default: Dependency) -> Self {
        Routes {
            default,
            routes: Vec::new(),
        }
    }

    /// Sends requests to `host` through `dependency`; see
    /// [`RetryMiddleware::route`](crate::RetryMiddleware::route).
    pub(crate) fn add(&mut self, host: &str, dependency: Dependency) -> Result<(), InvalidConfig> {
        self.routes.push((HostMatch::parse(host)?, dependency));
        Ok(())
    }

    /// The dependency a request to `url` goes through.
    pub(crate) fn pick(&self, url: &reqwest::Url) -> &Dependency {
        self.routes
            .iter()
            .find(|(host, _)| host.matches(url))
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

    pub(crate) fn matches(&self, url: &reqwest::Url) -> bool {
        let host_matches = url
            .host_str()
            .is_some_and(|h| h.eq_ignore_ascii_case(&self.host));
        host_matches
            && self
                .port
                .is_none_or(|p| url.port_or_known_default() == Some(p))
    }
}

/// A per-request change of retry behaviour, set in the request's extensions.
///
/// The narrow ones change one setting of the dependency's policy and keep the rest; for more
/// than one, build a whole policy from the dependency's with
/// [`RetryPolicy::to_builder`]. A narrow override that would make the policy invalid (0
/// attempts, a deadline under the backoff base) fails the request before anything is sent,
/// with [`StopReason::InvalidOverride`](crate::StopReason::InvalidOverride) and a message that
/// says what to change.
///
/// ```
/// # async fn run(client: reqwest_middleware::ClientWithMiddleware) -> reqwest_middleware::Result<()> {
/// use reqwest_safe_retry::{RetryOverride, RetryPolicy};
///
/// // One call that must not be repeated, whatever the policy says.
/// client.get("http://127.0.0.1:8080/once").with_extension(RetryOverride::NoRetries).send().await?;
///
/// // One call that may try harder, or must finish sooner, than the dependency's policy says.
/// client.get("http://127.0.0.1:8080/report").with_extension(RetryOverride::MaxAttempts(6)).send().await?;
/// let soon = std::time::Duration::from_secs(2);
/// client.get("http://127.0.0.1:8080/quote").with_extension(RetryOverride::Deadline(soon)).send().await?;
///
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryOverride {
    /// Send once, with the dependency's timeouts; never retry. The record and the error say
    /// [`StopReason::RetriesDisabled`](crate::StopReason::RetriesDisabled), so a log tells a
    /// call that must not be repeated from one whose attempts ran out. The same as
    /// `MaxAttempts(1)` in every other way.
    NoRetries,
    /// The dependency's policy with at most this many attempts, the first included (at least
    /// 1; 0 stops the request before sending with
    /// [`StopReason::InvalidOverride`](crate::StopReason::InvalidOverride)).
    MaxAttempts(u32),
    /// The dependency's policy with this total deadline, and everything that follows from it:
    /// the attempt timeouts, and a `max_retry_after` left to follow the deadline (the default),
    /// which follows this one. A `max_retry_after` set apart from the deadline is kept, lowered
    /// to this deadline if it is above it. It never fails a call: a deadline under a
    /// millisecond is a millisecond, and one no longer than the policy's `base_delay` leaves
    /// room for no retry, so the request makes one attempt.
    Deadline(Duration),
}

impl RetryOverride {
    /// The policy a request with `over` (if any) runs under, from its dependency's `policy`,
    /// and whether it forbids retries: `None` keeps the dependency's policy.
    /// The policy is boxed: the requests without an override, nearly all, do not carry room
    /// for one.
    #[inline]
    pub(crate) fn plan(
        over: Option<&RetryOverride>,
        policy: &RetryPolicy,
    ) -> Result<(Option<Box<RetryPolicy>>, bool), InvalidConfig> {
        match over {
            None => Ok((None, false)),
            Some(RetryOverride::NoRetries) => Ok((None, true)),
            Some(over) => over.boxed(policy).map(|policy| (policy, false)),
        }
    }

    fn boxed(&self, policy: &RetryPolicy) -> Result<Option<Box<RetryPolicy>>, InvalidConfig> {
        self.policy(policy).map(|policy| policy.map(Box::new))
    }

    /// The policy a request with this override runs under, from its dependency's `policy`;
    /// `None` for [`NoRetries`](Self::NoRetries), which keeps the policy and forbids retries.
    pub(crate) fn policy(
        &self,
        policy: &RetryPolicy,
    ) -> Result<Option<RetryPolicy>, InvalidConfig> {
        let changed = match *self {
            RetryOverride::NoRetries => return Ok(None),
            RetryOverride::MaxAttempts(attempts) => policy.to_builder().max_attempts(attempts),
            RetryOverride::Deadline(deadline) => {
                let deadline = deadline.max(Duration::from_millis(1));
                let mut changed = policy.to_builder();
                // A `max_retry_after` left to follow the deadline follows the new one (the
                // builder leaves it unset); one set apart from it is kept, cut to the new
                // deadline.
                if policy.max_retry_after() != policy.deadline() {
                    changed = changed.max_retry_after(policy.max_retry_after().min(deadline));
                }
                if policy.base_delay() >= deadline {
                    changed = changed.max_attempts(1);
                }
                changed.deadline(deadline)
            }
        };
        changed
            .build()
            .map(Some)
            .map_err(|e| InvalidConfig::new("retry override", format!("{self:?}: {}", e.message())))
    }
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

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).unwrap()
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
        clone
            .counters
            .add(crate::observe::Count::Request, &MetricKeys::new("payments"));
        assert_eq!(dependency.counters().requests, 1, "the same counters");
        assert!(dependency.clone().without_budget().budget().is_none());
        assert!(dependency.throttle().is_none());
        assert!(dependency.keys.is_some(), "keys by default");
        assert!(dependency.clone().without_idempotency_keys().keys.is_none());
        let throttle = crate::AdaptiveThrottle::builder().build().unwrap();
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
        let pick = |s: &str| routes.pick(&url(s)).name().to_owned();
        assert_eq!(pick("http://unrouted.example/"), "payments");
        assert_eq!(
            pick("http://API.example.com:8080/x"),
            "api",
            "the first match wins"
        );
        assert_eq!(pick("http://127.0.0.1:9000/"), "local");
        assert_eq!(pick("http://127.0.0.1:9001/"), "payments");
        let unrouted = routes.pick(&url("http://unrouted.example/"));
        unrouted
            .counters
            .add(crate::observe::Count::Request, &unrouted.metric_keys);
        assert_eq!(
            payments.counters().requests,
            1,
            "the dependency given, shared"
        );
        assert!(routes.add("http://x.example", payments).is_err());
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
        let of = |d| RetryOverride::Deadline(d).policy(&policy).unwrap().unwrap();
        for (deadline, effective, attempts) in [
            (Duration::ZERO, ms(1), 1),
            (ms(1), ms(1), 1),
            (ms(100), ms(100), 1),
            (ms(101), ms(101), 3),
        ] {
            let overridden = of(deadline);
            assert_eq!(
                (overridden.deadline(), overridden.max_attempts()),
                (effective, attempts),
                "{deadline:?}"
            );
            assert_eq!(
                overridden.max_retry_after(),
                effective,
                "follows the deadline"
            );
            assert_eq!(overridden.base_delay(), policy.base_delay());
        }
    }

    #[test]
    fn a_deadline_override_moves_a_following_max_retry_after_and_cuts_a_set_one() {
        let secs = Duration::from_secs;
        let following = RetryPolicy::default();
        let moved = RetryOverride::Deadline(secs(120))
            .policy(&following)
            .unwrap()
            .unwrap();
        assert_eq!(
            (moved.deadline(), moved.max_retry_after()),
            (secs(120), secs(120))
        );
        let set = RetryPolicy::builder()
            .max_retry_after(secs(20))
            .build()
            .unwrap();
        let longer = RetryOverride::Deadline(secs(120))
            .policy(&set)
            .unwrap()
            .unwrap();
        assert_eq!(longer.max_retry_after(), secs(20), "kept");
        let shorter = RetryOverride::Deadline(secs(10))
            .policy(&set)
            .unwrap()
            .unwrap();
        assert_eq!(shorter.max_retry_after(), secs(10), "cut to the deadline");
    }

    #[test]
    fn a_host_matches_any_port_and_any_case() {
        let m = HostMatch::parse("API.example.com").unwrap();
        assert!(m.matches(&url("http://api.example.com/x")));
        assert!(m.matches(&url("https://api.EXAMPLE.com:8443/x")));
        assert!(!m.matches(&url("http://other.example.com/x")));
    }

    #[test]
    fn a_host_with_a_port_matches_that_port_only() {
        let m = HostMatch::parse("127.0.0.1:8080").unwrap();
        assert!(m.matches(&url("http://127.0.0.1:8080/")));
        assert!(!m.matches(&url("http://127.0.0.1:8081/")));
        let https = HostMatch::parse("api.example.com:443").unwrap();
        assert!(https.matches(&url("https://api.example.com/")));
    }

    #[test]
    fn ipv6_hosts_keep_their_colons() {
        let any_port = HostMatch::parse("[::1]").unwrap();
        assert!(any_port.matches(&url("http://[::1]:9000/")));
        let one_port = HostMatch::parse("[::1]:9000").unwrap();
        assert!(one_port.matches(&url("http://[::1]:9000/")));
        assert!(!one_port.matches(&url("http://[::1]:9001/")));
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
