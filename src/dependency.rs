//! Per dependency and per request: which policy, which budget, which counters.
//!
//! A service calls several dependencies with different needs: a payment API that wants keys and
//! a long deadline, an internal cache that wants one fast retry. Each [`Dependency`] carries its
//! own policy, budget and counters. A middleware has a default dependency and may route requests
//! to others by host (and port); the usual alternative is one middleware, and one client, per
//! dependency. A [`RetryOverride`] in a request's extensions changes the policy for that call
//! alone.

use std::sync::Arc;

use crate::budget::RetryBudget;
use crate::observe::{MetricKeys, RetryCounters};
use crate::policy::RetryPolicy;

/// One dependency's retry settings: a name (for counters, metrics and traces), a policy, a
/// budget of its own unless one is shared on purpose, and counters.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::{Dependency, RetryBudget, RetryPolicy};
///
/// let cache = Dependency::new(
///     "cache",
///     RetryPolicy::builder().max_attempts(2).deadline(Duration::from_millis(300)).build()?,
/// );
/// let shared = RetryBudget::default();
/// let payments = Dependency::new("payments", RetryPolicy::default()).with_budget(shared.clone());
/// assert!(payments.budget().unwrap().same_bucket(&shared));
/// assert!(!cache.budget().unwrap().same_bucket(&shared));
/// # Ok::<(), reqwest_safe_retry::InvalidPolicy>(())
/// ```
#[derive(Debug, Clone)]
pub struct Dependency {
    pub(crate) name: Arc<str>,
    pub(crate) policy: RetryPolicy,
    pub(crate) budget: Option<RetryBudget>,
    pub(crate) counters: RetryCounters,
    pub(crate) metric_keys: MetricKeys,
}

impl Dependency {
    /// A dependency with `policy`, a new default budget ([`RetryBudget::default()`]) of its own,
    /// and new counters.
    pub fn new(name: &str, policy: RetryPolicy) -> Self {
        Dependency {
            name: Arc::from(name),
            policy,
            budget: Some(RetryBudget::default()),
            counters: RetryCounters::new(),
            metric_keys: MetricKeys::new(name),
        }
    }

    /// Draws this dependency's retries from `budget` (pass a clone to share one).
    pub fn with_budget(mut self, budget: RetryBudget) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Retries without a budget.
    pub fn without_budget(mut self) -> Self {
        self.budget = None;
        self
    }

    /// Counts into `counters` (pass a clone to keep reading them).
    pub fn with_counters(mut self, counters: RetryCounters) -> Self {
        self.counters = counters;
        self
    }

    /// The name used in counters, metrics and traces.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The policy.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// The budget, if any.
    pub fn budget(&self) -> Option<&RetryBudget> {
        self.budget.as_ref()
    }

    /// The counters; clones share the counts.
    pub fn counters(&self) -> &RetryCounters {
        &self.counters
    }
}

/// Which requests a routed dependency serves: a host, and optionally a port.
#[derive(Debug, Clone)]
pub(crate) struct HostMatch {
    host: String,
    port: Option<u16>,
}

impl HostMatch {
    /// Reads `host` or `host:port` (`[v6]:port` for IPv6).
    pub(crate) fn parse(spec: &str) -> HostMatch {
        let spec = spec.trim().to_ascii_lowercase();
        if let Some((host, port)) = spec.rsplit_once(':') {
            // A colon inside brackets belongs to an IPv6 address, not to a port.
            let is_port = !host.is_empty()
                && (!host.contains(':') || host.ends_with(']'))
                && !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit());
            if let (true, Ok(port)) = (is_port, port.parse()) {
                return HostMatch {
                    host: host.to_owned(),
                    port: Some(port),
                };
            }
        }
        HostMatch {
            host: spec,
            port: None,
        }
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
/// ```
/// # async fn run(client: reqwest_middleware::ClientWithMiddleware) -> reqwest_middleware::Result<()> {
/// use reqwest_safe_retry::{RetryOverride, RetryPolicy};
///
/// // One call that must not be repeated, whatever the policy says.
/// client.get("http://127.0.0.1:8080/once").with_extension(RetryOverride::NoRetries).send().await?;
///
/// // One call that may try harder than the dependency's policy allows.
/// let patient = RetryPolicy::builder().max_attempts(6).build().expect("a valid policy");
/// client.get("http://127.0.0.1:8080/report").with_extension(RetryOverride::Policy(patient)).send().await?;
/// # Ok(()) }
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum RetryOverride {
    /// Send once, with the dependency's timeouts; never retry.
    NoRetries,
    /// Use this policy instead of the dependency's; the dependency's budget still pays.
    Policy(RetryPolicy),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn url(s: &str) -> reqwest::Url {
        reqwest::Url::parse(s).unwrap()
    }

    #[test]
    fn a_host_matches_any_port_and_any_case() {
        let m = HostMatch::parse("API.example.com");
        assert!(m.matches(&url("http://api.example.com/x")));
        assert!(m.matches(&url("https://api.EXAMPLE.com:8443/x")));
        assert!(!m.matches(&url("http://other.example.com/x")));
    }

    #[test]
    fn a_host_with_a_port_matches_that_port_only() {
        let m = HostMatch::parse("127.0.0.1:8080");
        assert!(m.matches(&url("http://127.0.0.1:8080/")));
        assert!(!m.matches(&url("http://127.0.0.1:8081/")));
        let https = HostMatch::parse("api.example.com:443");
        assert!(https.matches(&url("https://api.example.com/")));
    }

    #[test]
    fn ipv6_hosts_keep_their_colons() {
        let any_port = HostMatch::parse("[::1]");
        assert!(any_port.matches(&url("http://[::1]:9000/")));
        let one_port = HostMatch::parse("[::1]:9000");
        assert!(one_port.matches(&url("http://[::1]:9000/")));
        assert!(!one_port.matches(&url("http://[::1]:9001/")));
    }
}
