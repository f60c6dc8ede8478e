//! The answers the layer gives itself — refusals, the store's failure, `409`, `422` and
//! replays — counted and logged here, and said in the transport's words by its front.

use std::time::Duration;

use bytes::Bytes;
use http::Response;

use crate::body::ReplyBody;
use crate::config::{Config, Count};
use crate::events::Event;
use crate::problem::Problem;
use crate::store::StoredAnswer;

/// One of the layer's own answers, as the front says it.
pub(crate) fn own<S, R>(
    config: &Config<S>,
    problem: Problem,
    detail: &str,
    retry_after: Option<Duration>,
) -> Response<ReplyBody<R>> {
    whole(config.front.own(problem, detail, retry_after))
}

/// A whole answer as the layer's reply.
pub(crate) fn whole<R>(response: Response<Bytes>) -> Response<ReplyBody<R>> {
    response.map(ReplyBody::full)
}

/// A request refused before any claim (key, scope, body): nothing is stored.
pub(crate) fn refuse<S, R>(
    config: &Config<S>,
    problem: Problem,
    detail: &str,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::Refused);
    crate::events::emit!(
        config.events,
        Event::Refused,
        problem = problem.name(),
        detail
    );
    own(config, problem, detail, None)
}

/// The store (or the layer) failed: a retry hint, and never the error's text, which goes to
/// the log only.
pub(crate) fn unavailable<S, R>(
    config: &Config<S>,
    error: &dyn std::error::Error,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::StoreFailures);
    crate::events::emit!(config.events, Event::StoreFailed, error = %error);
    own(
        config,
        Problem::StoreUnavailable,
        crate::problem::STORE_UNAVAILABLE,
        Some(Duration::from_secs(1)),
    )
}

/// The key's first request is still running.
pub(crate) fn in_progress<S, R>(
    config: &Config<S>,
    scope: &str,
    key: &str,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::InProgress);
    crate::events::emit!(config.events, Event::InProgress, scope, key);
    let after = config.in_progress_retry_after;
    let detail = crate::problem::in_progress_detail(after);
    own(config, Problem::InProgress, &detail, Some(after))
}

/// This request's record was taken over while it stalled, and the other attempt had not
/// finished within the layer's wait (counted and logged as `fenced`).
pub(crate) fn taken_over<S, R>(config: &Config<S>) -> Response<ReplyBody<R>> {
    own(
        config,
        Problem::TakenOver,
        "another attempt with this key took this request over while it was stalled and is finishing it; nothing of this attempt was written; retry with the same key to get the outcome",
        Some(config.in_progress_retry_after),
    )
}

/// The key came with another request.
pub(crate) fn mismatch<S, R>(config: &Config<S>, scope: &str, key: &str) -> Response<ReplyBody<R>> {
    config.counters.add(Count::Mismatches);
    crate::events::emit!(config.events, Event::Mismatch, scope, key);
    own(
        config,
        Problem::KeyReused,
        "this idempotency key was used with another request (method, path or body); use a new key for a new request",
        None,
    )
}

/// The stored answer again, marked as a replay.
pub(crate) fn replay<S, R>(
    config: &Config<S>,
    scope: &str,
    key: &str,
    stored: &StoredAnswer,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::Replays);
    crate::events::emit!(
        config.events,
        Event::Replay,
        scope,
        key,
        status = stored.status.as_u16()
    );
    config
        .front
        .replay(stored, config.scope.is_shared())
        .map(ReplyBody::whole)
}
