//! gRPC's rules (gRFC A6) beside HTTP's (`engine::rules`): a call judged by its `grpc-status`,
//! the server's pushback as its wait, A6's backoff, the channel's throttling counting each
//! attempt's end, `CANCELLED` at the deadline standing for it, the transparent retry, waits cut
//! at the deadline, and a hedging policy's course of copies.

use std::any::Any;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderMap;

use crate::engine::advice;
use crate::engine::backoff;
use crate::engine::classify::{Cause, Judging, Verdict, error_verdict};
use crate::engine::course::Pushback;
use crate::engine::grpc::throttle::RetryThrottling;
use crate::engine::grpc::{self, CodeSet, Said};
use crate::engine::observed::Observed;
use crate::engine::policy::RetryPolicy;
use crate::engine::rules::{Rules, ServerWait};
use crate::engine::seen::Seen;
use crate::fault::Fault;
use crate::rng::RandomSource;
use crate::stop::StopReason;

/// The rules of a gRPC method's calls: the codes its policy retries (or a hedging policy's
/// non-fatal ones), A6's backoff multiplier, a hedging policy's delay, and the channel's
/// throttling, if it has one.
#[derive(Debug, Clone)]
pub(crate) struct GrpcRules {
    pub(crate) codes: CodeSet,
    /// In thousandths.
    pub(crate) multiplier_milli: u32,
    /// A hedging policy's delay between copies: its attempts are copies of one call, never
    /// retries after it.
    pub(crate) hedge_delay: Option<Duration>,
    /// The channel's throttling: one channel's (or server's) count.
    pub(crate) throttling: Option<RetryThrottling>,
}

impl GrpcRules {
    /// The policy and rules that carry out an A6 retry policy: `attempts`, the backoff
    /// `(initial, max, multiplier in thousandths)` with A6's jitter, `codes` retried, the
    /// server's pushback taken as an exact wait, and no deadline or attempt timeout of its own:
    /// a call's `grpc-timeout` gives its deadline.
    pub(crate) fn retrying(
        attempts: u32,
        (initial, max, multiplier_milli): (Duration, Duration, u32),
        codes: CodeSet,
    ) -> (RetryPolicy, GrpcRules) {
        let policy = RetryPolicy::for_calls(attempts, initial, max, grpc::NO_DEADLINE);
        let rules = GrpcRules {
            codes,
            multiplier_milli,
            hedge_delay: None,
            throttling: None,
        };
        (policy, rules)
    }

    /// The policy and rules that carry out an A6 hedging policy: up to `attempts` copies of a
    /// call, `delay` apart, `codes` the non-fatal ones, the call's deadline over every copy.
    pub(crate) fn hedging(
        attempts: u32,
        delay: Duration,
        codes: CodeSet,
    ) -> (RetryPolicy, GrpcRules) {
        let (policy, mut rules) = GrpcRules::retrying(attempts, (delay, delay, 1000), codes);
        rules.hedge_delay = Some(delay);
        (policy, rules)
    }

    /// These rules with `throttling`'s count: one channel's.
    pub(crate) fn with_throttling(&self, throttling: Option<RetryThrottling>) -> GrpcRules {
        GrpcRules {
            throttling,
            ..self.clone()
        }
    }
}

impl Rules for GrpcRules {
    /// The verdict on a gRPC call's outcome, by A6: a committed call is final; a status in the
    /// policy's codes is transient, unless the server's pushback says not to retry, and under
    /// the same key rules as an HTTP answer (a replayed failure is final); a transport failure
    /// stands for `UNAVAILABLE`, as gRPC's clients report it, and one that sent nothing is
    /// retried whatever the codes (A6's transparent retry, within the policy's attempts).
    /// The dependency's classifier is not asked: the method's policy is the rule. Nor is the
    /// method (every call is a POST): a retry policy is the service's word that its method's
    /// calls may be repeated, as A6 takes it; a call the service cannot dedupe is marked
    /// non-idempotent and carries a key.
    fn verdict(
        &self,
        judging: &Judging<'_>,
        seen: &Seen<'_>,
        _: u32,
        _: Option<&Bytes>,
    ) -> Verdict {
        let answer = match seen {
            Seen::Failed(failure) => {
                let retried = self.codes.has(grpc::UNAVAILABLE);
                let nothing_sent = failure.fault.is_some_and(Fault::nothing_sent);
                let transient = failure.fault.is_some() && (retried || nothing_sent);
                return error_verdict(failure.fault, transient, true);
            }
            Seen::Answer(answer) => answer,
        };
        let code = match grpc::said(answer.status, answer.headers) {
            Said::Committed => return Verdict::Final(StopReason::Committed),
            Said::Status(grpc::OK) => return Verdict::Final(StopReason::Succeeded),
            Said::Status(code) => code,
        };
        if !self.codes.has(code) {
            return Verdict::Final(StopReason::NotRetryable);
        }
        if grpc::pushback(answer.headers) == Pushback::Stop {
            return Verdict::Final(StopReason::ServerDeclinedRetry);
        }
        if judging.key_sent && advice::replayed(answer.headers) {
            return Verdict::Final(StopReason::ReplayedFailure);
        }
        // Every retried code costs a retry alike: a gRPC method pays from the channel's
        // throttling, or from a budget at its defaults, whose throttled cost is a retry's.
        Verdict::Transient(Cause::Status { throttled: false })
    }

    /// The server's pushback, which starts the backoff again from its first wait (A6).
    fn server_wait(&self, headers: &HeaderMap, _: &dyn Fn() -> SystemTime) -> ServerWait {
        match grpc::pushback(headers) {
            Pushback::Wait(wait) => ServerWait {
                floor: Some(wait),
                restarts_backoff: true,
            },
            Pushback::Absent | Pushback::Stop => ServerWait::default(),
        }
    }

    fn backoff(
        &self,
        policy: &RetryPolicy,
        retry: u32,
        _: Duration,
        rng: &dyn RandomSource,
    ) -> Duration {
        let (base, cap) = (policy.base_delay(), policy.max_delay());
        backoff::a6(base, cap, self.multiplier_milli, retry, rng)
    }

    /// The channel's throttling counts the attempt's status (`OK` refills it; a code the
    /// policy retries, or a transport failure that would be retried as `UNAVAILABLE`, spends
    /// it). A committed call is counted by the door when its trailers come, and a failure that
    /// sent nothing reached no application: neither is counted here (A6).
    fn counted(&self, observed: &Observed<'_>) -> bool {
        let Some(throttling) = self.throttling.as_ref() else {
            return true;
        };
        let code = match observed.answer {
            Some(answer) => match grpc::said(answer.status, answer.headers) {
                Said::Committed => return true,
                Said::Status(code) => code,
            },
            None if matches!(observed.verdict, Verdict::Transient(_)) && !observed.unsent => {
                grpc::UNAVAILABLE
            }
            None => return true,
        };
        throttling.ended(code, self.codes)
    }

    /// `grpc-previous-rpc-attempts` on every retry, and the call's `grpc-timeout`, when it has
    /// one, cut to what is left (the deadline spans its attempts).
    fn attempt_headers(&self, headers: &mut HeaderMap, number: u32, left: Duration) {
        grpc::attempt_headers(headers, number, left);
    }

    /// At or below half of the channel's tokens, no copy goes.
    fn refuses_copies(&self) -> bool {
        self.throttling.as_ref().is_some_and(|t| !t.allows())
    }

    /// A `CANCELLED` answer: a server that gave up at the `grpc-timeout` it was told, as
    /// tonic's does, answering as the client's timer fires.
    fn at_deadline(&self, observed: &Observed<'_>) -> bool {
        observed.answer.is_some_and(|answer| {
            grpc::said(answer.status, answer.headers) == Said::Status(grpc::CANCELLED)
        })
    }

    fn retries_unsent_at_once(&self) -> bool {
        true
    }

    /// A call's deadline is its own `grpc-timeout`, often shorter than the backoff: its waits
    /// are cut at it, and the call ends there `DEADLINE_EXCEEDED`, as grpc-go's and
    /// grpc-java's calls do.
    fn waits_out_the_deadline(&self) -> bool {
        true
    }

    fn course(&self) -> Option<Duration> {
        self.hedge_delay
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}
