//! What the driver tells `tracing` and the observer: the request's span, an event per attempt
//! and one at the end, at the levels the user chose.

use std::time::Duration;

use reqwest::Request;

use crate::driver::body::Reply;
use tracing::Level;

use crate::engine::classify::Verdict;
use crate::engine::schedule::Wait;
use crate::fault::AttemptErrorKind;
use crate::fault::Fault;
use crate::observe::{Observer, RetryEvent, url_without_query};
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

/// The span of one logical request.
#[inline]
pub(crate) fn request_span(dependency: &str, request: &Request) -> tracing::Span {
    tracing::debug_span!(
        target: TARGET,
        "reqwest_safe_retry.request",
        dependency,
        method = %request.method(),
        host = request.url().host_str().unwrap_or(""),
        path = request.url().path(),
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
        request: &Request,
    ) -> Self {
        let url = request.url();
        let seen = url_without_query(url);
        let host = match (url.host_str(), url.port_or_known_default()) {
            (Some(host), Some(port)) => format!("{host}:{port}"),
            (host, None) => host.unwrap_or("").to_owned(),
            (None, Some(port)) => format!(":{port}"),
        };
        Watcher {
            observer,
            dependency,
            method: request.method().clone(),
            path_at: seen.len() - url.path().len(),
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
pub(crate) struct Traced<'o, R> {
    pub(crate) number: u32,
    pub(crate) outcome: &'o reqwest_middleware::Result<R>,
    /// The transient fault the door found in the outcome's error, if any.
    pub(crate) fault: Option<Fault>,
    pub(crate) verdict: Verdict,
    /// The decision after it.
    pub(crate) decision: Wait,
    /// The floor the decision honoured (`Retry-After` and the like), if any.
    pub(crate) floor: Option<Duration>,
}

/// The end of a logical request, as traced.
pub(crate) struct Ended<'o, R> {
    pub(crate) attempts: u32,
    pub(crate) stop: StopReason,
    pub(crate) waited: Duration,
    pub(crate) outcome: &'o reqwest_middleware::Result<R>,
    /// The transient fault the door found in the outcome's error, if any.
    pub(crate) fault: Option<Fault>,
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
            Err(err) => (
                err.status().map(|s| s.as_u16()),
                (attempts > 0).then(|| error_kind(fault)),
            ),
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
            Err(e) => (e.status().map(|s| s.as_u16()), Some(error_kind(fault))),
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
