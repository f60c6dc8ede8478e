//! What every clone of a layer and its services share: the configuration and the counters.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use http::request::Parts;
use http::{HeaderName, Method, StatusCode};

use crate::events::EventLevels;
use crate::fingerprint::Fingerprint;
use crate::key::KeySource;

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
    pub(crate) retention: Duration,
    pub(crate) max_request_body: usize,
    pub(crate) max_answer_body: usize,
    pub(crate) max_key_len: usize,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) max_attempts: u32,
    pub(crate) failed_retention: Duration,
    pub(crate) not_stored: Vec<StatusCode>,
    pub(crate) saved_headers: Vec<HeaderName>,
    pub(crate) request_body_timeout: Duration,
    pub(crate) events: Arc<EventLevels>,
    pub(crate) counters: Arc<Counters>,
}

/// What the layer has done, counted since it was built (monotonic, shared by its clones).
///
/// Each count has a tracing event beside it (target `safe_retry_server`, field `event`).
/// A count is made when this process sees the step end: a completion that committed while its
/// request was being dropped is in the table but not counted. The table is the record.
#[derive(Debug, Default)]
pub struct Counters {
    pub(crate) claims: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) completions: AtomicU64,
    pub(crate) replays: AtomicU64,
    pub(crate) in_progress: AtomicU64,
    pub(crate) mismatches: AtomicU64,
    pub(crate) rejections: AtomicU64,
    pub(crate) fenced: AtomicU64,
    pub(crate) refused: AtomicU64,
    pub(crate) store_failures: AtomicU64,
    pub(crate) abandoned: AtomicU64,
    pub(crate) steps: AtomicU64,
    pub(crate) unfinished: AtomicU64,
    pub(crate) failed: AtomicU64,
}

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
    /// Completions and recovery points refused because another attempt had taken the record
    /// over; their transactions rolled back.
    pub fenced: u64,
    /// Requests answered `400`, `401`, `408` or `413` before any claim (key, scope or body).
    pub refused: u64,
    /// Requests answered `503` (or `500`) because the store failed.
    pub store_failures: u64,
    /// Executions that ended without an outcome (the handler failed or its request was
    /// dropped): their leases were ended at once for a retry to take over.
    pub abandoned: u64,
    /// Recovery points committed (a step's `started` point before an external call, and each
    /// step's commit).
    pub steps: u64,
    /// Executions that stopped at a recovery point ([`Unfinished`](crate::Unfinished)
    /// answers): their leases were ended at once for a resumption.
    pub unfinished: u64,
    /// Records that were resumed more often than the layer allows and ended failed.
    pub failed: u64,
}

impl Counters {
    /// Reads every count.
    pub fn snapshot(&self) -> CounterSnapshot {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        CounterSnapshot {
            claims: read(&self.claims),
            takeovers: read(&self.takeovers),
            completions: read(&self.completions),
            replays: read(&self.replays),
            in_progress: read(&self.in_progress),
            mismatches: read(&self.mismatches),
            rejections: read(&self.rejections),
            fenced: read(&self.fenced),
            refused: read(&self.refused),
            store_failures: read(&self.store_failures),
            abandoned: read(&self.abandoned),
            steps: read(&self.steps),
            unfinished: read(&self.unfinished),
            failed: read(&self.failed),
        }
    }

    pub(crate) fn add(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
