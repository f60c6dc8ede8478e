//! Where the protocols differ: the rules a request's dependency speaks by, beside the policy's
//! numbers. HTTP's ([`Http`]) and gRPC's (`engine::grpc::rules::GrpcRules`, gRFC A6) stand side
//! by side; the classifier and the decider ask the dependency's rules and never which protocol
//! they are. What they ask: the verdict on an outcome, the wait the server asked for, the
//! backoff, what the protocol's own account counts of an attempt's end (gRPC's throttling),
//! whether an outcome at the deadline stands for the deadline, whether a failure that sent
//! nothing is retried at once, how a wait that would cross the deadline ends, and whether the
//! method hedges as its protocol says (a course of copies a fixed delay apart).

#[cfg(feature = "grpc")]
use std::any::Any;
use std::fmt::Debug;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderMap;

use crate::engine::classify::{Judging, Verdict};
use crate::engine::observed::Observed;
use crate::engine::policy::RetryPolicy;
use crate::engine::retry_after;
use crate::engine::seen::Seen;
use crate::rng::RandomSource;

/// How a request's outcomes are judged: the request's judging (its policy, key and
/// classifier) under its dependency's rules.
#[derive(Clone, Copy)]
pub(crate) struct Judge<'a> {
    pub(crate) judging: Judging<'a>,
    pub(crate) rules: &'a dyn Rules,
}

impl Judge<'_> {
    /// The verdict on attempt `number`'s outcome, `seen`.
    pub(crate) fn verdict(&self, seen: &Seen<'_>, number: u32) -> Verdict {
        self.verdict_on(seen, number, None)
    }

    /// The verdict, with the answer's `body` when it was read whole for a classifier.
    pub(crate) fn verdict_on(&self, seen: &Seen<'_>, number: u32, body: Option<&Bytes>) -> Verdict {
        self.rules.verdict(&self.judging, seen, number, body)
    }
}

/// The rules of one protocol; see the module's docs.
pub(crate) trait Rules: Debug + Send + Sync + 'static {
    /// The verdict on attempt `number`'s outcome, `seen` (with the answer's `body` when it was
    /// read whole for a classifier), as `judging` judges the request.
    fn verdict(
        &self,
        judging: &Judging<'_>,
        seen: &Seen<'_>,
        number: u32,
        body: Option<&Bytes>,
    ) -> Verdict;

    /// The wait the server asked for on a transient answer with `headers` (`wall`: the wall
    /// time, for a date), if any; none when it said not to retry (its answer was made final
    /// by the verdict).
    fn server_wait(&self, headers: &HeaderMap, wall: &dyn Fn() -> SystemTime) -> ServerWait;

    /// The backoff before retry `retry` (0 for the first) under `policy`; `previous`: the last
    /// one drawn for the request (the base before the first).
    fn backoff(
        &self,
        policy: &RetryPolicy,
        retry: u32,
        previous: Duration,
        rng: &dyn RandomSource,
    ) -> Duration;

    /// The protocol's own account of retries (gRPC's throttling) counts an attempt's (or a
    /// copy's) end, `observed`: whether it allows a retry after it (yes, when it counts
    /// nothing).
    fn counted(&self, observed: &Observed<'_>) -> bool;

    /// Puts the protocol's own attempt headers on the copy of attempt `number`, sent `left`
    /// before the request's deadline (gRPC's `grpc-previous-rpc-attempts` and `grpc-timeout`).
    fn attempt_headers(&self, headers: &mut HeaderMap, number: u32, left: Duration);

    /// Whether that account refuses any further copy now.
    fn refuses_copies(&self) -> bool;

    /// Whether an outcome that came at or after the deadline stands for the deadline (a gRPC
    /// server that gave up at the time it was told, answering `CANCELLED`).
    fn at_deadline(&self, observed: &Observed<'_>) -> bool;

    /// Whether an attempt that certainly sent nothing is retried at once, once, beyond the
    /// policy's attempts (A6's transparent retry).
    fn retries_unsent_at_once(&self) -> bool;

    /// Whether a wait that would cross the deadline is waited out to it, the request ending
    /// there (gRPC's calls); else no such retry is planned, and a deadline shorter than the
    /// first backoff leaves one attempt (HTTP).
    fn waits_out_the_deadline(&self) -> bool;

    /// The delay between copies of each call, when the method hedges as its protocol says (a
    /// course of copies); `None`: attempts one after another, or hedged reads as the policy's
    /// latency window says.
    fn course(&self) -> Option<Duration>;

    /// These rules, for a door that knows their type and makes them anew (a gRPC channel's
    /// throttling).
    #[cfg(feature = "grpc")]
    fn as_any(&self) -> &dyn Any;
}

/// The wait a server asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ServerWait {
    /// At least this long, if the server said.
    pub(crate) floor: Option<Duration>,
    /// The backoff starts again from its first wait after this one (A6's pushback).
    pub(crate) restarts_backoff: bool,
}

/// HTTP's rules: a status and a transport fault judged by the policy, the classifier and the
/// safety rule; the server's `retry-after-ms`, `x-ms-retry-after-ms` or `Retry-After`; the
/// policy's jitter; no account but the budget's, no transparent retry, and no retry whose wait
/// would cross the deadline.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Http;

impl Rules for Http {
    fn verdict(
        &self,
        judging: &Judging<'_>,
        seen: &Seen<'_>,
        number: u32,
        body: Option<&Bytes>,
    ) -> Verdict {
        judging.verdict_on(seen, number, body)
    }

    fn server_wait(&self, headers: &HeaderMap, wall: &dyn Fn() -> SystemTime) -> ServerWait {
        ServerWait {
            floor: retry_after::floor(headers, wall),
            restarts_backoff: false,
        }
    }

    fn backoff(
        &self,
        policy: &RetryPolicy,
        retry: u32,
        previous: Duration,
        rng: &dyn RandomSource,
    ) -> Duration {
        let (base, cap) = (policy.base_delay(), policy.max_delay());
        policy.jitter().draw(base, cap, retry, previous, rng)
    }

    fn counted(&self, _: &Observed<'_>) -> bool {
        true
    }

    fn attempt_headers(&self, _: &mut HeaderMap, _: u32, _: Duration) {}

    fn refuses_copies(&self) -> bool {
        false
    }

    fn at_deadline(&self, _: &Observed<'_>) -> bool {
        false
    }

    fn retries_unsent_at_once(&self) -> bool {
        false
    }

    fn waits_out_the_deadline(&self) -> bool {
        false
    }

    fn course(&self) -> Option<Duration> {
        None
    }

    #[cfg(feature = "grpc")]
    fn as_any(&self) -> &dyn Any {
        self
    }
}
