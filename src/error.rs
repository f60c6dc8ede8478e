//! What the caller learns when a logical request ends: how many attempts ran and why retrying
//! stopped.
//!
//! A response always comes back as `Ok`, whatever its status, with a record (`record.rs`). An
//! error comes back as a [`RetryError`] inside [`reqwest_middleware::Error::Middleware`];
//! [`RetryError::of`] finds it, and it answers the questions one asks a `reqwest::Error`, by
//! the names [`RetryErrorExt`](crate::RetryErrorExt) asks them of any `reqwest_middleware::Error` (whose own methods
//! cannot see inside a middleware's error): `timed_out()`, `failed_to_connect()`,
//! `last_status()`, `strip_url()`. Also here: the configuration error, and the causes the middleware
//! puts in its errors.
//!
//! [`RetryError`], [`InvalidConfig`] and [`BoxError`] are at the crate root too, where most code
//! names them: the same types. This module adds what only code that takes an error apart needs
//! ([`LastError`], [`NotSent`], [`AttemptTimeout`]) and the trait a door's error implements
//! ([`DoorError`]).

use std::fmt;
use std::time::Duration;

use http::HeaderValue;
use http::StatusCode;
use url::Url;

use crate::fault::{AttemptErrorKind, Fault};
use crate::record::{RetryRecord, Tally};
use crate::stop::StopReason;

/// An error as tower passes errors, and as the tower door hands back the inner service's:
/// boxed. The tower door's [`RetryError`] is a `RetryError<BoxError>`.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Defines [`RetryError`]: its type parameter defaults to the reqwest door's error when that
/// door is built (feature `reqwest`, on by default), and has no default otherwise.
macro_rules! retry_error {
    ($($default:ty)?) => {
        /// The error of a logical request: the last attempt's error, with the attempt count and the
        /// reason retrying stopped.
        ///
        /// `E` is the error of what lies beneath the door: `reqwest_middleware::Error` behind the
        /// reqwest door (the default), the inner service's error boxed ([`BoxError`]) behind the tower
        /// door. The last error is that error, or one of the layer's own ([`LastError`]).
        ///
        /// The reqwest door returns it as [`reqwest_middleware::Error::Middleware`]; get it back with
        /// [`RetryError::of`]:
        ///
        /// ```no_run
        /// # async fn run(client: reqwest_middleware::ClientWithMiddleware) {
        /// use reqwest_safe_retry::RetryError;
        ///
        /// if let Err(err) = client.get("http://127.0.0.1:9/").send().await {
        ///     let retry = RetryError::of(&err).expect("every error of the middleware is a RetryError");
        ///     if retry.failed_to_connect() {
        ///         eprintln!("unreachable after {} attempts ({})", retry.attempts(), retry.stop_reason());
        ///     }
        /// }
        /// # }
        /// ```
        ///
        /// The tower door returns it boxed: `err.downcast_ref::<RetryError<BoxError>>()`.
        pub struct RetryError<E $(= $default)?> {
            attempts: u32,
            stop: StopReason,
            key: Option<HeaderValue>,
            waited: Duration,
            /// The request's URL, for a last error that carries none (an attempt timeout, another
            /// middleware's error, nothing sent).
            url: Option<Url>,
            /// The capacity of the budget that refused a retry, for the message.
            budget: Option<f64>,
            last: LastError<E>,
            /// The transient fault the door found in the last error, if any.
            fault: Option<Fault>,
            /// What gRPC's metrics count of its attempts.
            tally: Tally,
        }
    };
}

#[cfg(feature = "reqwest")]
retry_error!(reqwest_middleware::Error);
#[cfg(not(feature = "reqwest"))]
retry_error!();

/// The last error of a [`RetryError`]: what the chain or the service beneath returned, or one
/// of the layer's own (an attempt it cut at its timeout, a request it did not send).
///
/// Its message and [`source`](std::error::Error::source) are those of the error it holds.
#[derive(Debug)]
#[non_exhaustive]
pub enum LastError<E> {
    /// What the rest of the chain (the reqwest door) or the inner service (the tower door)
    /// returned for the last attempt, or the error its answer's body ended in while the layer
    /// read it.
    Beneath(E),
    /// The last attempt outlasted the policy's attempt timeout, and the layer cut it.
    TimedOut(AttemptTimeout),
    /// The layer sent no attempt (or kept no outcome of one): why.
    NotSent(NotSent),
}

impl<E> LastError<E> {
    /// The error of the chain or the service beneath, if that is what this is.
    pub fn beneath(&self) -> Option<&E> {
        match self {
            LastError::Beneath(e) => Some(e),
            _ => None,
        }
    }

    /// The error of the chain or the service beneath, by value, if that is what this is.
    pub fn into_beneath(self) -> Option<E> {
        match self {
            LastError::Beneath(e) => Some(e),
            _ => None,
        }
    }

    /// The fault behind one of the layer's own errors: its attempt timeout. Every other error
    /// of its own (nothing sent) is permanent; the door judges the errors beneath.
    pub(crate) fn own_fault(&self) -> Option<Fault> {
        matches!(self, LastError::TimedOut(_)).then_some(Fault::Timeout)
    }
}

impl<E: DoorError> LastError<E> {
    /// The error it holds, whose sources can be walked.
    pub(crate) fn as_error(&self) -> &(dyn std::error::Error + 'static) {
        match self {
            LastError::Beneath(e) => e.as_error(),
            LastError::TimedOut(e) => e,
            LastError::NotSent(e) => e,
        }
    }
}

impl<E: DoorError> fmt::Display for LastError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LastError::Beneath(e) => fmt::Display::fmt(e, f),
            LastError::TimedOut(e) => fmt::Display::fmt(e, f),
            LastError::NotSent(e) => fmt::Display::fmt(e, f),
        }
    }
}

impl<E: DoorError> std::error::Error for LastError<E> {
    /// The source of the error it holds: the two print and walk as one.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.as_error().source()
    }
}

/// The error of what lies beneath a door: `reqwest_middleware::Error` (the reqwest door) or
/// [`BoxError`] (the tower door). What a [`RetryError`] asks of its last error is asked of it.
/// The trait is sealed, and its methods are the crate's own.
pub trait DoorError:
    sealed::Sealed + From<RetryError<Self>> + fmt::Debug + fmt::Display + Send + Sync + 'static
{
    /// The error, as one whose sources can be walked.
    #[doc(hidden)]
    fn as_error(&self) -> &(dyn std::error::Error + 'static);
    /// Whether it says it failed to connect.
    #[doc(hidden)]
    fn is_connect(&self) -> bool {
        false
    }
    /// Whether it says time ran out.
    #[doc(hidden)]
    fn is_timeout(&self) -> bool {
        false
    }
    /// The status it carries, if any.
    #[doc(hidden)]
    fn status(&self) -> Option<StatusCode> {
        None
    }
    /// The URL it carries, taken out whole, with only what may be printed left in it.
    #[doc(hidden)]
    fn hide_url(&mut self) -> Option<Url> {
        None
    }
    /// The same error without any URL.
    #[doc(hidden)]
    #[must_use]
    fn without_url(self) -> Self
    where
        Self: Sized,
    {
        self
    }
}

/// A boxed error, as the tower door hands back the inner service's: it says nothing of
/// itself; the fault its door found in it answers for it.
impl DoorError for BoxError {
    fn as_error(&self) -> &(dyn std::error::Error + 'static) {
        &**self
    }
}

impl<E> RetryError<E> {
    pub(crate) fn new(
        attempts: u32,
        stop: StopReason,
        key: Option<HeaderValue>,
        last: LastError<E>,
    ) -> Self {
        RetryError {
            attempts,
            stop,
            key,
            waited: Duration::ZERO,
            url: None,
            budget: None,
            last,
            fault: None,
            tally: Tally::default(),
        }
    }

    /// With the transient fault the door found in the last error.
    pub(crate) fn with_fault(mut self, fault: Option<Fault>) -> Self {
        self.fault = fault;
        self
    }

    /// With the capacity of the budget that refused its retry, which the message names.
    pub(crate) fn with_budget(mut self, capacity: Option<f64>) -> Self {
        self.budget = capacity;
        self
    }

    /// With what gRPC's metrics count of its attempts.
    pub(crate) fn with_tally(mut self, tally: Tally) -> Self {
        self.tally = tally;
        self
    }

    /// The total time the request spent waiting, before its first attempt (a spent quota's
    /// hold) and between attempts, on the middleware's clock, as
    /// [`RetryRecord::waited`](crate::RetryRecord::waited) says of a response.
    /// [`RetryErrorExt::waited`](crate::RetryErrorExt::waited) asks the same of a `reqwest_middleware::Error`.
    pub fn waited(&self) -> Duration {
        self.waited
    }

    /// The idempotency header value the attempts carried, if any. Send it again with the same
    /// request later, and a server that dedupes on it will not repeat the effect.
    pub fn idempotency_key(&self) -> Option<&HeaderValue> {
        self.key.as_ref()
    }

    /// How many attempts were made, the first included. [`RetryErrorExt::attempts`](crate::RetryErrorExt::attempts) is `None`
    /// for an error that did not come from this middleware.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Why no further attempt was made. [`RetryErrorExt::stop_reason`](crate::RetryErrorExt::stop_reason) is `None` for an error
    /// that did not come from this middleware.
    pub fn stop_reason(&self) -> StopReason {
        self.stop
    }

    /// The last attempt's error: what the chain or the service beneath returned
    /// ([`LastError::Beneath`]), or the layer's own.
    pub fn last_error(&self) -> &LastError<E> {
        &self.last
    }

    /// The last attempt's error, by value.
    pub fn into_last_error(self) -> LastError<E> {
        self.last
    }

    /// What went wrong at the last attempt, as the retry rules read it: a timeout, a failed
    /// connection, a reset, an answer cut off, a refusal the protocol says was not processed,
    /// or [`Permanent`](AttemptErrorKind::Permanent) for any other error. `None` when no
    /// attempt was sent (the reason says why).
    pub fn last_error_kind(&self) -> Option<AttemptErrorKind> {
        (self.attempts > 0).then(|| (self.fault).map_or(AttemptErrorKind::Permanent, Fault::kind))
    }

    /// The request's record, as a response's [`RetryRecord::of`](crate::RetryRecord::of) reads
    /// it: attempts, stop reason, time waited and key. One report for a give-up, whether the
    /// call ended `Ok` with a transient answer after its attempts ran out or `Err`:
    ///
    /// ```no_run
    /// # async fn run(client: reqwest_middleware::ClientWithMiddleware) {
    /// use reqwest_safe_retry::{RetryError, RetryRecord};
    ///
    /// let record = match client.get("http://127.0.0.1:9/").send().await {
    ///     Ok(response) => RetryRecord::of(&response),
    ///     Err(err) => RetryError::of(&err).map(RetryError::record),
    /// };
    /// if let Some(record) = record.filter(|r| r.attempts() > 1) {
    ///     eprintln!("{} attempts, stopped: {}", record.attempts(), record.stop_reason());
    /// }
    /// # }
    /// ```
    pub fn record(&self) -> RetryRecord {
        RetryRecord {
            attempts: self.attempts,
            stop: self.stop,
            waited: self.waited,
            key: self.key.clone(),
            replayed: false,
            answered_by_hedge: false,
            tally: self.tally,
        }
    }
}

impl<E: DoorError> RetryError<E> {
    /// With the time the request waited, and its URL: the one the last error carries, kept
    /// here whole while the error's own loses its query (which may carry a token) and its
    /// user name and password, so that nothing this error prints shows them; else the
    /// request's.
    pub(crate) fn with(mut self, waited: Duration, url: Option<&Url>) -> Self {
        self.waited = waited;
        self.url = match &mut self.last {
            LastError::Beneath(e) => e.hide_url(),
            _ => None,
        }
        .or_else(|| url.cloned());
        self
    }

    /// Whether the last attempt timed out: the client's own timeout (reqwest's, set on the
    /// client or the request), the policy's per-attempt timeout, or a connection that did not
    /// open in time (a connect timeout, which is also
    /// [`failed_to_connect`](Self::failed_to_connect): nothing was sent).
    /// [`RetryErrorExt::timed_out`](crate::RetryErrorExt::timed_out) asks the same of a `reqwest_middleware::Error`, from this
    /// middleware or not.
    #[doc(alias = "is_timeout")]
    pub fn timed_out(&self) -> bool {
        // Every timeout is a transient fault of its door's reading (reqwest's own by what it
        // says of itself), and a connect timeout a failed connection that timed out: by what
        // the error says of itself (reqwest's connect timer, whose error is its own type) or by
        // a cause (its connector's timer, an I/O error).
        match self.fault {
            Some(Fault::Timeout) => true,
            Some(Fault::Connect) => {
                self.last.beneath().is_some_and(DoorError::is_timeout)
                    || crate::fault::timed_out_in(self.last.as_error())
            }
            _ => false,
        }
    }

    /// Whether the last attempt failed to connect (the host name could not be resolved, or the
    /// connection was refused): nothing of the request was sent.
    /// [`RetryErrorExt::failed_to_connect`](crate::RetryErrorExt::failed_to_connect) asks the same of any `reqwest_middleware::Error`.
    #[doc(alias = "is_connect")]
    pub fn failed_to_connect(&self) -> bool {
        self.last.beneath().is_some_and(DoorError::is_connect) || self.fault == Some(Fault::Connect)
    }

    /// The status code the last attempt's error carries, if any (reqwest's `error_for_status`
    /// in an inner middleware makes one). [`RetryErrorExt::last_status`](crate::RetryErrorExt::last_status) asks the same of any
    /// `reqwest_middleware::Error`.
    #[doc(alias = "status")]
    pub fn last_status(&self) -> Option<StatusCode> {
        self.last.beneath().and_then(DoorError::status)
    }

    /// The URL of the last attempt, whatever ended it: the URL the last error carries (a
    /// redirect may have moved it), else the request's (the policy's attempt timeout cut it,
    /// another middleware failed it, or nothing was sent). `None` only after
    /// [`strip_url`](Self::strip_url). [`RetryErrorExt::last_url`](crate::RetryErrorExt::last_url) asks the same of a
    /// `reqwest_middleware::Error`. The URL as written, with any user name and password in it:
    /// for a log line, print [`url_without_query`](Self::url_without_query).
    pub fn url(&self) -> Option<&Url> {
        // Taken out of the last error whole when the error was made (`with`), or the request's.
        self.url.as_ref()
    }

    /// The last attempt's URL without its query, its fragment, and any user name and password
    /// written in it (`https://user:secret@host/`), for a log line: a query may carry a
    /// token. The error's message and `Debug` never show any of them either.
    pub fn url_without_query(&self) -> Option<Url> {
        self.url().map(printable)
    }

    /// The same error without any URL: the last attempt's error forgets it (reqwest's
    /// `without_url`), so neither [`url`](Self::url) nor the message shows it, nor its query
    /// (which may carry a token). [`RetryErrorExt::strip_url`](crate::RetryErrorExt::strip_url) does the same to any
    /// `reqwest_middleware::Error`.
    #[doc(alias = "without_url")]
    #[must_use]
    pub fn strip_url(mut self) -> Self {
        self.last = match self.last {
            LastError::Beneath(e) => LastError::Beneath(e.without_url()),
            own => own,
        };
        self.url = None;
        self
    }
}

impl RetryError<BoxError> {
    /// Finds the `RetryError` inside an error returned by the tower door's service
    /// (`RetryService`, feature `tower`), which boxes it as tower passes errors; the
    /// same as `err.downcast_ref::<RetryError<BoxError>>()`.
    ///
    /// Returns `None` for an error that did not come from the layer's attempts: the inner
    /// service's own, when the layer passed the request through to an instance further out, or
    /// a request it could not send at all (no absolute URI).
    pub fn of_boxed(err: &BoxError) -> Option<&RetryError<BoxError>> {
        err.downcast_ref::<RetryError<BoxError>>()
    }
}

impl<E: DoorError> fmt::Debug for RetryError<E> {
    /// As derived, but the URL without its query (which may carry a token), as the message.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryError")
            .field("attempts", &self.attempts)
            .field("stop", &self.stop)
            .field("key", &self.key)
            .field("waited", &self.waited)
            .field("url", &self.url_without_query().map(String::from))
            .field("last", &self.last)
            .finish()
    }
}

impl<E: DoorError> fmt::Display for RetryError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The last error is shown here too: `reqwest_middleware::Error` prints only its top
        // level, and a message without its cause would not be worth logging. Its root cause
        // ("Connection refused") is added once, unless the message already says it.
        let last = self.last.to_string();
        write!(
            f,
            "request failed after {} attempt{} ({}",
            self.attempts,
            if self.attempts == 1 { "" } else { "s" },
            self.stop,
        )?;
        if let Some(capacity) = self.budget {
            write!(
                f,
                ": the dependency's bucket holds {capacity} tokens, shared by all its requests; \
                 see RetryBudget"
            )?;
        }
        write!(f, "): {last}")?;
        if let Some(root) = root_cause(self.last.as_error()) {
            let root = root.to_string();
            if !root.is_empty() && !last.contains(&root) {
                write!(f, ": {root}")?;
            }
        }
        Ok(())
    }
}

impl<E: DoorError> std::error::Error for RetryError<E> {
    /// The last error itself: the chain's or the service's, or the layer's own.
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.last.as_error())
    }
}

/// `url` as an error may print it: without its query and fragment (a token may be there)
/// and without a user name and password.
pub(crate) fn printable(url: &Url) -> Url {
    let mut url = url.clone();
    url.set_query(None);
    url.set_fragment(None);
    // Refused only by a URL that cannot have them (no host): it has none to show.
    let _ = url.set_username("");
    let _ = url.set_password(None);
    url
}

/// The deepest source of `err`, if it has any.
fn root_cause<'e>(
    err: &'e (dyn std::error::Error + 'static),
) -> Option<&'e (dyn std::error::Error + 'static)> {
    let mut cause = err;
    let mut deeper = false;
    // Bounded: no real chain is deeper; a cycle must not loop forever.
    for _ in 0..64 {
        match cause.source() {
            Some(next) => {
                cause = next;
                deeper = true;
            }
            None => break,
        }
    }
    deeper.then_some(cause)
}

pub(crate) mod sealed {
    /// Implemented by the crate's own types only.
    pub trait Sealed {}
    impl Sealed for super::BoxError {}
}

/// The error of an attempt that outlasted its timeout: the policy's
/// [`attempt_timeout`](crate::RetryPolicyBuilder::attempt_timeout), cut to what the deadline
/// left. Found as [`LastError::TimedOut`] in a [`RetryError`], which then answers
/// `timed_out()` with `true`.
///
/// Its [`source`](std::error::Error::source) is an [`io::Error`](std::io::Error) of kind
/// [`TimedOut`](std::io::ErrorKind::TimedOut), so code that walks an error's sources looking for
/// a timeout finds this one too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttemptTimeout {
    pub(crate) after: Duration,
}

impl AttemptTimeout {
    /// How long the attempt ran before it was cut.
    pub fn after(&self) -> Duration {
        self.after
    }
}

impl fmt::Display for AttemptTimeout {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "attempt timed out after {:?}", self.after)
    }
}

impl std::error::Error for AttemptTimeout {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        static TIMED_OUT: std::sync::OnceLock<std::io::Error> = std::sync::OnceLock::new();
        Some(TIMED_OUT.get_or_init(|| std::io::Error::from(std::io::ErrorKind::TimedOut)))
    }
}

/// A setting that cannot work, found when a policy, a budget, the idempotency keys or a route
/// is built; the message names the setting and says what to change.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid {area}: {message}")]
pub struct InvalidConfig {
    area: &'static str,
    message: String,
}

impl InvalidConfig {
    pub(crate) fn new(area: &'static str, message: String) -> Self {
        InvalidConfig { area, message }
    }

    /// What was built: `retry policy`, `retry budget`, `idempotency keys`, `route` or
    /// `attempt headers`.
    pub fn area(&self) -> &'static str {
        self.area
    }

    /// What is wrong and what to change, without the area.
    pub fn message(&self) -> &str {
        &self.message
    }
}

/// The last error of a request the layer stopped before its first attempt was sent, or when no
/// outcome of an attempt was kept: why, and that nothing went out for it. Found as
/// [`LastError::NotSent`] in a [`RetryError`].
///
/// Its message is its cause's when it has one (an invalid idempotency key, an invalid
/// override, no timer to wait with), and its [`source`](std::error::Error::source) that cause.
#[derive(Debug)]
pub struct NotSent {
    stop: StopReason,
    cause: Option<BoxError>,
}

impl NotSent {
    /// Nothing was sent, for `stop`.
    pub(crate) fn new(stop: StopReason) -> NotSent {
        NotSent { stop, cause: None }
    }

    /// Nothing was sent, for `stop`, because of `cause`.
    pub(crate) fn because(
        stop: StopReason,
        cause: impl std::error::Error + Send + Sync + 'static,
    ) -> NotSent {
        NotSent {
            stop,
            cause: Some(Box::new(cause)),
        }
    }

    /// Why nothing was sent: the same reason as the [`RetryError`]'s.
    pub fn stop_reason(&self) -> StopReason {
        self.stop
    }
}

impl fmt::Display for NotSent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.cause, self.stop) {
            (Some(cause), _) => fmt::Display::fmt(cause, f),
            (None, StopReason::Throttled) => f.write_str(
                "the attempt was rejected locally by the adaptive throttle: the dependency has \
                 been turning attempts away, and nothing was sent",
            ),
            (None, stop) => write!(f, "{stop}: nothing was sent for it"),
        }
    }
}

impl std::error::Error for NotSent {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        let cause = self.cause.as_deref()?;
        Some(cause)
    }
}

#[cfg(all(test, feature = "reqwest"))]
mod tests {
    use super::*;
    use crate::RetryErrorExt;

    /// An error with a cause, as a transport's error has one.
    #[derive(Debug, thiserror::Error)]
    #[error("connecting failed")]
    struct Outer(#[source] std::io::Error);

    fn refused() -> LastError<reqwest_middleware::Error> {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "Connection refused");
        LastError::Beneath(reqwest_middleware::Error::middleware(Outer(io)))
    }

    #[test]
    fn a_retry_error_says_its_attempts_reason_last_error_and_root_cause_once() {
        let key = HeaderValue::from_static("k-1");
        let err = RetryError::new(
            3,
            StopReason::AttemptsExhausted,
            Some(key.clone()),
            refused(),
        );
        assert_eq!(
            err.to_string(),
            "request failed after 3 attempts (attempts exhausted): connecting failed: \
             Connection refused"
        );
        assert_eq!(
            (err.attempts(), err.stop_reason()),
            (3, StopReason::AttemptsExhausted)
        );
        assert_eq!(err.idempotency_key(), Some(&key));
        assert!(!err.timed_out() && !err.failed_to_connect());
        assert_eq!((err.last_status(), err.url()), (None, None));
        let source = std::error::Error::source(&err).unwrap();
        assert_eq!(source.to_string(), "connecting failed");
        let one = RetryError::new(1, StopReason::NotRetryable, None, refused());
        assert!(
            one.to_string()
                .starts_with("request failed after 1 attempt ("),
            "{one}"
        );
        assert_eq!(one.into_last_error().to_string(), "connecting failed");
    }

    #[test]
    fn a_cause_that_already_names_its_root_does_not_repeat_it() {
        let io = std::io::Error::other("no route");
        let err = RetryError::new(
            1,
            StopReason::NotRetryable,
            None,
            LastError::Beneath(reqwest_middleware::Error::middleware(io)),
        );
        assert_eq!(
            err.to_string(),
            "request failed after 1 attempt (the failure is not retryable): no route"
        );
    }

    #[test]
    fn the_error_is_found_again_in_the_middleware_s_error_and_answers_there() {
        let wrapped: reqwest_middleware::Error =
            RetryError::new(2, StopReason::DeadlineReached, None, refused()).into();
        let found = RetryError::of(&wrapped).unwrap();
        assert_eq!(found.attempts(), 2);
        assert_eq!(wrapped.attempts(), Some(2));
        assert_eq!(wrapped.stop_reason(), Some(StopReason::DeadlineReached));
        let other = refused().into_beneath().unwrap();
        assert!(RetryError::of(&other).is_none());
        assert_eq!((other.attempts(), other.stop_reason()), (None, None));
        let stripped = wrapped.strip_url();
        assert_eq!(RetryError::of(&stripped).unwrap().attempts(), 2);
    }

    #[test]
    fn an_attempt_timeout_is_a_timeout_down_to_its_io_source() {
        let timeout = AttemptTimeout {
            after: Duration::from_millis(20),
        };
        assert_eq!(timeout.to_string(), "attempt timed out after 20ms");
        let io = std::error::Error::source(&timeout).unwrap();
        let io = io.downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
        assert_eq!(timeout.after(), Duration::from_millis(20));
        let err = LastError::<reqwest_middleware::Error>::TimedOut(timeout);
        assert_eq!(err.own_fault(), Some(Fault::Timeout));
        assert!(err.beneath().is_none());
        let fault = err.own_fault();
        let retry = RetryError::new(3, StopReason::AttemptsExhausted, None, err);
        let retry = retry.with_fault(fault);
        assert!(retry.timed_out());
        assert_eq!(retry.last_error_kind(), Some(AttemptErrorKind::Timeout));
    }

    /// What the door found in the last error answers for it, whatever error carries the
    /// fault: the middleware's own checks of a wrapped error see nothing.
    #[test]
    fn the_fault_the_door_found_answers_for_the_last_error() {
        let wrapped = || {
            let other = std::io::Error::other("wrapped");
            LastError::Beneath(reqwest_middleware::Error::middleware(other))
        };
        let plain = RetryError::new(2, StopReason::AttemptsExhausted, None, wrapped());
        assert!(!plain.timed_out() && !plain.failed_to_connect());
        assert_eq!(plain.last_error_kind(), Some(AttemptErrorKind::Permanent));
        let timed = RetryError::new(2, StopReason::AttemptsExhausted, None, wrapped());
        let timed = timed.with_fault(Some(Fault::Timeout));
        assert!(timed.timed_out() && !timed.failed_to_connect());
        let refused = RetryError::new(2, StopReason::AttemptsExhausted, None, wrapped());
        let refused = refused.with_fault(Some(Fault::Connect));
        assert!(refused.failed_to_connect() && !refused.timed_out());
        assert_eq!(refused.last_error_kind(), Some(AttemptErrorKind::Connect));
        let unsent = RetryError::new(0, StopReason::QuotaExhausted, None, wrapped());
        assert_eq!(
            unsent.with_fault(Some(Fault::Connect)).last_error_kind(),
            None
        );
    }

    #[test]
    fn a_stop_with_nothing_sent_says_so_and_a_throttled_one_says_why() {
        let quota = NotSent::new(StopReason::QuotaExhausted).to_string();
        assert!(quota.ends_with(": nothing was sent for it"), "{quota}");
        assert!(
            quota.starts_with(&StopReason::QuotaExhausted.to_string()),
            "{quota}"
        );
        let throttled = NotSent::new(StopReason::Throttled).to_string();
        assert!(
            throttled.contains("rejected locally by the adaptive throttle"),
            "{throttled}"
        );
    }

    #[test]
    fn a_configuration_error_names_its_area_and_the_fix() {
        let err = InvalidConfig::new("retry policy", "max_attempts must be at least 1".into());
        assert_eq!(err.area(), "retry policy");
        assert_eq!(err.message(), "max_attempts must be at least 1");
        assert_eq!(
            err.to_string(),
            "invalid retry policy: max_attempts must be at least 1"
        );
    }

    /// Of the layer's own errors, only its attempt timeout is transient; an error beneath,
    /// whatever it says, is the door's to judge.
    #[test]
    fn only_the_layer_s_attempt_timeout_is_its_own_transient_fault() {
        let timeout = AttemptTimeout {
            after: std::time::Duration::from_millis(5),
        };
        let own = LastError::<BoxError>::TimedOut(timeout);
        assert_eq!(own.own_fault(), Some(Fault::Timeout));
        let unsent = LastError::<BoxError>::NotSent(NotSent::new(StopReason::Throttled));
        assert_eq!(unsent.own_fault(), None);
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        let beneath = LastError::<BoxError>::Beneath(Box::new(reset));
        assert_eq!(beneath.own_fault(), None, "not ours, whatever it says");
    }

    /// A request not sent says why, and its cause, when it has one, is its message and its
    /// source; the last error prints and walks as the error it holds.
    #[test]
    fn a_request_not_sent_names_its_cause_and_the_last_error_is_what_it_holds() {
        let cause = InvalidConfig::new("retry policy", "max_attempts must be at least 1".into());
        let unsent = NotSent::because(StopReason::InvalidOverride, cause.clone());
        assert_eq!(unsent.stop_reason(), StopReason::InvalidOverride);
        assert_eq!(unsent.to_string(), cause.to_string());
        let source = std::error::Error::source(&unsent).unwrap();
        assert_eq!(source.downcast_ref::<InvalidConfig>(), Some(&cause));
        assert!(std::error::Error::source(&NotSent::new(StopReason::Throttled)).is_none());
        let last = LastError::<BoxError>::NotSent(unsent);
        assert_eq!(last.to_string(), cause.to_string());
        let walked = std::error::Error::source(&last).unwrap();
        assert!(walked.is::<InvalidConfig>(), "the source of what it holds");
        let outer: BoxError = Box::new(Outer(std::io::Error::other("deep")));
        let beneath = LastError::Beneath(outer);
        assert_eq!(beneath.to_string(), "connecting failed");
        assert_eq!(
            std::error::Error::source(&beneath).unwrap().to_string(),
            "deep"
        );
        let retry = RetryError::new(2, StopReason::AttemptsExhausted, None, beneath);
        assert_eq!(
            retry.to_string(),
            "request failed after 2 attempts (attempts exhausted): connecting failed: deep"
        );
        let held = std::error::Error::source(&retry).unwrap();
        assert!(
            held.downcast_ref::<Outer>().is_some(),
            "the error beneath itself"
        );
        assert_eq!(retry.last_status(), None);
        assert!(retry.into_last_error().into_beneath().is_some());
    }
}
