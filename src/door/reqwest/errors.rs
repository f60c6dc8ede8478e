//! The reqwest door's errors: a [`RetryError`] inside `reqwest_middleware::Error`, and what it
//! answers when asked of that error directly ([`RetryErrorExt`]).

use std::time::Duration;

use http::StatusCode;
use url::Url;

use crate::error::{DoorError, RetryError, printable, sealed};
use crate::stop::StopReason;

impl RetryError {
    /// Finds the `RetryError` inside an error returned by a client that uses the middleware.
    ///
    /// Returns `None` for errors that did not come from it (for example from a middleware placed
    /// before it in the chain).
    pub fn of(err: &reqwest_middleware::Error) -> Option<&RetryError> {
        match err {
            reqwest_middleware::Error::Middleware(e) => e.downcast_ref::<RetryError>(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }
}

/// `err` without its URL, whether it is reqwest's or this middleware's.
fn strip_url(err: reqwest_middleware::Error) -> reqwest_middleware::Error {
    match err {
        reqwest_middleware::Error::Reqwest(e) => e.without_url().into(),
        reqwest_middleware::Error::Middleware(e) => match e.downcast::<RetryError>() {
            Ok(retry) => retry.strip_url().into(),
            Err(other) => reqwest_middleware::Error::Middleware(other),
        },
    }
}

/// The reqwest door's error: reqwest's own, which says what it is and where it went, or
/// another middleware's.
impl DoorError for reqwest_middleware::Error {
    fn as_error(&self) -> &(dyn std::error::Error + 'static) {
        match self {
            reqwest_middleware::Error::Reqwest(e) => e,
            reqwest_middleware::Error::Middleware(e) => e.as_ref(),
        }
    }

    fn is_connect(&self) -> bool {
        #[cfg(not(target_arch = "wasm32"))]
        return reqwest_middleware::Error::is_connect(self);
        // A page is never told that connecting failed (see `browser::reqwest_fault`).
        #[cfg(target_arch = "wasm32")]
        return false;
    }

    fn is_timeout(&self) -> bool {
        reqwest_middleware::Error::is_timeout(self)
    }

    fn status(&self) -> Option<StatusCode> {
        reqwest_middleware::Error::status(self)
    }

    fn hide_url(&mut self) -> Option<Url> {
        let reqwest_middleware::Error::Reqwest(e) = self else {
            return None;
        };
        let shown = e.url_mut()?;
        let whole = shown.clone();
        *shown = printable(shown);
        Some(whole)
    }

    fn without_url(self) -> Self {
        strip_url(self)
    }
}

/// What the middleware's errors answer, asked of a [`reqwest_middleware::Error`] directly.
///
/// Every error of this middleware is a [`RetryError`] inside
/// [`reqwest_middleware::Error::Middleware`], and `reqwest_middleware::Error`'s own
/// `is_timeout()`, `is_connect()` and `status()` cannot see inside a middleware's error: for
/// every one of them they answer `false` and `None`, and its `without_url()` leaves the URL in
/// place. Rust calls those methods before any trait's of the same name, so these have names of
/// their own. They answer for the last attempt of a [`RetryError`], and exactly as
/// `reqwest_middleware::Error` would for any other error, so code can use them everywhere.
///
/// ```no_run
/// # async fn run(client: reqwest_middleware::ClientWithMiddleware) {
/// use reqwest_safe_retry::RetryErrorExt;
///
/// if let Err(err) = client.get("http://127.0.0.1:9/").send().await {
///     if err.timed_out() || err.failed_to_connect() {
///         eprintln!(
///             "unreachable after {} attempts: {}",
///             err.attempts().unwrap_or(1),
///             err.strip_url()
///         );
///     }
/// }
/// # }
/// ```
///
/// The trait is sealed: it is implemented for `reqwest_middleware::Error` only.
pub trait RetryErrorExt: sealed::Sealed + Sized {
    /// Whether the last attempt timed out: reqwest's own timeout or the policy's per-attempt
    /// timeout. `reqwest_middleware::Error::is_timeout`, for any error.
    #[doc(alias = "is_timeout")]
    fn timed_out(&self) -> bool;

    /// Whether the last attempt failed to connect. `is_connect`, for any error.
    #[doc(alias = "is_connect")]
    fn failed_to_connect(&self) -> bool;

    /// The status the last attempt's error carries, if any. `status`, for any error.
    #[doc(alias = "status")]
    fn last_status(&self) -> Option<StatusCode>;

    /// How many attempts were made, if the error came from this middleware.
    fn attempts(&self) -> Option<u32>;

    /// Why retrying stopped, if the error came from this middleware.
    fn stop_reason(&self) -> Option<StopReason>;

    /// How long the request waited before and between its attempts, if the error came from
    /// this middleware ([`RetryError::waited`]).
    fn waited(&self) -> Option<Duration>;

    /// The URL of the last attempt, whatever ended it ([`RetryError::url`]); for another
    /// error, its own `url()`. (Not `url`: `reqwest_middleware::Error`'s own method of that
    /// name would be called first, and it cannot see inside a middleware's error.)
    fn last_url(&self) -> Option<&Url>;

    /// The error without any URL, inside this middleware's error too. `without_url`, for any
    /// error.
    #[doc(alias = "without_url")]
    fn strip_url(self) -> Self;
}

impl sealed::Sealed for reqwest_middleware::Error {}

impl RetryErrorExt for reqwest_middleware::Error {
    fn timed_out(&self) -> bool {
        RetryError::of(self).map_or_else(|| self.is_timeout(), RetryError::timed_out)
    }

    fn failed_to_connect(&self) -> bool {
        RetryError::of(self).map_or_else(|| self.is_connect(), RetryError::failed_to_connect)
    }

    fn last_status(&self) -> Option<StatusCode> {
        RetryError::of(self).map_or_else(|| self.status(), RetryError::last_status)
    }

    fn attempts(&self) -> Option<u32> {
        RetryError::of(self).map(RetryError::attempts)
    }

    fn stop_reason(&self) -> Option<StopReason> {
        RetryError::of(self).map(RetryError::stop_reason)
    }

    fn waited(&self) -> Option<Duration> {
        RetryError::of(self).map(RetryError::waited)
    }

    fn last_url(&self) -> Option<&Url> {
        RetryError::of(self).map_or_else(|| self.url(), RetryError::url)
    }

    fn strip_url(self) -> Self {
        strip_url(self)
    }
}

/// The reqwest door's error as the chain hands it back: inside
/// [`reqwest_middleware::Error::Middleware`], where [`RetryError::of`] finds it.
impl From<RetryError> for reqwest_middleware::Error {
    fn from(err: RetryError) -> Self {
        reqwest_middleware::Error::middleware(err)
    }
}
