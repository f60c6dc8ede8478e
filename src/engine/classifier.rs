//! A hook to say which outcomes are transient: wider or narrower than the default rules.
//!
//! The default rules (see the crate docs) call a timeout, a refused or reset connection, a
//! response cut short, and a status in the policy's set (408, 429, 502, 503, 504 by default; 409 for
//! a keyed request) transient, and everything else final. A classifier on a
//! [`Dependency`](crate::Dependency) replaces that one question, with the request and the
//! outcome in view: "a 503 from `/reports` is final", "this error of my own middleware is
//! transient", "a 200 whose `X-Status` says `pending` is worth another try".
//!
//! It answers only whether the failure is transient. Whether repeating is *safe* stays the
//! middleware's rule and a classifier cannot loosen it: a request that is neither idempotent
//! nor keyed is repeated only when nothing of it reached the server (a connect error), however
//! loudly a classifier says "transient". The attempt limit, the deadline, `Retry-After` and the
//! budget apply as always.

use std::error::Error;
use std::sync::atomic::AtomicBool;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, StatusCode, Uri, Version};

use crate::engine::seen::ResponseHead;
use crate::fault::AttemptErrorKind;
use crate::fault::Fault;

/// Whether an attempt's outcome is worth another attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Retryable {
    /// A failure that may well go differently next time: retry it, if that is safe and the
    /// limits allow.
    Transient,
    /// An outcome to hand back as it is: a success, or a failure that repeating would not
    /// change.
    Fatal,
}

/// What an attempt ended in, the same behind either door.
#[derive(Debug, Clone, Copy)]
pub enum Outcome<'a> {
    /// The server answered: the answer's head (its body has not been read, unless the
    /// policy's `buffer_body` read it: then [`Attempt::body`] has it).
    Response(ResponseHead<'a>),
    /// No answer: a transport error, the attempt's timeout, or another layer's error. Behind
    /// the `reqwest-middleware` door it is reqwest's own `Error`, or the error another
    /// middleware returned; behind the tower door, the inner service's own error. Downcast it
    /// to the client's error type to look into it, and see [`Attempt::error_kind`] for what
    /// the default rules made of it.
    Error(&'a (dyn Error + 'static)),
}

/// One attempt, as a [classifier](crate::Dependency::with_classifier) sees it: the request and its outcome, and what the default
/// rules make of it.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    pub(crate) method: &'a Method,
    pub(crate) uri: &'a Uri,
    pub(crate) headers: &'a HeaderMap,
    pub(crate) key: Option<&'a HeaderValue>,
    pub(crate) number: u32,
    pub(crate) body: Option<&'a Bytes>,
    /// An answer whose body the policy does not read (no `buffer_body`): the classifier's
    /// flag, so that one that asks for it is told, once, how to get it.
    pub(crate) body_unread: Option<&'a AtomicBool>,
    pub(crate) outcome: Outcome<'a>,
    /// The transient fault the door found in an error, if any.
    pub(crate) fault: Option<Fault>,
    pub(crate) default: Retryable,
}

impl<'a> Attempt<'a> {
    /// The request's method.
    pub fn method(&self) -> &'a Method {
        self.method
    }

    /// The request's URI, absolute (scheme, authority, path and query) behind either door.
    pub fn uri(&self) -> &'a Uri {
        self.uri
    }

    /// The request's headers as the caller built it (the idempotency key the middleware stamps
    /// is not among them: see [`idempotency_key`](Self::idempotency_key)).
    pub fn headers(&self) -> &'a HeaderMap {
        self.headers
    }

    /// The idempotency key the attempt carried, the caller's or the middleware's.
    pub fn idempotency_key(&self) -> Option<&'a HeaderValue> {
        self.key
    }

    /// Which attempt this was, from 1.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// What the attempt ended in.
    pub fn outcome(&self) -> Outcome<'a> {
        self.outcome
    }

    /// The answer's body, when the policy's
    /// [`buffer_body`](crate::RetryPolicyBuilder::buffer_body) read it whole before asking the
    /// classifier (the same bytes the caller gets, not a copy): a classifier can then tell a
    /// 500 whose body says "maintenance" from another. `None` without `buffer_body`, for a body
    /// longer than its limit (which is handed back as a stream, unread), and for an error.
    /// With `buffer_body` and a classifier, every answer's body is read before the classifier
    /// is asked, inside the attempt's time.
    ///
    /// A classifier that asks for an answer's body under a policy without `buffer_body` gets
    /// `None` every time, so the rule it meant never fires: the first such call of each
    /// classifier logs a WARN event (target `reqwest_safe_retry`) naming the setting that turns it on.
    /// (The middleware cannot see into the closure to refuse it when the dependency is built,
    /// and reading every body for every classifier would cost those that never look.)
    pub fn body(&self) -> Option<&'a Bytes> {
        let unread = self.body_unread;
        if unread.is_some_and(|told| !told.swap(true, std::sync::atomic::Ordering::Relaxed)) {
            tracing::warn!(
                target: "reqwest_safe_retry",
                "a classifier asked for an answer's body, but the policy does not read bodies: \
                 Attempt::body() is always None; turn it on with \
                 RetryPolicy::builder().buffer_body(limit)"
            );
        }
        self.body
    }

    /// The response's status, if the server answered: a shorthand for matching
    /// [`outcome`](Self::outcome) on [`Outcome::Response`].
    pub fn status(&self) -> Option<StatusCode> {
        match self.outcome {
            Outcome::Response(response) => Some(response.status()),
            Outcome::Error(_) => None,
        }
    }

    /// The HTTP version the answer came over, if the server answered.
    pub fn version(&self) -> Option<Version> {
        match self.outcome {
            Outcome::Response(response) => Some(response.version()),
            Outcome::Error(_) => None,
        }
    }

    /// The attempt's error, if it got no answer: a shorthand for matching
    /// [`outcome`](Self::outcome) on [`Outcome::Error`].
    pub fn error(&self) -> Option<&'a (dyn Error + 'static)> {
        match self.outcome {
            Outcome::Response(_) => None,
            Outcome::Error(error) => Some(error),
        }
    }

    /// What kind of failure the default rules found in the attempt's error (a timeout, a
    /// refused or reset connection, a response cut off, a request the server did not process),
    /// or [`AttemptErrorKind::Permanent`] for one they would not retry; `None` for an answer.
    pub fn error_kind(&self) -> Option<AttemptErrorKind> {
        match self.outcome {
            Outcome::Response(_) => None,
            Outcome::Error(_) => Some(self.fault.map_or(AttemptErrorKind::Permanent, Fault::kind)),
        }
    }

    /// What the default rules make of the outcome under the dependency's policy: a classifier
    /// returns it for every case it has no rule of its own for.
    pub fn default_verdict(&self) -> Retryable {
        self.default
    }
}

/// The classifier as a dependency keeps it: any `Fn(&Attempt<'_>) -> Retryable` closure; see
/// [`Dependency::with_classifier`](crate::Dependency::with_classifier).
pub(crate) trait Classifier: Send + Sync + 'static {
    /// Whether `attempt`'s outcome is transient. Called once per attempt, before the safety
    /// rule and the limits (with `buffer_body`, after the body was read, or on the error that
    /// reading it ended in); keep it quick, it runs on the request's task.
    fn classify(&self, attempt: &Attempt<'_>) -> Retryable;

    /// Whether this classifier was told that its policy reads no bodies (once).
    fn told(&self) -> &AtomicBool;
}

/// A classifier closure, with whether it was told that its policy reads no bodies.
pub(crate) struct Hook<F> {
    pub(crate) classify: F,
    pub(crate) told: AtomicBool,
}

impl<F> Classifier for Hook<F>
where
    F: Fn(&Attempt<'_>) -> Retryable + Send + Sync + 'static,
{
    fn classify(&self, attempt: &Attempt<'_>) -> Retryable {
        (self.classify)(attempt)
    }

    fn told(&self) -> &AtomicBool {
        &self.told
    }
}

impl crate::shared::Named for dyn Classifier {
    const NAME: &'static str = "Classifier";
}

/// What a classifier needs of the request after it has gone down the chain: kept only for a
/// dependency that has one.
#[derive(Debug)]
pub(crate) struct RequestHead {
    pub(crate) method: Method,
    pub(crate) uri: Uri,
    pub(crate) headers: HeaderMap,
}
