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
//! Transport errors are recognised by what they are made of (timeouts, `std::io` error kinds,
//! hyper's "incomplete message"), not by their text, so a new wording in a dependency cannot
//! change a decision.

use std::error::Error as _;
use std::io;

use http::{HeaderValue, Method, StatusCode};
use reqwest::Response;

use crate::engine::advice;
use crate::engine::budget::RetryKind;
use crate::engine::classifier::{Attempt, Classifier, Outcome, RequestHead, Retryable};
use crate::engine::policy::RetryPolicy;
use crate::error::StopReason;
use crate::shared::Shared;

/// What an attempt's outcome calls for, before any limit (attempts, deadline, budget) is asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// A transient failure that is safe to repeat: what a retry after it costs, and the reason
    /// for the trace.
    Transient(RetryKind, &'static str),
    /// No retry: [`StopReason::Succeeded`], [`StopReason::NotRetryable`],
    /// [`StopReason::NotSafeToRetry`], [`StopReason::ServerDeclinedRetry`] or
    /// [`StopReason::ReplayedFailure`].
    Final(StopReason),
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

impl Judging<'_> {
    /// The verdict on attempt `number`'s outcome: transient by the default rules or the
    /// classifier, then retried only where the safety rule allows.
    pub(crate) fn verdict(
        &self,
        outcome: &reqwest_middleware::Result<Response>,
        number: u32,
    ) -> Verdict {
        self.verdict_on(outcome, number, None)
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
        outcome: &reqwest_middleware::Result<Response>,
        number: u32,
        body: Option<&bytes::Bytes>,
    ) -> Verdict {
        // The common answer, a success with no classifier to ask: final, whatever else it says.
        if let (Ok(response), None) = (outcome, self.hook) {
            if response.status().as_u16() < 400 {
                return Verdict::Final(StopReason::Succeeded);
            }
        }
        let fault = match outcome {
            Ok(_) => None,
            Err(err) => transport_fault(err),
        };
        let (by_default, declined) = match outcome {
            Ok(response) => self.answer_is_transient(response),
            Err(_) => (fault.is_some(), false),
        };
        let transient = match self.hook {
            None => by_default,
            Some((classifier, head)) => {
                let seen = Attempt {
                    method: &head.method,
                    url: &head.url,
                    headers: &head.headers,
                    key: self.key,
                    number,
                    body,
                    body_unread: (outcome.is_ok() && self.policy.buffer_body_limit().is_none())
                        .then(|| classifier.0.told()),
                    outcome: match outcome {
                        Ok(response) => Outcome::Response(response),
                        Err(err) => Outcome::Error(err),
                    },
                    default: if by_default {
                        Retryable::Transient
                    } else {
                        Retryable::Fatal
                    },
                };
                classifier.0.classify(&seen) == Retryable::Transient
            }
        };
        match outcome {
            Ok(response) => match status_verdict(response.status(), transient, self.repeatable) {
                Verdict::Final(StopReason::NotRetryable) if declined => {
                    Verdict::Final(StopReason::ServerDeclinedRetry)
                }
                // Every further attempt with the key would be answered with the same replay;
                // under a key never sent, or none, the marker means nothing.
                Verdict::Transient(..) if self.key_sent && advice::replayed(response.headers()) => {
                    Verdict::Final(StopReason::ReplayedFailure)
                }
                verdict => verdict,
            },
            Err(_) => error_verdict(fault, transient, self.repeatable),
        }
    }

    /// Whether an answer is a transient failure by the default rules: its status in the
    /// policy's set (409 under a key sent before: the original is still in flight), unless the server's own verdict, when the policy
    /// heeds it, says otherwise. The second value: the server's `false` made a failure final
    /// that the status alone would have retried.
    #[inline]
    fn answer_is_transient(&self, response: &Response) -> (bool, bool) {
        let status = response.status();
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
        match advice::should_retry(response.headers()) {
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
    let kind = if status == StatusCode::TOO_MANY_REQUESTS {
        RetryKind::Throttled
    } else {
        RetryKind::Other
    };
    Verdict::Transient(kind, "status")
}

/// The verdict on an attempt that ended in an error with transient `fault` (if the default
/// rules know one) that is (or is not) transient, by the default rules or a classifier's. A
/// transient error is retried when `repeatable`, or when nothing of the request reached the
/// server: a fault the default rules do not know may have come after the request was sent.
fn error_verdict(fault: Option<Fault>, transient: bool, repeatable: bool) -> Verdict {
    if !transient {
        return Verdict::Final(StopReason::NotRetryable);
    }
    if !(repeatable || fault.is_some_and(Fault::nothing_sent)) {
        return Verdict::Final(StopReason::NotSafeToRetry);
    }
    match fault {
        Some(Fault::Timeout) => Verdict::Transient(RetryKind::Timeout, Fault::Timeout.as_str()),
        Some(fault) => Verdict::Transient(RetryKind::Other, fault.as_str()),
        None => Verdict::Transient(RetryKind::Other, "classifier"),
    }
}

/// A transport failure worth another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fault {
    /// The attempt timed out (connecting, waiting for the head, or reading a buffered body).
    Timeout,
    /// Connecting failed for a transient reason: no byte of the request reached the server.
    Connect,
    /// The connection was reset, aborted or broken after it was established.
    Reset,
    /// The server closed the connection before the response was complete.
    Incomplete,
    /// The request was not processed: an HTTP/2 stream refused with REFUSED_STREAM, or above
    /// the last stream id of a graceful GOAWAY (feature `http2`), or a connection that closed
    /// before the request was handed to it (hyper's "channel closed").
    NotProcessed,
}

impl Fault {
    pub(crate) fn as_str(self) -> &'static str {
        self.kind().as_str()
    }

    /// The public name of this kind of fault.
    pub(crate) fn kind(self) -> crate::observe::AttemptErrorKind {
        use crate::observe::AttemptErrorKind as Kind;
        match self {
            Fault::Timeout => Kind::Timeout,
            Fault::Connect => Kind::Connect,
            Fault::Reset => Kind::Reset,
            Fault::Incomplete => Kind::Incomplete,
            Fault::NotProcessed => Kind::NotProcessed,
        }
    }

    /// Whether the request certainly had no effect: no byte of it reached the server, or the
    /// server said it did not process it.
    pub(crate) fn nothing_sent(self) -> bool {
        matches!(self, Fault::Connect | Fault::NotProcessed)
    }
}

/// Whether `method` may be repeated without a key: RFC 9110 §9.2.2 idempotent methods.
pub(crate) fn is_idempotent(method: &Method) -> bool {
    matches!(
        *method,
        Method::GET | Method::HEAD | Method::OPTIONS | Method::TRACE | Method::PUT | Method::DELETE
    )
}

/// Whether `request` may be hedged (a second copy sent while the first is out): a read (GET,
/// HEAD, OPTIONS) without an idempotency key, whose body, if any, can be sent twice. Two copies
/// of a write are two writes; two copies of a keyed request race for one key.
pub(crate) fn may_be_hedged(request: &reqwest::Request, keyed: bool) -> bool {
    matches!(
        *request.method(),
        Method::GET | Method::HEAD | Method::OPTIONS
    ) && !keyed
        && request.body().is_none_or(|body| body.as_bytes().is_some())
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

/// Whether an attempt that ended in `outcome` may have reached the server, and with it the
/// key it carried: anything but a failure that certainly sent nothing.
pub(crate) fn may_have_reached(outcome: &reqwest_middleware::Result<Response>) -> bool {
    match outcome {
        Ok(_) => true,
        Err(err) => !transport_fault(err).is_some_and(Fault::nothing_sent),
    }
}

/// The transient fault behind `err`, or `None` when the error is permanent.
pub(crate) fn transport_fault(err: &reqwest_middleware::Error) -> Option<Fault> {
    match err {
        _ if crate::error::AttemptTimeout::is(err) => Some(Fault::Timeout),
        reqwest_middleware::Error::Middleware(e) => {
            // A tower service's error (feature `tower`) is judged by its causes, as a
            // transport error.
            #[cfg(feature = "tower")]
            if let Some(service) = e.downcast_ref() {
                return service_fault(service);
            }
            // Another middleware's error, including one from an inner instance of ours that
            // has already given up: never ours to repeat.
            let _ = e;
            None
        }
        reqwest_middleware::Error::Reqwest(e) => reqwest_fault(e),
    }
}

/// The transient fault behind a tower service's error: the same causes as behind reqwest's,
/// and a connect failure of hyper-util's client told apart as reqwest's is (nothing was sent).
#[cfg(feature = "tower")]
fn service_fault(err: &crate::door::tower::ServiceError) -> Option<Fault> {
    let err: &(dyn std::error::Error + 'static) = &*err.0;
    let cause = chain_fault(err);
    let mut source = Some(err);
    // Bounded, as every walk of a chain here.
    for _ in 0..64 {
        let Some(at) = source else { break };
        if let Some(client) = at.downcast_ref::<hyper_util::client::legacy::Error>() {
            if client.is_connect() {
                let passing = cause.is_some() || resolution_failed(err);
                return passing.then_some(Fault::Connect);
            }
        }
        source = at.source();
    }
    cause
}

fn reqwest_fault(err: &reqwest::Error) -> Option<Fault> {
    if err.is_builder() || err.is_redirect() || err.is_status() {
        return None;
    }
    if err.is_timeout() {
        return Some(Fault::Timeout);
    }
    let cause = err.source().and_then(chain_fault);
    if err.is_connect() {
        return connect_fault(cause, err);
    }
    cause
}

/// What a connect error stands for. Only causes known to be passing make it transient: a
/// certificate that failed to verify will fail the same way again. A name that did not resolve
/// is transient: resolvers time out and lose their upstreams, and nothing was sent.
fn connect_fault(cause: Option<Fault>, err: &reqwest::Error) -> Option<Fault> {
    let passing = cause.is_some() || err.source().is_some_and(resolution_failed);
    passing.then_some(Fault::Connect)
}

/// What hyper's connector calls the error of a name that could not be resolved, whatever the
/// resolver (the system's, hickory's, or one given to reqwest's `dns_resolver`) said.
const DNS_ERROR: &str = "dns error";

/// Whether `err` or one of its sources is a failure to resolve the host name. hyper's
/// connector error is not public, so it is known by its message, written into a fixed buffer
/// (no allocation, and a message of any length is compared in bounded time).
fn resolution_failed(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    // Bounded: no real chain is this deep, and a cycle must not loop for ever.
    for _ in 0..64 {
        let Some(cause) = source else {
            return false;
        };
        if displays_as(cause, DNS_ERROR) {
            return true;
        }
        source = cause.source();
    }
    false
}

/// Whether `value` displays exactly as `text`.
fn displays_as(value: &dyn std::fmt::Display, text: &str) -> bool {
    /// Compares what is written with the rest of `text`, and stops at the first difference.
    struct Compare<'t>(&'t str);
    impl std::fmt::Write for Compare<'_> {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            match self.0.strip_prefix(s) {
                Some(rest) => {
                    self.0 = rest;
                    Ok(())
                }
                None => Err(std::fmt::Error),
            }
        }
    }
    let mut compare = Compare(text);
    std::fmt::write(&mut compare, format_args!("{value}")).is_ok() && compare.0.is_empty()
}

/// The first transient cause found in `err` or its sources.
fn chain_fault(err: &(dyn std::error::Error + 'static)) -> Option<Fault> {
    let mut source = Some(err);
    // Bounded: no real chain is this deep, and a cycle must not loop for ever.
    for _ in 0..64 {
        let cause = source?;
        if let Some(io) = cause.downcast_ref::<io::Error>() {
            if let Some(fault) = io_fault(io) {
                return Some(fault);
            }
        }
        #[cfg(feature = "http2")]
        if let Some(h2) = cause.downcast_ref::<h2::Error>() {
            return h2_fault(h2);
        }
        if let Some(hyper) = cause.downcast_ref::<hyper::Error>() {
            if hyper.is_timeout() {
                return Some(Fault::Timeout);
            }
            if hyper.is_incomplete_message() || hyper.is_canceled() {
                return Some(Fault::Incomplete);
            }
            // The connection had closed before the request was handed to it (an HTTP/2
            // GOAWAY before any stream, an HTTP/1 connection gone while idle): no byte of it
            // was written.
            if hyper.is_closed() {
                return Some(Fault::NotProcessed);
            }
        }
        source = cause.source();
    }
    None
}

/// The transient fault an HTTP/2 error stands for (RFC 9113 §8.7): a stream the server refused,
/// or left above a graceful GOAWAY's last stream id, was not processed and is safe to send again
/// whatever its method; any other reset or connection failure may have come after processing.
/// Errors this side raised itself are not transient.
#[cfg(feature = "http2")]
fn h2_fault(err: &h2::Error) -> Option<Fault> {
    if let Some(io) = err.get_io() {
        return io_fault(io).or(Some(Fault::Reset));
    }
    if !err.is_remote() {
        return None;
    }
    match err.reason() {
        Some(h2::Reason::REFUSED_STREAM) if err.is_reset() => Some(Fault::NotProcessed),
        Some(h2::Reason::NO_ERROR) if err.is_go_away() => Some(Fault::NotProcessed),
        Some(_) => Some(Fault::Reset),
        None => None,
    }
}

/// The transient fault an I/O error stands for. An error of another kind may wrap one that is
/// decisive (reqwest's TLS connector wraps a reset during the handshake in an error of kind
/// `Other`), and `io::Error::source` skips the wrapped error itself, so it is looked into here.
fn io_fault(io: &io::Error) -> Option<Fault> {
    let mut io = io;
    for _ in 0..8 {
        match io.kind() {
            io::ErrorKind::TimedOut => return Some(Fault::Timeout),
            io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected => return Some(Fault::Reset),
            io::ErrorKind::UnexpectedEof => return Some(Fault::Incomplete),
            _ => {}
        }
        io = io.get_ref()?.downcast_ref::<io::Error>()?;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

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
                Verdict::Transient(RetryKind::Other, "status"),
            ),
            (
                429,
                true,
                false,
                Verdict::Transient(RetryKind::Throttled, "status"),
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
                Verdict::Transient(RetryKind::Other, "status"),
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
        let response = http::Response::builder().status(status).body("").unwrap();
        judging.verdict(&Ok(Response::from(response)), 1)
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
        let answer = classifier.flatten();
        let hook: Shared<dyn Classifier> =
            Shared(std::sync::Arc::new(crate::engine::classifier::Hook {
                classify: move |a: &Attempt<'_>| answer.unwrap_or(a.default_verdict()),
                told: Default::default(),
            }));
        let head = RequestHead {
            method: Method::GET,
            url: "http://127.0.0.1/".parse().unwrap(),
            headers: http::HeaderMap::new(),
        };
        let judging = Judging {
            policy,
            repeatable,
            key: keyed.then_some(&key),
            key_sent: keyed,
            hook: classifier.is_some().then_some((&hook, &head)),
        };
        let mut response = http::Response::builder().status(status);
        for (name, value) in lines {
            response = response.header(*name, *value);
        }
        judging.verdict(&Ok(Response::from(response.body("").unwrap())), 1)
    }

    #[test]
    fn the_server_s_verdict_turns_a_failure_final_or_transient_within_the_safety_rule() {
        use StopReason::*;
        let policy = RetryPolicy::default();
        const NO: [(&str, &str); 1] = [("x-should-retry", "false")];
        const YES: [(&str, &str); 1] = [("x-should-retry", "true")];
        let (no, yes) = (&NO, &YES);
        let stripe_yes = &[("stripe-should-retry", "true")];
        let retried = Verdict::Transient(RetryKind::Other, "status");
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
                Verdict::Transient(RetryKind::Throttled, "status"),
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
        let retried = Verdict::Transient(RetryKind::Other, "status");
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
            Verdict::Transient(RetryKind::Other, "status")
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
            let mut response = http::Response::builder().status(status);
            if replayed {
                response = response.header("idempotent-replayed", "true");
            }
            let response = Response::from(response.body("").unwrap());
            judging.verdict(&Ok(response), 1)
        };
        let retried = Verdict::Transient(RetryKind::Other, "status");
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

    #[test]
    fn only_an_error_that_certainly_sent_nothing_kept_the_key_from_the_server() {
        let ok = Response::from(http::Response::new(""));
        assert!(may_have_reached(&Ok(ok)));
        let timeout = Err(crate::driver::claim::timed_out(
            std::time::Duration::from_millis(5),
        ));
        assert!(may_have_reached(&timeout));
        let other = Err(reqwest_middleware::Error::middleware(io::Error::other("x")));
        assert!(may_have_reached(&other));
    }

    #[tokio::test]
    async fn a_refused_connection_kept_the_key_from_the_server() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        drop(listener);
        let refused = reqwest::Client::new()
            .get(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap_err();
        assert!(!may_have_reached(&Err(reqwest_middleware::Error::Reqwest(
            refused
        ))));
    }

    /// The verdict on an attempt that ended in `err`.
    fn judge_error(err: reqwest_middleware::Error, repeatable: bool) -> Verdict {
        let policy = RetryPolicy::default();
        let judging = Judging {
            policy: &policy,
            repeatable,
            key: None,
            key_sent: false,
            hook: None,
        };
        judging.verdict(&Err(err), 1)
    }

    #[test]
    fn a_message_is_compared_whole_however_it_is_written() {
        /// Writes its parts one by one, as a `Display` of several `write!`s does.
        struct Parts(&'static [&'static str]);
        impl std::fmt::Display for Parts {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                self.0.iter().try_for_each(|part| f.write_str(part))
            }
        }
        assert!(displays_as(&Parts(&["dns error"]), DNS_ERROR));
        assert!(displays_as(&Parts(&["dns", " ", "error"]), DNS_ERROR));
        assert!(!displays_as(&Parts(&["dns"]), DNS_ERROR), "a prefix");
        assert!(
            !displays_as(&Parts(&["dns error: more"]), DNS_ERROR),
            "longer"
        );
        assert!(
            !displays_as(&Parts(&["dns error", "!"]), DNS_ERROR),
            "longer"
        );
        assert!(!displays_as(&Parts(&["tcp connect error"]), DNS_ERROR));
        assert!(displays_as(&Parts(&[]), ""));
    }

    #[test]
    fn a_resolution_failure_is_found_anywhere_in_the_chain() {
        #[derive(Debug)]
        struct Wrap(&'static str, Option<Box<Wrap>>);
        impl std::fmt::Display for Wrap {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.0)
            }
        }
        impl std::error::Error for Wrap {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                self.1.as_deref().map(|e| e as _)
            }
        }
        let deep = Wrap(
            "client error (Connect)",
            Some(Box::new(Wrap(
                "dns error",
                Some(Box::new(Wrap("no upstream", None))),
            ))),
        );
        assert!(resolution_failed(&deep));
        assert!(resolution_failed(&Wrap("dns error", None)));
        let refused = Wrap(
            "client error (Connect)",
            Some(Box::new(Wrap("tcp connect error", None))),
        );
        assert!(!resolution_failed(&refused));
    }

    #[test]
    fn errors_are_judged_by_their_fault_and_the_method() {
        let timeout = || {
            reqwest_middleware::Error::middleware(crate::error::AttemptTimeout {
                after: std::time::Duration::from_secs(1),
            })
        };
        assert_eq!(
            judge_error(timeout(), true),
            Verdict::Transient(RetryKind::Timeout, "timeout")
        );
        // A timeout may have reached the server: not for an unkeyed POST.
        assert_eq!(
            judge_error(timeout(), false),
            Verdict::Final(StopReason::NotSafeToRetry)
        );
        let other = reqwest_middleware::Error::middleware(io::Error::other("not ours"));
        assert_eq!(
            judge_error(other, true),
            Verdict::Final(StopReason::NotRetryable)
        );
    }

    #[test]
    fn only_a_connect_fault_guarantees_nothing_was_sent() {
        assert!(Fault::Connect.nothing_sent());
        for f in [Fault::Timeout, Fault::Reset, Fault::Incomplete] {
            assert!(!f.nothing_sent(), "{f:?}");
        }
    }

    fn io(kind: io::ErrorKind, text: &str) -> io::Error {
        io::Error::new(kind, text.to_owned())
    }

    #[test]
    fn passing_socket_failures_are_transient() {
        for (kind, fault) in [
            (io::ErrorKind::ConnectionRefused, Fault::Reset),
            (io::ErrorKind::ConnectionReset, Fault::Reset),
            (io::ErrorKind::ConnectionAborted, Fault::Reset),
            (io::ErrorKind::BrokenPipe, Fault::Reset),
            (io::ErrorKind::TimedOut, Fault::Timeout),
            (io::ErrorKind::UnexpectedEof, Fault::Incomplete),
        ] {
            assert_eq!(chain_fault(&io(kind, "socket")), Some(fault), "{kind:?}");
        }
    }

    /// TLS failures reach reqwest as `InvalidData` I/O errors wrapping the TLS library's error
    /// (a certificate that does not verify, a handshake the peer botched): nothing in them
    /// says "try again", and trying again would fail the same way.
    #[test]
    fn certificate_and_other_permanent_failures_are_not_transient() {
        for (kind, text) in [
            (
                io::ErrorKind::InvalidData,
                "invalid peer certificate: UnknownIssuer",
            ),
            (io::ErrorKind::InvalidData, "received corrupt message"),
            (io::ErrorKind::PermissionDenied, "permission denied"),
            (io::ErrorKind::Other, "failed to lookup address information"),
        ] {
            assert_eq!(chain_fault(&io(kind, text)), None, "{text}");
        }
    }

    /// A wrapper around a cause, as hyper and reqwest wrap theirs.
    #[derive(Debug)]
    struct Wrapped(io::Error);

    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("while connecting")
        }
    }

    impl std::error::Error for Wrapped {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn an_io_error_wrapping_a_decisive_one_is_judged_by_it() {
        // How reqwest's TLS connector reports a reset during the handshake.
        let wrapped = io::Error::other(io(io::ErrorKind::ConnectionReset, "reset by peer"));
        assert_eq!(wrapped.kind(), io::ErrorKind::Other);
        assert_eq!(chain_fault(&wrapped), Some(Fault::Reset));
        let certificate = io::Error::new(
            io::ErrorKind::InvalidData,
            io(io::ErrorKind::Other, "invalid peer certificate"),
        );
        assert_eq!(chain_fault(&certificate), None);
    }

    /// hyper's "channel closed": the connection had ended before the request was handed to
    /// it (a GOAWAY before any stream, an idle connection gone), so no byte of it was sent.
    #[tokio::test]
    async fn a_connection_closed_before_the_request_was_handed_to_it_sent_nothing() {
        let (near, _far) = tokio::io::duplex(64);
        let io = hyper_util::rt::TokioIo::new(near);
        let (mut sender, connection) = hyper::client::conn::http1::handshake::<_, String>(io)
            .await
            .unwrap();
        drop(connection);
        let closed = sender.ready().await.unwrap_err();
        assert!(closed.is_closed(), "{closed:?}");
        assert_eq!(chain_fault(&closed), Some(Fault::NotProcessed));
        assert!(Fault::NotProcessed.nothing_sent());
    }

    #[test]
    fn causes_are_found_deep_in_the_chain() {
        let refused = Wrapped(io(io::ErrorKind::ConnectionRefused, "refused"));
        assert_eq!(chain_fault(&refused), Some(Fault::Reset));
        let certificate = Wrapped(io(io::ErrorKind::InvalidData, "invalid peer certificate"));
        assert_eq!(chain_fault(&certificate), None);
    }

    #[test]
    fn builder_errors_are_permanent() {
        let client = reqwest::Client::new();
        let err = client.get("not a url").build().unwrap_err();
        assert!(err.is_builder());
        assert_eq!(transport_fault(&err.into()), None);
    }

    #[test]
    fn other_middleware_errors_are_permanent() {
        let err = reqwest_middleware::Error::middleware(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "from another middleware",
        ));
        assert_eq!(transport_fault(&err), None);
    }
}
