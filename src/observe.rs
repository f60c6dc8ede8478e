//! What the retries are doing: counters to read or export, and a hook on every decision.
//!
//! Counters are plain relaxed atomics, one set per dependency, readable at any time with
//! [`Dependency::counters`](crate::Dependency::counters) and exportable without any extra dependency. With the `metrics`
//! feature the same counts also go to the [`metrics`](https://docs.rs/metrics) facade, which the
//! Rust exporters (Prometheus, StatsD, OpenTelemetry bridges) plug into.
//!
//! The metric names, labels and meanings are on [`CounterSnapshot`], where they render.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::fault::AttemptErrorKind;
use crate::stop::StopReason;

/// Counters for one dependency. Clones share the same counts.
#[derive(Clone, Default)]
pub(crate) struct RetryCounters {
    inner: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    attempts: AtomicU64,
    retries: AtomicU64,
    budget_refusals: AtomicU64,
    deadline_stops: AtomicU64,
    retry_after_honoured: AtomicU64,
    keys_stamped: AtomicU64,
    throttled: AtomicU64,
    hedges: AtomicU64,
    hedges_won: AtomicU64,
}

/// One dependency's counts at one moment, from [`Dependency::counters`](crate::Dependency::counters).
///
/// # As metrics (feature `metrics`)
///
/// With the `metrics` feature every count also goes to the [`metrics`](https://docs.rs/metrics)
/// facade, which Prometheus, StatsD and OpenTelemetry exporters plug into. Each metric carries
/// the label `dependency` (the [`Dependency`](crate::Dependency)'s name). A dependency's first
/// request describes every metric to the recorder installed then and registers each counter at
/// zero, so an exporter lists them all from the start, with these descriptions.
///
/// | metric | kind | field here | counts |
/// |---|---|---|---|
/// | `reqwest_safe_retry_requests_total` | counter | `requests` | logical requests (calls to `send()`) |
/// | `reqwest_safe_retry_attempts_total` | counter | `attempts` | attempts sent, first attempts included |
/// | `reqwest_safe_retry_retries_total` | counter | `retries` | retries (attempts after the first) |
/// | `reqwest_safe_retry_budget_refusals_total` | counter | `budget_refusals` | retries the budget refused |
/// | `reqwest_safe_retry_deadline_stops_total` | counter | `deadline_stops` | logical requests stopped by the deadline |
/// | `reqwest_safe_retry_retry_after_honoured_total` | counter | `retry_after_honoured` | waits that honoured a `Retry-After` floor |
/// | `reqwest_safe_retry_keys_stamped_total` | counter | `keys_stamped` | idempotency keys the middleware made (stamped or derived) |
/// | `reqwest_safe_retry_throttled_total` | counter | `throttled` | attempts the adaptive throttle rejected locally |
/// | `reqwest_safe_retry_hedges_total` | counter | `hedges` | second copies of reads sent (hedges) |
/// | `reqwest_safe_retry_hedges_won_total` | counter | `hedges_won` | hedges whose answer was the one returned |
/// | `reqwest_safe_retry_budget_balance` | gauge | ([`RetryBudget::balance`](crate::RetryBudget::balance)) | tokens in the dependency's budget, set at each request and retry (none without a budget) |
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct CounterSnapshot {
    /// Logical requests (calls to `send()`).
    pub requests: u64,
    /// Attempts sent, first attempts included.
    pub attempts: u64,
    /// Retries: attempts after the first.
    pub retries: u64,
    /// Retries the budget refused.
    pub budget_refusals: u64,
    /// Logical requests stopped by the deadline.
    pub deadline_stops: u64,
    /// Waits that honoured a server's `Retry-After` floor.
    pub retry_after_honoured: u64,
    /// Idempotency keys the middleware made for a request that was sent: stamped fresh, or
    /// derived from a [`NaturalKey`](crate::NaturalKey). Keys set by callers are not counted.
    pub keys_stamped: u64,
    /// Attempts the adaptive throttle rejected locally, first attempts and retries.
    pub throttled: u64,
    /// Second copies of reads sent (see
    /// [`RetryPolicyBuilder::hedge_reads`](crate::RetryPolicyBuilder::hedge_reads)). They are
    /// not counted in `attempts`: the dependency got `attempts + hedges` requests. Under a gRPC
    /// hedging policy (feature `grpc`), every copy is an attempt, as A6 counts them, and a
    /// retry: `hedges` counts the copies after the first, which are in `attempts` and
    /// `retries` too.
    pub hedges: u64,
    /// Hedges whose answer was the one returned (or retried after; under a gRPC hedging
    /// policy, the one the call ended with).
    pub hedges_won: u64,
}

/// What holds a balance the metrics export as a gauge: a dependency's retry budget.
pub(crate) trait Balance {
    /// The tokens in it now (read only by the `metrics` feature's gauge).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    fn balance(&self) -> f64;
}

impl RetryCounters {
    /// New counters, all zero.
    pub(crate) fn new() -> Self {
        RetryCounters::default()
    }

    /// Reads every count.
    pub(crate) fn snapshot(&self) -> CounterSnapshot {
        let c = &*self.inner;
        let read = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CounterSnapshot {
            requests: read(&c.requests),
            attempts: read(&c.attempts),
            retries: read(&c.retries),
            budget_refusals: read(&c.budget_refusals),
            deadline_stops: read(&c.deadline_stops),
            retry_after_honoured: read(&c.retry_after_honoured),
            keys_stamped: read(&c.keys_stamped),
            throttled: read(&c.throttled),
            hedges: read(&c.hedges),
            hedges_won: read(&c.hedges_won),
        }
    }
}

impl fmt::Debug for RetryCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.snapshot(), f)
    }
}

/// One count to add, for the counters and, with the feature, for `metrics`.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Count {
    Request = 0,
    Attempt = 1,
    Retry = 2,
    BudgetRefusal = 3,
    DeadlineStop = 4,
    RetryAfterHonoured = 5,
    KeyStamped = 6,
    Throttled = 7,
    Hedge = 8,
    HedgeWon = 9,
}

impl RetryCounters {
    pub(crate) fn add(&self, count: Count, keys: &MetricKeys, budget: Option<&dyn Balance>) {
        let c = &*self.inner;
        let counter = match count {
            Count::Request => &c.requests,
            Count::Attempt => &c.attempts,
            Count::Retry => &c.retries,
            Count::BudgetRefusal => &c.budget_refusals,
            Count::DeadlineStop => &c.deadline_stops,
            Count::RetryAfterHonoured => &c.retry_after_honoured,
            Count::KeyStamped => &c.keys_stamped,
            Count::Throttled => &c.throttled,
            Count::Hedge => &c.hedges,
            Count::HedgeWon => &c.hedges_won,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        keys.export(count, budget);
    }
}

/// The `metrics` counters, in [`Count`]'s order: name and description.
#[cfg(feature = "metrics")]
const COUNTERS: [(&str, &str); 10] = [
    (
        "reqwest_safe_retry_requests_total",
        "logical requests (calls to send())",
    ),
    (
        "reqwest_safe_retry_attempts_total",
        "attempts sent, first attempts included",
    ),
    (
        "reqwest_safe_retry_retries_total",
        "retries (attempts after the first)",
    ),
    (
        "reqwest_safe_retry_budget_refusals_total",
        "retries the retry budget refused",
    ),
    (
        "reqwest_safe_retry_deadline_stops_total",
        "logical requests stopped by the deadline",
    ),
    (
        "reqwest_safe_retry_retry_after_honoured_total",
        "waits that honoured a server's Retry-After floor",
    ),
    (
        "reqwest_safe_retry_keys_stamped_total",
        "idempotency keys made by the middleware (stamped or derived)",
    ),
    (
        "reqwest_safe_retry_throttled_total",
        "attempts the adaptive throttle rejected locally",
    ),
    (
        "reqwest_safe_retry_hedges_total",
        "second copies of reads sent (hedges)",
    ),
    (
        "reqwest_safe_retry_hedges_won_total",
        "hedges whose answer was the one returned",
    ),
];

/// The budget's balance gauge: name and description.
#[cfg(feature = "metrics")]
const BALANCE: (&str, &str) = (
    "reqwest_safe_retry_budget_balance",
    "tokens in the dependency's retry budget, as of its last request or retry",
);

/// The `metrics` keys of one dependency, built once so that counting allocates nothing.
#[derive(Debug, Clone)]
pub(crate) struct MetricKeys {
    #[cfg(feature = "metrics")]
    keys: Arc<Keys>,
}

#[cfg(feature = "metrics")]
#[derive(Debug)]
struct Keys {
    counters: [metrics::Key; 10],
    balance: metrics::Key,
    /// Every metric described, and every counter registered at zero, with the recorder
    /// installed when this dependency counted first.
    announced: std::sync::Once,
}

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> = metrics::Metadata::new(
    "reqwest_safe_retry",
    metrics::Level::INFO,
    Some(module_path!()),
);

impl MetricKeys {
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn new(dependency: &str) -> Self {
        #[cfg(feature = "metrics")]
        {
            let label = metrics::Label::new("dependency", dependency.to_owned());
            let key = |name: &'static str| metrics::Key::from_parts(name, vec![label.clone()]);
            MetricKeys {
                keys: Arc::new(Keys {
                    counters: COUNTERS.map(|(name, _)| key(name)),
                    balance: key(BALANCE.0),
                    announced: std::sync::Once::new(),
                }),
            }
        }
        #[cfg(not(feature = "metrics"))]
        MetricKeys {}
    }

    /// Exports `count`, and with a request or a retry the `budget`'s balance. A dependency's
    /// first count describes every metric and registers every counter at zero, so an exporter
    /// lists them all (a counter still at zero included) with what each means.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    fn export(&self, count: Count, budget: Option<&dyn Balance>) {
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|recorder| {
            let keys = &*self.keys;
            keys.announced.call_once(|| {
                for ((name, about), key) in COUNTERS.iter().zip(&keys.counters) {
                    recorder.describe_counter((*name).into(), None, (*about).into());
                    recorder.register_counter(key, &METADATA).increment(0);
                }
                recorder.describe_gauge(BALANCE.0.into(), None, BALANCE.1.into());
            });
            recorder
                .register_counter(&keys.counters[count as usize], &METADATA)
                .increment(1);
            if let (Count::Request | Count::Retry | Count::BudgetRefusal, Some(budget)) =
                (count, budget)
            {
                let gauge = recorder.register_gauge(&keys.balance, &METADATA);
                gauge.set(budget.balance());
            }
        });
    }
}

/// Which attempt of its logical request a request is, for the middleware and transport beneath
/// this one: read it with [`RetryAttempt::of`] from the extensions a `reqwest-middleware`
/// middleware is handed.
///
/// The middleware puts it in the extensions before each retry; a first attempt carries none,
/// which spares the success path an allocation, and [`of`](Self::of) reads its absence as
/// attempt 1 (which it also is for a request that no retrying middleware sent). OpenTelemetry's
/// HTTP client conventions call [`resend_count`](Self::resend_count)
/// `http.request.resend_count`; the middleware's span records it on retries too.
///
/// ```
/// use http::Extensions;
/// use reqwest_safe_retry::RetryAttempt;
///
/// // In an inner middleware's `handle`:
/// let extensions = Extensions::new();
/// let attempt = RetryAttempt::of(&extensions);
/// assert_eq!((attempt.number(), attempt.resend_count()), (1, 0));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RetryAttempt {
    pub(crate) number: u32,
}

impl RetryAttempt {
    /// The attempt the request in a middleware's `extensions` is: the one the retrying
    /// middleware put there, or the first.
    pub fn of(extensions: &http::Extensions) -> RetryAttempt {
        extensions
            .get::<RetryAttempt>()
            .copied()
            .unwrap_or(RetryAttempt { number: 1 })
    }

    /// Which attempt this is, from 1.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// How many times the request was sent before this attempt: `number() - 1`, under the name
    /// OpenTelemetry gives it (`http.request.resend_count`), for code that reports that
    /// attribute.
    pub fn resend_count(&self) -> u32 {
        self.number - 1
    }
}

/// One decision of the middleware, as the observer given to
/// [`RetryMiddleware::with_observer`](crate::RetryMiddleware::with_observer) sees it.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct RetryEvent<'a> {
    /// The dependency's name.
    pub dependency: &'a str,
    /// The request's method.
    pub method: &'a http::Method,
    /// The request's URL without its query, fragment or credentials (`scheme://host:port/path`):
    /// queries and user info often carry secrets.
    pub url: &'a str,
    /// The attempt just made, from 1.
    pub attempt: u32,
    /// Its response status, if it got a response.
    pub status: Option<u16>,
    /// Its error's kind, if it failed.
    pub error: Option<AttemptErrorKind>,
    /// The floor a transient answer set, if it set one: its valid `Retry-After` (zero for a
    /// date in the past), or the reset of a quota its `RateLimit` field says is spent, whichever
    /// is longer. `None` for an answer that is not retried.
    pub retry_after: Option<Duration>,
    /// The wait before the next attempt, if there is one, as decided (the request's total is
    /// [`RetryRecord::waited`](crate::RetryRecord::waited)).
    pub delay: Option<Duration>,
    /// Why the next attempt will not be made, if it will not.
    pub stop: Option<StopReason>,
}

/// The observer as the middleware keeps it: any `Fn(&RetryEvent<'_>)` closure; see
/// [`RetryMiddleware::with_observer`](crate::RetryMiddleware::with_observer).
pub(crate) trait Observer: Send + Sync + 'static {
    /// Called once per attempt, after the decision about the next one.
    fn on_decision(&self, event: &RetryEvent<'_>);
}

impl crate::shared::Named for dyn Observer {
    const NAME: &'static str = "Observer";
}

impl<F> Observer for F
where
    F: Fn(&RetryEvent<'_>) + Send + Sync + 'static,
{
    fn on_decision(&self, event: &RetryEvent<'_>) {
        self(event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_add_up_and_clones_share_them() {
        let counters = RetryCounters::new();
        let name = MetricKeys::new("payments");
        let clone = counters.clone();
        for _ in 0..3 {
            clone.add(Count::Attempt, &name, None);
        }
        counters.add(Count::Request, &name, None);
        counters.add(Count::KeyStamped, &name, None);
        let snap = counters.snapshot();
        assert_eq!(snap.attempts, 3);
        assert_eq!(snap.requests, 1);
        assert_eq!(snap.keys_stamped, 1);
        assert_eq!(snap.retries, 0);
        assert_eq!(
            format!("{counters:?}"),
            "CounterSnapshot { requests: 1, attempts: 3, retries: 0, budget_refusals: 0, \
             deadline_stops: 0, retry_after_honoured: 0, keys_stamped: 1, throttled: 0, \
             hedges: 0, hedges_won: 0 }"
        );
    }
}
