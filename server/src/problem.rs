//! The layer's own answers: RFC 9457 problem details, one `type` per case.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};

/// A case the layer answers itself, without the handler.
///
/// Each is sent as `application/problem+json` with `type` set to
/// `urn:safe-retry:problem:<name>`, where `<name>` is [`Problem::name`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Problem {
    /// `400`: the route requires a key and the request has none.
    MissingKey,
    /// `400`: the key is malformed (the detail says how).
    MalformedKey,
    /// `401`: the scope function found no caller.
    NoScope,
    /// `413`: the request body is larger than the layer reads.
    BodyTooLarge,
    /// `400`: the request body could not be read.
    BodyUnreadable,
    /// `408`: the request body did not arrive whole within the layer's time for it.
    BodyTimeout,
    /// `422`: the key was used before with another request.
    KeyReused,
    /// `409`: the first request with this key is still running; `Retry-After` says when to ask
    /// again.
    InProgress,
    /// `503`: the outcome store could not be reached; nothing was done.
    StoreUnavailable,
    /// `500`: the handler's response could not be read, or its transaction was still held.
    HandlerFailed,
    /// A replay of a completed request whose body was too large to store: its status, with
    /// this problem as the body.
    AnswerNotStored,
    /// `503`: a step could not finish (its dependency did not answer); its record waits at its
    /// last recovery point for a retry with the same key, or the reconciler, to resume it.
    StepUnfinished,
    /// `500`: the record was resumed more times than the layer allows and ended failed; every
    /// later request with the key is sent this answer.
    GaveUp,
    /// `503`: this request held its record, stalled past its lease (a pause of the process, a
    /// slow call), and another attempt with its key took the record over and is finishing it:
    /// nothing of this attempt was written, and a retry with the same key gets the outcome.
    /// Sent once the layer has waited [`fenced_wait`](crate::Builder::fenced_wait) for that
    /// outcome in vain; never a `409`, which would tell the request that it is its own rival.
    TakenOver,
}

impl Problem {
    /// The case's name, the last part of its `type`.
    pub fn name(self) -> &'static str {
        match self {
            Problem::MissingKey => "missing-key",
            Problem::MalformedKey => "malformed-key",
            Problem::NoScope => "no-scope",
            Problem::BodyTooLarge => "body-too-large",
            Problem::BodyUnreadable => "body-unreadable",
            Problem::BodyTimeout => "body-timeout",
            Problem::KeyReused => "key-reused",
            Problem::InProgress => "in-progress",
            Problem::StoreUnavailable => "store-unavailable",
            Problem::HandlerFailed => "handler-failed",
            Problem::AnswerNotStored => "answer-not-stored",
            Problem::StepUnfinished => "step-unfinished",
            Problem::GaveUp => "gave-up",
            Problem::TakenOver => "taken-over",
        }
    }

    /// The status the layer answers with (a replay of an unstored body keeps its own).
    pub fn status(self) -> StatusCode {
        match self {
            Problem::MissingKey | Problem::MalformedKey | Problem::BodyUnreadable => {
                StatusCode::BAD_REQUEST
            }
            Problem::NoScope => StatusCode::UNAUTHORIZED,
            Problem::BodyTimeout => StatusCode::REQUEST_TIMEOUT,
            Problem::BodyTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Problem::KeyReused => StatusCode::UNPROCESSABLE_ENTITY,
            Problem::InProgress => StatusCode::CONFLICT,
            Problem::StoreUnavailable | Problem::StepUnfinished | Problem::TakenOver => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Problem::HandlerFailed | Problem::AnswerNotStored | Problem::GaveUp => {
                StatusCode::INTERNAL_SERVER_ERROR
            }
        }
    }

    fn title(self) -> &'static str {
        match self {
            Problem::MissingKey => "An idempotency key is required",
            Problem::MalformedKey => "The idempotency key is malformed",
            Problem::NoScope => "No caller to scope the key to",
            Problem::BodyTooLarge => "The request body is too large",
            Problem::BodyUnreadable => "The request body could not be read",
            Problem::BodyTimeout => "The request body did not arrive in time",
            Problem::KeyReused => "The idempotency key was used with another request",
            Problem::InProgress => "A request with this idempotency key is in progress",
            Problem::StoreUnavailable => "The idempotency store is unavailable",
            Problem::HandlerFailed => "The request's outcome could not be recorded",
            Problem::AnswerNotStored => "The request completed; its answer was too large to store",
            Problem::StepUnfinished => "A step of the request could not finish yet",
            Problem::GaveUp => "The request was resumed too many times and ended failed",
            Problem::TakenOver => "Another attempt took this request over and is finishing it",
        }
    }

    /// The answer: status, `content-type`, and the JSON body.
    pub(crate) fn response(self, detail: &str) -> Response<Bytes> {
        self.response_with_status(self.status(), detail)
    }

    pub(crate) fn response_with_status(self, status: StatusCode, detail: &str) -> Response<Bytes> {
        let body = serde_json::json!({
            "type": format!("urn:safe-retry:problem:{}", self.name()),
            "title": self.title(),
            "status": status.as_u16(),
            "detail": detail,
        });
        let mut response = Response::new(Bytes::from(body.to_string()));
        *response.status_mut() = status;
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        response
    }

    /// A `409` with the retry hint (see [`retry_hint`]).
    pub(crate) fn in_progress(retry_after: Duration) -> Response<Bytes> {
        let mut response = Problem::InProgress.response(&in_progress_detail(retry_after));
        retry_hint(&mut response, retry_after);
        response
    }

    /// `503 store-unavailable` with a one-second retry hint: the store, its pool or the layer
    /// failed, nothing was recorded, and the error's own text goes to the log only.
    pub(crate) fn store_unavailable() -> Response<Bytes> {
        let mut response = Problem::StoreUnavailable.response(STORE_UNAVAILABLE);
        retry_hint(&mut response, Duration::from_secs(1));
        response
    }
}

/// What a caller is told when the store failed.
pub(crate) const STORE_UNAVAILABLE: &str =
    "the outcome store failed; nothing was recorded; retry with the same key";

/// What a caller is told while the key's first request runs.
pub(crate) fn in_progress_detail(retry_after: Duration) -> String {
    let seconds = retry_after.as_millis().div_ceil(1000).max(1);
    format!(
        "the first request with this key is still running; ask again in {seconds} s with the same key"
    )
}

/// When to ask again: `Retry-After` in whole seconds (rounded up, at least 1), and beside it
/// `retry-after-ms` with the milliseconds, which clients that read it (this workspace's does)
/// take as the finer hint.
pub(crate) fn retry_hint(response: &mut Response<Bytes>, after: Duration) {
    let millis = u64::try_from(after.as_millis()).unwrap_or(u64::MAX);
    let seconds = millis.div_ceil(1000).max(1);
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    headers.insert(
        http::HeaderName::from_static("retry-after-ms"),
        HeaderValue::from(millis),
    );
}

impl Problem {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_is_problem_json_naming_its_case() {
        let response = Problem::KeyReused.response("detail text");
        assert_eq!(response.status(), 422);
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
        let json: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
        assert_eq!(json["type"], "urn:safe-retry:problem:key-reused");
        assert_eq!(json["status"], 422);
        assert_eq!(json["detail"], "detail text");
        assert!(json["title"].as_str().unwrap().contains("another request"));
    }

    #[test]
    fn retry_after_rounds_the_lease_up_to_whole_seconds_and_is_at_least_one() {
        let after = |ms| {
            Problem::in_progress(Duration::from_millis(ms)).headers()[header::RETRY_AFTER].clone()
        };
        assert_eq!(after(0), "1");
        assert_eq!(after(1), "1");
        assert_eq!(after(1000), "1");
        assert_eq!(after(1001), "2");
        assert_eq!(after(29_500), "30");
        assert_eq!(Problem::in_progress(Duration::ZERO).status(), 409);
        let ms = |ms| {
            Problem::in_progress(Duration::from_millis(ms)).headers()["retry-after-ms"].clone()
        };
        assert_eq!(ms(0), "0");
        assert_eq!(ms(250), "250");
        assert_eq!(ms(1500), "1500");
        let detail = |ms| {
            let response = Problem::in_progress(Duration::from_millis(ms));
            let json: serde_json::Value = serde_json::from_slice(response.body()).unwrap();
            json["detail"].as_str().unwrap().to_owned()
        };
        assert_eq!(
            detail(1500),
            "the first request with this key is still running; ask again in 2 s with the same key"
        );
        assert!(detail(0).contains("ask again in 1 s"), "{}", detail(0));
        let unavailable = Problem::store_unavailable();
        assert_eq!(unavailable.status(), 503);
        assert_eq!(unavailable.headers()[header::RETRY_AFTER], "1");
        assert_eq!(unavailable.headers()["retry-after-ms"], "1000");
    }

    #[test]
    fn every_case_has_its_own_name_and_a_client_or_server_status() {
        let all = [
            Problem::MissingKey,
            Problem::MalformedKey,
            Problem::NoScope,
            Problem::BodyTimeout,
            Problem::BodyTooLarge,
            Problem::BodyUnreadable,
            Problem::KeyReused,
            Problem::InProgress,
            Problem::StoreUnavailable,
            Problem::HandlerFailed,
            Problem::AnswerNotStored,
            Problem::StepUnfinished,
            Problem::GaveUp,
            Problem::TakenOver,
        ];
        let names: std::collections::HashSet<_> = all.iter().map(|p| p.name()).collect();
        assert_eq!(
            Problem::TakenOver.status(),
            503,
            "a status every client retries"
        );
        assert_eq!(names.len(), all.len());
        for p in all {
            assert!(
                p.status().is_client_error() || p.status().is_server_error(),
                "{p:?}"
            );
        }
    }
}
