//! What the driver tells `tracing` and the observer: the request's span, an event per attempt
//! and one at the end, at the levels the user chose.

use std::time::Duration;

use crate::driver::body::{Outcome, Reply};
use crate::driver::claim::{Address, Outgoing};
use crate::error::{DoorError, LastError};
use tracing::Level;

use crate::engine::classify::Verdict;
use crate::engine::schedule::Wait;
use crate::fault::AttemptErrorKind;
use crate::fault::Fault;
use crate::observe::{Observer, RetryEvent};
use crate::stop::StopReason;

/// The tracing target of every span and event, whatever module emits them.
pub(crate) const TARGET: &str = "reqwest_safe_retry";

/// An event at a level chosen at run time; `tracing`'s macros take a constant one.
macro_rules! event_at {
    ($level:expr, $($rest:tt)+) => {
        match $level {
            Level::ERROR => tracing::event!(target: TARGET, Level::ERROR, $($rest)+),
            Level::WARN => tracing::event!(target: TARGET, Level::WARN, $($rest)+),
            Level::INFO => tracing::event!(target: TARGET, Level::INFO, $($rest)+),
            Level::DEBUG => tracing::event!(target: TARGET, Level::DEBUG, $($rest)+),
            _ => tracing::event!(target: TARGET, Level::TRACE, $($rest)+),
        }
    };
}

/// The span of one logical request. Its fields are read only when a subscriber takes it: a
/// request's address is parsed again from its URI behind the tower door.
#[inline]
pub(crate) fn request_span(dependency: &str, request: &impl Outgoing) -> tracing::Span {
    tracing::debug_span!(
        target: TARGET,
        "reqwest_safe_retry.request",
        dependency,
        method = %request.method(),
        host = request.address().host,
        path = request.address().path,
        http.request.resend_count = tracing::field::Empty,
    )
}

/// Whether an event at `level` would be taken now, as [`event_at!`] would emit it.
fn enabled_at(level: Level) -> bool {
    match level {
        Level::ERROR => tracing::enabled!(target: TARGET, Level::ERROR),
        Level::WARN => tracing::enabled!(target: TARGET, Level::WARN),
        Level::INFO => tracing::enabled!(target: TARGET, Level::INFO),
        Level::DEBUG => tracing::enabled!(target: TARGET, Level::DEBUG),
        _ => tracing::enabled!(target: TARGET, Level::TRACE),
    }
}

/// Who watches the attempts of one request (the observer, the events), with what names the
/// request for them, kept after the request has gone: its dependency, its method, and its URL
/// without user info, query or fragment.
pub(crate) struct Watcher<'a> {
    pub(crate) observer: Option<&'a dyn Observer>,
    pub(crate) dependency: &'a str,
    pub(crate) method: http::Method,
    /// `scheme://host[:port]/path`, as the observer sees it.
    pub(crate) url: String,
    /// The host and port, the port always written (the scheme's default if the URL has none).
    pub(crate) host: String,
    /// Where the path starts in `url`.
    path_at: usize,
}

impl<'a> Watcher<'a> {
    pub(crate) fn of(
        observer: Option<&'a dyn Observer>,
        dependency: &'a str,
        request: &impl Outgoing,
    ) -> Self {
        let at = request.address();
        let seen = url_without_query(&at);
        let host = match (at.host, at.known_port) {
            (host, Some(port)) => format!("{host}:{port}"),
            (host, None) => host.to_owned(),
        };
        Watcher {
            observer,
            dependency,
            method: request.method().clone(),
            path_at: seen.len() - at.path.len(),
            url: seen,
            host,
        }
    }

    /// The request's path, without its query.
    pub(crate) fn path(&self) -> &str {
        &self.url[self.path_at..]
    }
}

/// One attempt as traced.
pub(crate) struct Traced<'o, R: Reply> {
    pub(crate) number: u32,
    pub(crate) outcome: &'o Outcome<R>,
    /// The transient fault the door found in the outcome's error, if any.
    pub(crate) fault: Option<Fault>,
    pub(crate) verdict: Verdict,
    /// The decision after it.
    pub(crate) decision: Wait,
    /// The floor the decision honoured (`Retry-After` and the like), if any.
    pub(crate) floor: Option<Duration>,
}

/// The end of a logical request, as traced.
pub(crate) struct Ended<'o, R: Reply> {
    pub(crate) attempts: u32,
    pub(crate) stop: StopReason,
    pub(crate) waited: Duration,
    pub(crate) outcome: &'o Outcome<R>,
    /// The transient fault the door found in the outcome's error, if any.
    pub(crate) fault: Option<Fault>,
}

/// The status an error of the door beneath carries, if any (reqwest's `error_for_status` in
/// an inner middleware makes one).
fn status_of<E: DoorError>(err: &LastError<E>) -> Option<u16> {
    err.beneath()
        .and_then(DoorError::status)
        .map(|s| s.as_u16())
}

/// The levels of the middleware's events; see
/// [`RetryMiddleware::with_retry_log_level`](crate::RetryMiddleware::with_retry_log_level).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LogLevels {
    /// An attempt that a retry follows, and the end of a request that was retried.
    pub(crate) retry: Level,
    /// The end of a request whose failure was not retried (or not again).
    pub(crate) give_up: Level,
}

impl Default for LogLevels {
    fn default() -> Self {
        LogLevels {
            retry: Level::INFO,
            give_up: Level::WARN,
        }
    }
}

impl LogLevels {
    /// Whether a subscriber takes any of the middleware's events now: one that takes none at
    /// the least verbose of the levels chosen takes none at all.
    pub(crate) fn enabled(&self) -> bool {
        enabled_at(self.retry.min(self.give_up))
    }

    /// The level of a request's end: a give-up at `give_up`, the end of a retried request at
    /// `retry` (a success at INFO at most), a request that went as its first attempt went at
    /// DEBUG.
    fn of_stop(&self, attempts: u32, stop: StopReason) -> Level {
        match stop {
            // `Level` orders by verbosity: the greater of the two is the quieter one here.
            StopReason::Succeeded if attempts > 1 => self.retry.max(Level::INFO),
            StopReason::NotRetryable if attempts > 1 => self.retry,
            StopReason::Succeeded | StopReason::NotRetryable => Level::DEBUG,
            _ => self.give_up,
        }
    }

    /// Traces the end of a logical request: the last attempt's status, or its error's kind
    /// (none when nothing was sent: the reason says why).
    pub(crate) fn stopped<R: Reply>(&self, watcher: &Watcher<'_>, ended: Ended<'_, R>) {
        let Ended {
            attempts,
            stop,
            waited,
            outcome,
            fault,
        } = ended;
        let (status, error) = match outcome {
            Ok(response) => (Some(response.status().as_u16()), None),
            Err(err) => (status_of(err), (attempts > 0).then(|| error_kind(fault))),
        };
        event_at!(
            self.of_stop(attempts, stop),
            dependency = watcher.dependency,
            method = watcher.method.as_str(),
            host = watcher.host.as_str(),
            path = watcher.path(),
            attempts,
            reason = stop.as_str(),
            status,
            error = error.map(|e| e.as_str()),
            waited_ms = millis(waited),
            "retrying stopped"
        );
    }

    /// Traces one attempt and tells the observer, if any, with the floor the decision honoured.
    pub(crate) fn attempt<R: Reply>(&self, watcher: &Watcher<'_>, traced: Traced<'_, R>) {
        let Traced {
            number: attempt,
            outcome,
            fault,
            verdict,
            decision,
            floor,
        } = traced;
        let (status, error) = match outcome {
            Ok(r) => (Some(r.status().as_u16()), None),
            Err(e) => (status_of(e), Some(error_kind(fault))),
        };
        let (delay, stop) = match decision {
            Wait::Sleep(delay) => (Some(delay), None),
            Wait::Stop(stop) => (None, Some(stop)),
        };
        let decision = match (verdict, decision) {
            (Verdict::Transient(cause), Wait::Sleep(_)) => cause.as_str(),
            (_, Wait::Stop(stop)) => stop.as_str(),
            (Verdict::Final(stop), _) => stop.as_str(),
        };
        let level = if delay.is_some() {
            self.retry
        } else {
            Level::DEBUG
        };
        event_at!(
            level,
            dependency = watcher.dependency,
            method = watcher.method.as_str(),
            host = watcher.host.as_str(),
            path = watcher.path(),
            attempt,
            status,
            error = error.map(|e| e.as_str()),
            decision,
            delay_ms = delay.map(millis),
            "attempt finished"
        );
        if let Some(observer) = watcher.observer {
            observer.on_decision(&RetryEvent {
                dependency: watcher.dependency,
                method: &watcher.method,
                url: &watcher.url,
                attempt,
                status,
                error,
                retry_after: floor,
                delay,
                stop,
            });
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The kind of an attempt's error with `fault`, as the events' `error` field names it.
fn error_kind(fault: Option<Fault>) -> AttemptErrorKind {
    fault.map_or(AttemptErrorKind::Permanent, Fault::kind)
}

/// `scheme://host[:port]/path` of `at`: no user info, query or fragment, and the port only when
/// it is not the scheme's own, as the observer sees a request.
fn url_without_query(at: &Address<'_>) -> String {
    use std::fmt::Write as _;
    let mut out = String::with_capacity(at.scheme.len() + at.host.len() + at.path.len() + 9);
    out.push_str(at.scheme);
    out.push_str("://");
    out.push_str(at.host);
    if let Some(port) = at.port {
        // Writing to a String cannot fail.
        let _ = write!(out, ":{port}");
    }
    out.push_str(at.path);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_observed_url_leaves_out_credentials_query_and_fragment() {
        for (url, seen) in [
            (
                "http://127.0.0.1:8080/a/b?token=1#top",
                "http://127.0.0.1:8080/a/b",
            ),
            (
                "https://user:secret@api.example.com/pay?x=1",
                "https://api.example.com/pay",
            ),
            ("http://[::1]:9/", "http://[::1]:9/"),
            ("http://h", "http://h/"),
        ] {
            let request = reqwest::Request::new(http::Method::GET, url.parse().unwrap());
            assert_eq!(url_without_query(&request.address()), seen, "{url}");
        }
    }

    #[cfg(feature = "tower")]
    /// Behind the tower door the observer sees the same URL, from the request's URI.
    #[test]
    fn a_uri_is_observed_as_its_url_is() {
        for (uri, seen) in [
            (
                "http://127.0.0.1:8080/a/b?token=1",
                "http://127.0.0.1:8080/a/b",
            ),
            ("http://127.0.0.1:80/a", "http://127.0.0.1/a"),
            (
                "https://api.example.com:443/pay?x=1",
                "https://api.example.com/pay",
            ),
            ("http://[::1]:9/", "http://[::1]:9/"),
            ("http://h", "http://h/"),
        ] {
            let request = http::Request::get(uri)
                .body(crate::body::SendBody::new(String::new()))
                .unwrap();
            assert_eq!(url_without_query(&request.address()), seen, "{uri}");
        }
    }
}
