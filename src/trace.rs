//! What the driver tells `tracing` and the observer: the request's span, an event per attempt
//! and one at the end, at the levels the user chose.

use std::time::Duration;

use reqwest::{Request, Response};
use tracing::Level;

use crate::classify::{self, Fault, Verdict};
use crate::error::StopReason;
use crate::observe::{AttemptErrorKind, RetryEvent, RetryObserver};
use crate::schedule::Wait;

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

/// Who watches the attempts of one request: the observer, with the request's dependency,
/// method and URL (without its query), kept for it after the request has gone.
pub(crate) struct Watcher<'a> {
    pub(crate) observer: &'a dyn RetryObserver,
    pub(crate) dependency: &'a str,
    pub(crate) method: http::Method,
    pub(crate) url: String,
}

/// One attempt as traced: its number, outcome and verdict, the decision after it, and the floor
/// that decision honoured.
pub(crate) type Seen<'o> = (
    u32,
    &'o reqwest_middleware::Result<Response>,
    Verdict,
    Wait,
    Option<Duration>,
);

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
    /// The level of a request's end: a give-up at `give_up`, the end of a retried request at
    /// `retry`, a request that went as its first attempt went at DEBUG.
    fn of_stop(&self, attempts: u32, stop: StopReason) -> Level {
        match stop {
            StopReason::Succeeded | StopReason::NotRetryable if attempts > 1 => self.retry,
            StopReason::Succeeded | StopReason::NotRetryable => Level::DEBUG,
            _ => self.give_up,
        }
    }

    /// Traces the end of a logical request.
    pub(crate) fn trace_stop(
        &self,
        attempts: u32,
        stop: StopReason,
        waited: Duration,
        status: Option<u16>,
    ) {
        event_at!(
            self.of_stop(attempts, stop),
            attempts,
            reason = stop.as_str(),
            status,
            waited_ms = millis(waited),
            "retrying stopped"
        );
    }

    /// Traces one attempt and tells the observer, if any, with the floor the decision honoured.
    pub(crate) fn attempt(&self, watcher: Option<&Watcher<'_>>, seen: Seen<'_>) {
        let (attempt, outcome, verdict, decision, floor) = seen;
        let (status, error) = match outcome {
            Ok(r) => (Some(r.status().as_u16()), None),
            Err(e) => (
                e.status().map(|s| s.as_u16()),
                Some(classify::transport_fault(e).map_or(AttemptErrorKind::Permanent, Fault::kind)),
            ),
        };
        let (delay, stop) = match decision {
            Wait::Sleep(delay) => (Some(delay), None),
            Wait::Stop(stop) => (None, Some(stop)),
        };
        let decision = match (verdict, decision) {
            (Verdict::Transient(_, why), Wait::Sleep(_)) => why,
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
            attempt,
            status,
            error = error.map(|e| e.as_str()),
            decision,
            delay_ms = delay.map(millis),
            "attempt finished"
        );
        if let Some(watcher) = watcher {
            watcher.observer.on_decision(&RetryEvent {
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
