//! What every clone of a layer and its services share: the configuration and the counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

use crate::events::EventLevels;
use crate::fingerprint::Fingerprint;
use crate::key::KeySource;
use crate::transport::Front;

pub(crate) type ScopeFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Whose keys are whose: chosen on purpose, never by default.
#[derive(Clone)]
pub(crate) enum ScopeRule {
    /// Not chosen yet: `build` refuses it.
    Unset,
    /// Every caller shares one scope.
    Shared,
    /// The caller's scope, from the request's head.
    By(Arc<ScopeFn>),
}

impl ScopeRule {
    /// The request's scope; `None` when the function finds no caller.
    pub(crate) fn of(&self, parts: &Parts) -> Option<String> {
        match self {
            ScopeRule::Unset | ScopeRule::Shared => Some(String::new()),
            ScopeRule::By(scope) => scope(parts),
        }
    }

    /// Whether every caller shares one scope, so that a replay may reach another caller.
    pub(crate) fn is_shared(&self) -> bool {
        !matches!(self, ScopeRule::By(_))
    }
}

/// The layer's settings, as the builder checked them.
pub(crate) struct Config<S> {
    pub(crate) store: S,
    pub(crate) methods: Vec<Method>,
    pub(crate) key: KeySource,
    pub(crate) require_key: bool,
    pub(crate) scope: ScopeRule,
    pub(crate) lease: Duration,
    pub(crate) in_progress_retry_after: Duration,
    pub(crate) fenced_wait: Duration,
    pub(crate) retention: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_answer_body: usize,
    pub(crate) max_key_len: usize,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) max_attempts: u32,
    pub(crate) failed_retention: Duration,
    pub(crate) not_stored: Vec<StatusCode>,
    pub(crate) saved_headers: Arc<[HeaderName]>,
    pub(crate) request_body_timeout: Duration,
    pub(crate) events: Arc<EventLevels>,
    pub(crate) counters: Arc<Counters>,
    /// How the layer's transport answers.
    pub(crate) front: Arc<dyn Front>,
}

/// What the layer has done, counted since it was built (monotonic, shared by its clones).
///
/// Each count has a tracing event beside it (see [`Event`](crate::Event)). A count is made
/// when this process sees the step end: a completion that committed while its request was
/// being dropped is in the table but not counted. The table is the record.
///
/// With the `metrics` feature every count also goes to the [`metrics`](https://docs.rs/metrics)
/// facade as a counter named `safe_retry_server_<count>_total` (`safe_retry_server_claims_total`,
/// …), each described and registered at zero when the layer is built with a recorder installed,
/// so an exporter lists them all from the start.
#[derive(Debug, Default)]
pub struct Counters {
    values: [AtomicU64; COUNTS.len()],
}

/// One of the layer's counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Count {
    Claims,
    Takeovers,
    Completions,
    Replays,
    InProgress,
    Mismatches,
    Rejections,
    Fenced,
    Refused,
    StoreFailures,
    Abandoned,
    Steps,
    Unfinished,
    Failed,
}

/// Every count in [`Count`]'s order: its name (the snapshot's field, and the metric's middle)
/// and what it counts.
const COUNTS: [(&str, &str); 14] = [
    (
        "claims",
        "claims that owned an execution (takeovers included): each ran the handler",
    ),
    (
        "takeovers",
        "claims that took over a record left in progress past its lease",
    ),
    ("completions", "answers stored with their local effects"),
    ("replays", "stored answers sent again"),
    (
        "in_progress",
        "409s: the key's first request was still running",
    ),
    ("mismatches", "422s: the key came with another request"),
    (
        "rejections",
        "answers the handler marked Rejected: nothing stored",
    ),
    (
        "fenced",
        "holders whose writes another attempt refused; rolled back",
    ),
    (
        "refused",
        "requests answered 400, 401, 408 or 413 before any claim",
    ),
    (
        "store_failures",
        "requests answered 503 (or 500) because the store or the layer failed",
    ),
    (
        "abandoned",
        "executions that ended without an outcome: their leases ended at once",
    ),
    ("steps", "recovery points committed"),
    (
        "unfinished",
        "answers that were not outcomes (a recovery point, a failure, a status not stored): leases ended at once",
    ),
    (
        "failed",
        "records started more often than allowed: ended failed",
    ),
];

/// A reading of [`Counters`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct CounterSnapshot {
    /// Claims that owned an execution (takeovers included): each ran the handler.
    pub claims: u64,
    /// Claims that took over a record left in progress past its lease.
    pub takeovers: u64,
    /// Answers stored with their local effects.
    pub completions: u64,
    /// Stored answers sent again.
    pub replays: u64,
    /// `409`s: the key's first request was still running.
    pub in_progress: u64,
    /// `422`s: the key came with another request.
    pub mismatches: u64,
    /// Answers the handler marked [`Rejected`](crate::execution::Rejected): nothing stored.
    pub rejections: u64,
    /// Holders whose completion or recovery point was refused because another attempt had
    /// taken the record over; their transactions rolled back.
    pub fenced: u64,
    /// Requests answered `400`, `401`, `408` or `413` before any claim (key, scope or body).
    pub refused: u64,
    /// Requests answered `503` (or `500`) because the store or the layer failed.
    pub store_failures: u64,
    /// Executions that ended without an outcome (the handler failed or its request was
    /// dropped): their leases were ended at once for a retry to take over.
    pub abandoned: u64,
    /// Recovery points committed (a step's `started` point before an external call, and each
    /// step's commit).
    pub steps: u64,
    /// Answers that were not outcomes (an [`Unfinished`](crate::Unfinished) answer, the
    /// crate's answer for a failed store, a status the layer does not store): nothing was
    /// stored and their leases were ended at once for a retry or a resumption.
    pub unfinished: u64,
    /// Records started more often than the layer allows in one generation: ended failed.
    pub failed: u64,
}

impl Counters {
    /// Reads every count.
    pub fn snapshot(&self) -> CounterSnapshot {
        let [
            claims,
            takeovers,
            completions,
            replays,
            in_progress,
            mismatches,
            rejections,
            fenced,
            refused,
            store_failures,
            abandoned,
            steps,
            unfinished,
            failed,
        ] = self.values.each_ref().map(|c| c.load(Ordering::Relaxed));
        CounterSnapshot {
            claims,
            takeovers,
            completions,
            replays,
            in_progress,
            mismatches,
            rejections,
            fenced,
            refused,
            store_failures,
            abandoned,
            steps,
            unfinished,
            failed,
        }
    }

    /// Every count with its name and what it counts, in a fixed order: for an exporter of your
    /// own (the `metrics` feature does this for the `metrics` facade).
    pub fn iter(&self) -> impl Iterator<Item = (&'static str, &'static str, u64)> + '_ {
        COUNTS
            .iter()
            .zip(&self.values)
            .map(|((name, about), value)| (*name, *about, value.load(Ordering::Relaxed)))
    }

    pub(crate) fn add(&self, count: Count) {
        self.values[count as usize].fetch_add(1, Ordering::Relaxed);
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|recorder| {
            recorder
                .register_counter(&metric_key(count as usize), &METADATA)
                .increment(1);
        });
    }

    /// Describes every metric and registers each counter at zero, with the recorder installed
    /// now (the layer does it when it is built).
    pub(crate) fn announce(&self) {
        #[cfg(feature = "metrics")]
        metrics::with_recorder(|recorder| {
            for (i, (_, about)) in COUNTS.iter().enumerate() {
                let key = metric_key(i);
                recorder.describe_counter(key.name().to_owned().into(), None, (*about).into());
                recorder.register_counter(&key, &METADATA).increment(0);
            }
        });
    }
}

#[cfg(feature = "metrics")]
static METADATA: metrics::Metadata<'static> = metrics::Metadata::new(
    "safe_retry_server",
    metrics::Level::INFO,
    Some(module_path!()),
);

/// The metric of the count at `index`: `safe_retry_server_<name>_total`.
#[cfg(feature = "metrics")]
fn metric_key(index: usize) -> metrics::Key {
    const NAMES: [&str; COUNTS.len()] = [
        "safe_retry_server_claims_total",
        "safe_retry_server_takeovers_total",
        "safe_retry_server_completions_total",
        "safe_retry_server_replays_total",
        "safe_retry_server_in_progress_total",
        "safe_retry_server_mismatches_total",
        "safe_retry_server_rejections_total",
        "safe_retry_server_fenced_total",
        "safe_retry_server_refused_total",
        "safe_retry_server_store_failures_total",
        "safe_retry_server_abandoned_total",
        "safe_retry_server_steps_total",
        "safe_retry_server_unfinished_total",
        "safe_retry_server_failed_total",
    ];
    metrics::Key::from_static_name(NAMES[index])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_count_lands_in_its_own_field_and_its_own_name() {
        let counters = Counters::default();
        let all = [
            Count::Claims,
            Count::Takeovers,
            Count::Completions,
            Count::Replays,
            Count::InProgress,
            Count::Mismatches,
            Count::Rejections,
            Count::Fenced,
            Count::Refused,
            Count::StoreFailures,
            Count::Abandoned,
            Count::Steps,
            Count::Unfinished,
            Count::Failed,
        ];
        for (i, count) in all.into_iter().enumerate() {
            for _ in 0..=i {
                counters.add(count);
            }
        }
        let s = counters.snapshot();
        let fields = [
            s.claims,
            s.takeovers,
            s.completions,
            s.replays,
            s.in_progress,
            s.mismatches,
            s.rejections,
            s.fenced,
            s.refused,
            s.store_failures,
            s.abandoned,
            s.steps,
            s.unfinished,
            s.failed,
        ];
        assert_eq!(fields, std::array::from_fn(|i| i as u64 + 1));
        let listed: Vec<_> = counters
            .iter()
            .map(|(name, _, value)| (name, value))
            .collect();
        assert_eq!(listed[0], ("claims", 1));
        assert_eq!(listed[4], ("in_progress", 5));
        assert_eq!(listed[13], ("failed", 14));
    }
}
