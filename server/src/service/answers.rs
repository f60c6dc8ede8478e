//! The answers the layer gives itself: refusals, the store's failure, `409`, and replays.

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Response, StatusCode};

use crate::body::ReplyBody;
use crate::config::{Config, Count};
use crate::events::Event;
use crate::headers::IDEMPOTENT_REPLAYED;
use crate::problem::Problem;
use crate::store::StoredAnswer;

/// A whole answer as the layer's reply.
pub(crate) fn answer<R>(response: Response<Bytes>) -> Response<ReplyBody<R>> {
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
    answer(problem.response(detail))
}

/// The store (or the layer) failed: `503` with a retry hint, and never the error's text, which
/// goes to the log only.
pub(crate) fn unavailable<S, R>(
    config: &Config<S>,
    error: &dyn std::error::Error,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::StoreFailures);
    crate::events::emit!(config.events, Event::StoreFailed, error = %error);
    answer(Problem::store_unavailable())
}

/// `409`: the key's first request is still running.
pub(crate) fn in_progress<S, R>(
    config: &Config<S>,
    scope: &str,
    key: &str,
) -> Response<ReplyBody<R>> {
    config.counters.add(Count::InProgress);
    crate::events::emit!(config.events, Event::InProgress, scope, key);
    answer(Problem::in_progress(config.in_progress_retry_after))
}

/// `422`: the key came with another request.
pub(crate) fn mismatch<S, R>(config: &Config<S>, scope: &str, key: &str) -> Response<ReplyBody<R>> {
    config.counters.add(Count::Mismatches);
    crate::events::emit!(config.events, Event::Mismatch, scope, key);
    answer(Problem::KeyReused.response(
        "this idempotency key was used with another request (method, path or body); use a new key for a new request",
    ))
}

/// The stored answer again, marked as a replay. Under the shared scope a replay may go to
/// another caller than the first, so it never carries the first caller's `Set-Cookie`.
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
    let mut response = match &stored.body {
        Some(body) => {
            let mut response = Response::new(ReplyBody::full(body.clone()));
            let headers = response.headers_mut();
            for (name, value) in &stored.headers {
                if config.scope.is_shared() && name == header::SET_COOKIE {
                    continue;
                }
                headers.append(name.clone(), value.clone());
            }
            response
        }
        None => answer(Problem::AnswerNotStored.response_with_status(
            stored.status,
            "this request completed before; its answer was too large to store, so only its status is replayed",
        )),
    };
    *response.status_mut() = stored.status;
    response
        .headers_mut()
        .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    response
}

/// Whether a handler's answer with this status is kept out of the table by the layer's
/// settings.
pub(crate) fn not_stored<S>(config: &Config<S>, status: StatusCode) -> bool {
    config.not_stored.contains(&status)
}
