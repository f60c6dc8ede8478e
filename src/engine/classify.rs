//! Which outcomes are transient, and when repeating a request is safe.
//!
//! Two separate questions decide a retry:
//!
//! 1. **Is the failure transient?** A timeout, a refused or reset connection, or a server that
//!    closed the connection before a full response, may well go differently next time; so may a
//!    response whose status is in the policy's retryable set. A TLS certificate failure, a
//!    redirect loop, a malformed request or another middleware's error will not.
//! 2. **Is repeating safe?** Idempotent methods (GET, HEAD, OPTIONS, TRACE, PUT, DELETE) may be
//!    repeated. Any other method may be repeated only when it carries an idempotency key, so the
//!    server can recognise the copy, or when the failure happened while connecting, before any
//!    byte of it reached the server.
//!
//! The outcome is read as the engine sees it (`seen`): an answer's head, or a failure with the
//! fault its door found in it (`crate::fault`), so the rules are the same behind every door.

use http::{HeaderValue, Method, StatusCode};

use crate::engine::advice;
use crate::engine::classifier::{Attempt, Classifier, Outcome, RequestHead, Retryable};
use crate::engine::policy::RetryPolicy;
use crate::engine::seen::{ResponseHead, Seen};
use crate::fault::Fault;
use crate::shared::Shared;
use crate::stop::StopReason;

/// What an attempt's outcome calls for, before any limit (attempts, deadline, budget) is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A transient failure that is safe to repeat, and what made it transient: the core maps
    /// it to what a retry after it costs, the trace names it.
    Transient(Cause),
    /// No retry: [`StopReason::Succeeded`], [`StopReason::NotRetryable`],
    /// [`StopReason::NotSafeToRetry`], [`StopReason::ServerDeclinedRetry`] or
    /// [`StopReason::ReplayedFailure`].
    Final(StopReason),
}

/// What made a failure transient.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cause {
    /// An answer whose status is a transient failure; `throttled`: a 429.
    Status { throttled: bool },
    /// A transport fault.
    Fault(Fault),
    /// The dependency's classifier, for an error the default rules do not know.
    Classifier,
}

impl Cause {
    /// The reason a retry follows, as the trace names it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Cause::Status { .. } => "status",
            Cause::Fault(fault) => fault.as_str(),
            Cause::Classifier => "classifier",
        }
    }
}

/// What judging an attempt's outcome takes, fixed for the logical request: the default rules
/// (the policy's status set), the dependency's classifier, and the safety rule, composed in
/// [`verdict`](Self::verdict) and nowhere else.
#[derive(Clone, Copy)]
pub(crate) struct Judging<'a> {
    pub(crate) policy: &'a RetryPolicy,
    /// The method is idempotent, or the request carries a key.
    pub(crate) repeatable: bool,
    pub(crate) key: Option<&'a HeaderValue>,
    /// The key was sent before this attempt (by an earlier attempt that may have reached the
    /// server, or, for a caller's own or a derived key, perhaps by an earlier run): only then
    /// can the server hold an original under it, still in flight (a 409) or stored and
    /// replayed (`Idempotent-Replayed`).
    pub(crate) key_sent: bool,
    /// The dependency's classifier, and the request's head for it to see.
    pub(crate) hook: Option<(&'a Shared<dyn Classifier>, &'a RequestHead)>,
}

/// HTTP's judgement (`engine::rules::Http`; a protocol's rules judge by their own, see
/// `engine::rules::Judge`).
impl Judging<'_> {
    /// The verdict on attempt `number`'s outcome, `seen`: transient by the default rules or
    /// the classifier, then retried only where the safety rule allows.
    #[cfg(test)]
    pub(crate) fn verdict(&self, seen: &Seen<'_>, number: u32) -> Verdict {
        self.verdict_on(seen, number, None)
    }

    /// How much of an answer's body to read before the verdict, for the classifier to see it:
    /// with the policy's `buffer_body` and a classifier, its limit.
    #[inline]
    pub(crate) fn body_first(&self) -> Option<usize> {
        self.hook.and(self.policy.buffer_body_limit())
    }

    /// The verdict, with the answer's `body` when it was read whole for the classifier.
    pub(crate) fn verdict_on(
        &self,
        seen: &Seen<'_>,
        number: u32,
        body: Option<&bytes::Bytes>,
    ) -> Verdict {
        // The common answer, a success with no classifier to ask: final, whatever else it says.
        if let (Seen::Answer(answer), None) = (seen, self.hook) {
            if answer.status.as_u16() < 400 {
                return Verdict::Final(StopReason::Succeeded);
            }
        }
        let (by_default, declined) = match seen {
            Seen::Answer(answer) => self.answer_is_transient(answer),
            Seen::Failed(failure) => (failure.fault.is_some(), false),
        };
        let transient = match self.hook {
            None => by_default,
            Some((classifier, head)) => {
                let seen = Attempt {
                    method: &head.method,
                    uri: &head.uri,
                    headers: &head.headers,
                    key: self.key,
                    number,
                    body,
                    body_unread: (matches!(seen, Seen::Answer(_))
                        && self.policy.buffer_body_limit().is_none())
                    .then(|| classifier.0.told()),
                    outcome: match seen {
                        Seen::Answer(answer) => Outcome::Response(*answer),
                        Seen::Failed(failure) => Outcome::Error(failure.error),
                    },
                    fault: seen.fault(),
                    default: if by_default {
                        Retryable::Transient
                    } else {
                        Retryable::Fatal
                    },
                };
                classifier.0.classify(&seen) == Retryable::Transient
            }
        };
        match seen {
            Seen::Answer(answer) => match status_verdict(answer.status, transient, self.repeatable)
            {
                Verdict::Final(StopReason::NotRetryable) if declined => {
                    Verdict::Final(StopReason::ServerDeclinedRetry)
                }
                // Every further attempt with the key would be answered with the same replay;
                // under a key never sent, or none, the marker means nothing.
                Verdict::Transient(..) if self.key_sent && advice::replayed(answer.headers) => {
                    Verdict::Final(StopReason::ReplayedFailure)
                }
                verdict => verdict,
            },
            Seen::Failed(failure) => error_verdict(failure.fault, transient, self.repeatable),
        }
    }

    /// Whether an answer is a transient failure by the default rules: its status in the
    /// policy's set (409 under a key sent before: the original is still in flight), unless the server's own verdict, when the policy
    /// heeds it, says otherwise. The second value: the server's `false` made a failure final
    /// that the status alone would have retried.
    #[inline]
    fn answer_is_transient(&self, answer: &ResponseHead<'_>) -> (bool, bool) {
        let status = answer.status;
        let by_status = is_transient_status(
            status,
            |s| self.policy.is_retryable_status(s),
            self.key_sent,
        );
        // A success is final whatever the server adds: its verdict speaks of failures (and a
        // success, the common answer, costs no header lookup).
        if status.as_u16() < 400 || !self.policy.should_retry_fields() {
            return (by_status, false);
        }
        match advice::should_retry(answer.headers) {
            Some(true) => (by_status || advice::may_be_made_transient(status), false),
            Some(false) => (false, by_status),
            None => (by_status, false),
        }
    }
}

/// The verdict on a response with `status` that is (or is not) a transient failure, by the
/// default rules or a classifier's: a transient failure is retried only when `repeatable`,
/// since the server answered and may have acted on the request.
fn status_verdict(status: StatusCode, transient: bool, repeatable: bool) -> Verdict {
    if !transient {
        return Verdict::Final(if status.as_u16() < 400 {
            StopReason::Succeeded
        } else {
            StopReason::NotRetryable
        });
    }
    if !repeatable {
        // The server answered: it may have acted on the request.
        return Verdict::Final(StopReason::NotSafeToRetry);
    }
    Verdict::Transient(Cause::Status {
        throttled: status == StatusCode::TOO_MANY_REQUESTS,
    })
}

/// The verdict on an attempt that ended in an error with transient `fault` (if the default
/// rules know one) that is (or is not) transient, by the default rules or a classifier's. A
/// transient error is retried when `repeatable`, or when nothing of the request reached the
/// server: a fault the default rules do not know may have come after the request was sent.
pub(crate) fn error_verdict(fault: Option<Fault>, transient: bool, repeatable: bool) -> Verdict {
    if !transient {
        return Verdict::Final(StopReason::NotRetryable);
    }
    if !(repeatable || fault.is_some_and(Fault::nothing_sent)) {
        return Verdict::Final(StopReason::NotSafeToRetry);
    }
    Verdict::Transient(fault.map_or(Cause::Classifier, Cause::Fault))
}

/// Whether `method` may be repeated without a key: RFC 9110 §9.2.2 idempotent methods.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Whether a request may be hedged (a second copy sent while the first is out): a read (GET,
/// HEAD, OPTIONS) without an idempotency key, whose body, if any, can be sent twice
/// (`whole_body`). Two copies of a write are two writes; two copies of a keyed request race for
/// one key.
pub(crate) fn may_be_hedged(method: &Method, keyed: bool, whole_body: bool) -> bool {
    matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS) && !keyed && whole_body
}

/// Whether `status` is a transient failure under a policy's status set; 409 counts only under
/// an idempotency key that was sent before (the original is still in flight on the server): a
/// 409 under a key no server has seen is the server's own conflict, final.
pub(crate) fn is_transient_status(
    status: StatusCode,
    in_set: impl Fn(StatusCode) -> bool,
    key_sent: bool,
) -> bool {
    in_set(status) || (key_sent && status == StatusCode::CONFLICT)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::seen::{Failure, Target};

    /// An answer with `status` and `headers`, as the engine sees it.
    fn answer(status: u16, headers: &http::HeaderMap) -> Seen<'_> {
        Seen::Answer(ResponseHead {
            status: StatusCode::from_u16(status).unwrap(),
            version: http::Version::HTTP_11,
            headers,
            from: &Target {
                scheme: "http",
                host: "127.0.0.1",
                port: Some(80),
            },
        })
    }

    #[test]
    fn idempotent_methods_are_the_rfc_ones() {
        for m in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
            assert!(
                is_idempotent(&Method::from_bytes(m.as_bytes()).unwrap()),
                "{m}"
            );
        }
        for m in ["POST", "PATCH", "CONNECT", "PROPFIND", "LOCK"] {
            assert!(
                !is_idempotent(&Method::from_bytes(m.as_bytes()).unwrap()),
                "{m}"
            );
        }
    }

    #[test]
    fn conflict_is_transient_only_with_a_key() {
        let none = |_: StatusCode| false;
        assert!(is_transient_status(StatusCode::CONFLICT, none, true));
        assert!(!is_transient_status(StatusCode::CONFLICT, none, false));
        assert!(!is_transient_status(
            StatusCode::UNPROCESSABLE_ENTITY,
            none,
            true
        ));
        assert!(is_transient_status(
            StatusCode::SERVICE_UNAVAILABLE,
            |s| s == 503,
            false
        ));
    }

    #[test]
    fn statuses_are_judged_by_the_set_the_key_and_the_method() {
        let status = |code| StatusCode::from_u16(code).unwrap();
        let cases = [
            // (status, repeatable, keyed, verdict); 399 and 400 are the edge of success.
            (200, true, false, Verdict::Final(StopReason::Succeeded)),
            (304, false, false, Verdict::Final(StopReason::Succeeded)),
            (399, true, false, Verdict::Final(StopReason::Succeeded)),
            (400, true, false, Verdict::Final(StopReason::NotRetryable)),
            (404, true, true, Verdict::Final(StopReason::NotRetryable)),
            (500, true, true, Verdict::Final(StopReason::NotRetryable)),
            (
                503,
                true,
                false,
                Verdict::Transient(Cause::Status { throttled: false }),
            ),
            (
                429,
                true,
                false,
                Verdict::Transient(Cause::Status { throttled: true }),
            ),
            (
                503,
                false,
                false,
                Verdict::Final(StopReason::NotSafeToRetry),
            ),
            (
                409,
                true,
                true,
                Verdict::Transient(Cause::Status { throttled: false }),
            ),
            (409, true, false, Verdict::Final(StopReason::NotRetryable)),
        ];
        for (code, repeatable, keyed, verdict) in cases {
            assert_eq!(
                judge_status(status(code), repeatable, keyed),
                verdict,
                "{code} repeatable={repeatable} keyed={keyed}"
            );
        }
    }

    /// The verdict on a response with `status` under the default policy.
    fn judge_status(status: StatusCode, repeatable: bool, keyed: bool) -> Verdict {
        let key = HeaderValue::from_static("k");
        let policy = RetryPolicy::default();
        let judging = Judging {
            policy: &policy,
            repeatable,
            key: keyed.then_some(&key),
            key_sent: keyed,
            hook: None,
        };
        judging.verdict(&answer(status.as_u16(), &http::HeaderMap::new()), 1)
    }

    /// A classifier that answers this, or delegates to the default verdict.
    const DELEGATES: Option<Option<Retryable>> = Some(None);

    /// The verdict on a response with `status` and header `lines`, for a request that is
    /// (repeatable, keyed), under `policy`, with a classifier if any (see [`DELEGATES`]).
    fn judge_answer(
        policy: &RetryPolicy,
        status: u16,
        lines: &[(&'static str, &'static str)],
        (repeatable, keyed): (bool, bool),
        classifier: Option<Option<Retryable>>,
    ) -> Verdict {
        let key = HeaderValue::from_static("k");
        let says = classifier.flatten();
        let hook: Shared<dyn Classifier> =
            Shared(std::sync::Arc::new(crate::engine::classifier::Hook {
                classify: move |a: &Attempt<'_>| says.unwrap_or(a.default_verdict()),
                told: Default::default(),
            }));
        let head = RequestHead {
            method: Method::GET,
            uri: "http://127.0.0.1/".parse().unwrap(),
            headers: http::HeaderMap::new(),
        };
        let judging = Judging {
            policy,
            repeatable,
            key: keyed.then_some(&key),
            key_sent: keyed,
            hook: classifier.is_some().then_some((&hook, &head)),
        };
        let mut headers = http::HeaderMap::new();
        for (name, value) in lines {
            headers.append(*name, HeaderValue::from_static(value));
        }
        judging.verdict(&answer(status, &headers), 1)
    }

    #[test]
    fn the_server_s_verdict_turns_a_failure_final_or_transient_within_the_safety_rule() {
        use StopReason::*;
        let policy = RetryPolicy::default();
        const NO: [(&str, &str); 1] = [("x-should-retry", "false")];
        const YES: [(&str, &str); 1] = [("x-should-retry", "true")];
        let (no, yes) = (&NO, &YES);
        let stripe_yes = &[("stripe-should-retry", "true")];
        let retried = Verdict::Transient(Cause::Status { throttled: false });
        let safe = (true, false);
        type Lines<'a> = &'a [(&'a str, &'a str)];
        let cases: &[(u16, Lines<'_>, (bool, bool), Verdict)] = &[
            (503, no, safe, Verdict::Final(ServerDeclinedRetry)),
            (429, no, safe, Verdict::Final(ServerDeclinedRetry)),
            // Keyed 409 (the original in flight) is the status rule's too.
            (409, no, (true, true), Verdict::Final(ServerDeclinedRetry)),
            // A failure the status would not retry anyway stays not retryable.
            (500, no, safe, Verdict::Final(NotRetryable)),
            (200, no, safe, Verdict::Final(Succeeded)),
            (500, yes, safe, retried),
            (408, stripe_yes, safe, retried),
            (503, yes, safe, retried),
            (
                429,
                yes,
                safe,
                Verdict::Transient(Cause::Status { throttled: true }),
            ),
            // Never a success, a malformed request or a reused key.
            (200, yes, safe, Verdict::Final(Succeeded)),
            (302, yes, safe, Verdict::Final(Succeeded)),
            (400, yes, safe, Verdict::Final(NotRetryable)),
            (422, yes, (true, true), Verdict::Final(NotRetryable)),
            // Never a request that is not safe to repeat.
            (500, yes, (false, false), Verdict::Final(NotSafeToRetry)),
            (503, no, (false, false), Verdict::Final(ServerDeclinedRetry)),
        ];
        for (status, lines, who, verdict) in cases {
            assert_eq!(
                judge_answer(&policy, *status, lines, *who, None),
                *verdict,
                "{status} {lines:?} {who:?}"
            );
        }
        // Turned off, the status alone decides.
        let deaf = RetryPolicy::builder()
            .should_retry_fields(false)
            .build()
            .unwrap();
        assert_eq!(judge_answer(&deaf, 503, no, safe, None), retried);
        assert_eq!(
            judge_answer(&deaf, 500, yes, safe, None),
            Verdict::Final(NotRetryable)
        );
    }

    #[test]
    fn a_classifier_sees_the_server_s_verdict_and_has_the_last_word() {
        use StopReason::*;
        let policy = RetryPolicy::default();
        let (no, yes) = ([("x-should-retry", "false")], [("x-should-retry", "true")]);
        let safe = (true, false);
        let retried = Verdict::Transient(Cause::Status { throttled: false });
        // Delegating to the default verdict: the server's.
        assert_eq!(judge_answer(&policy, 500, &yes, safe, DELEGATES), retried);
        assert_eq!(
            judge_answer(&policy, 503, &no, safe, DELEGATES),
            Verdict::Final(ServerDeclinedRetry)
        );
        // Overruling it.
        assert_eq!(
            judge_answer(&policy, 503, &no, safe, Some(Some(Retryable::Transient))),
            retried
        );
        assert_eq!(
            judge_answer(&policy, 500, &yes, safe, Some(Some(Retryable::Fatal))),
            Verdict::Final(NotRetryable)
        );
        // Agreeing with the server's false: the server's reason.
        assert_eq!(
            judge_answer(&policy, 503, &no, safe, Some(Some(Retryable::Fatal))),
            Verdict::Final(ServerDeclinedRetry)
        );
        // Within the safety rule, whatever it says.
        assert_eq!(
            judge_answer(
                &policy,
                500,
                &yes,
                (false, false),
                Some(Some(Retryable::Transient))
            ),
            Verdict::Final(NotSafeToRetry)
        );
    }

    #[test]
    fn a_replayed_transient_answer_is_final_and_a_replayed_success_is_a_success() {
        use StopReason::*;
        let policy = RetryPolicy::default();
        let replayed = [("idempotent-replayed", "true")];
        let keyed = (true, true);
        for status in [429, 502, 503, 504, 409] {
            assert_eq!(
                judge_answer(&policy, status, &replayed, keyed, None),
                Verdict::Final(ReplayedFailure),
                "{status}"
            );
        }
        // Even where the server or a classifier says retry: no attempt can change a replay.
        let both = [("idempotent-replayed", "true"), ("x-should-retry", "true")];
        assert_eq!(
            judge_answer(&policy, 500, &both, keyed, None),
            Verdict::Final(ReplayedFailure)
        );
        assert_eq!(
            judge_answer(
                &policy,
                503,
                &replayed,
                keyed,
                Some(Some(Retryable::Transient))
            ),
            Verdict::Final(ReplayedFailure)
        );
        assert_eq!(
            judge_answer(&policy, 201, &replayed, keyed, None),
            Verdict::Final(Succeeded)
        );
        assert_eq!(
            judge_answer(&policy, 422, &replayed, keyed, None),
            Verdict::Final(NotRetryable)
        );
        let not_a_replay = [("idempotent-replayed", "false")];
        assert_eq!(
            judge_answer(&policy, 503, &not_a_replay, keyed, None),
            Verdict::Transient(Cause::Status { throttled: false })
        );
    }

    #[test]
    fn a_409_or_a_replay_under_a_key_never_sent_is_the_server_s_own_answer() {
        use StopReason::*;
        let policy = RetryPolicy::default();
        let key = HeaderValue::from_static("k");
        let judge = |status: u16, key: Option<&HeaderValue>, key_sent: bool, replayed: bool| {
            let judging = Judging {
                policy: &policy,
                repeatable: true,
                key,
                key_sent,
                hook: None,
            };
            let mut headers = http::HeaderMap::new();
            if replayed {
                headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
            }
            judging.verdict(&answer(status, &headers), 1)
        };
        let retried = Verdict::Transient(Cause::Status { throttled: false });
        // A key just made, on its first attempt: the 409 is a conflict, the marker nothing.
        assert_eq!(
            judge(409, Some(&key), false, false),
            Verdict::Final(NotRetryable)
        );
        assert_eq!(judge(503, Some(&key), false, true), retried);
        // Sent before: in flight, and a stored failure.
        assert_eq!(judge(409, Some(&key), true, false), retried);
        assert_eq!(
            judge(503, Some(&key), true, true),
            Verdict::Final(ReplayedFailure)
        );
        // No key at all: a 503 marked replayed is retried like any other.
        assert_eq!(judge(503, None, false, true), retried);
        assert_eq!(judge(409, None, false, false), Verdict::Final(NotRetryable));
    }

    /// The verdict on an attempt that ended in an error with `fault`.
    fn judge_error(fault: Option<Fault>, repeatable: bool) -> Verdict {
        let policy = RetryPolicy::default();
        let judging = Judging {
            policy: &policy,
            repeatable,
            key: None,
            key_sent: false,
            hook: None,
        };
        let error = std::io::Error::other("an error");
        judging.verdict(
            &Seen::Failed(Failure {
                fault,
                error: &error,
            }),
            1,
        )
    }

    #[test]
    fn errors_are_judged_by_their_fault_and_the_method() {
        let timeout = Some(Fault::Timeout);
        assert_eq!(
            judge_error(timeout, true),
            Verdict::Transient(Cause::Fault(Fault::Timeout))
        );
        // A timeout may have reached the server: not for an unkeyed POST.
        assert_eq!(
            judge_error(timeout, false),
            Verdict::Final(StopReason::NotSafeToRetry)
        );
        // Nothing of it reached the server: safe for any method.
        for fault in [Fault::Connect, Fault::NotProcessed] {
            assert_eq!(
                judge_error(Some(fault), false),
                Verdict::Transient(Cause::Fault(fault))
            );
        }
        assert_eq!(
            judge_error(Some(Fault::Reset), false),
            Verdict::Final(StopReason::NotSafeToRetry)
        );
        assert_eq!(
            judge_error(None, true),
            Verdict::Final(StopReason::NotRetryable)
        );
    }
}
