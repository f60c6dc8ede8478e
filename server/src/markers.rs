//! The markers a handler's answer carries to tell the layer it is not an outcome.

/// The marker of an answer that leaves the record at its last recovery point: put in a
/// response's extensions (a [`StepError`](crate::StepError)'s answer carries it), it tells the layer to store
/// nothing, roll back the handler's transaction and end the lease now, so that a retry with
/// the same key, or the reconciler, resumes the request at its first step not done.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unfinished;

/// The marker of a [`StepError::Fenced`](crate::StepError::Fenced) answer: the layer replaces it with what happened to
/// the record (its stored outcome, or `409` while it is still in progress).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FencedStep;

/// The marker of an answer given before the handler did anything (a validation failure):
/// put in the response's extensions, it tells the layer to store nothing and roll back the
/// handler's transaction, so a corrected request with the same key runs.
///
/// ```
/// use http::{Response, StatusCode};
/// use safe_retry_server::Rejected;
///
/// let mut answer = Response::new("amount must be positive");
/// *answer.status_mut() = StatusCode::UNPROCESSABLE_ENTITY;
/// answer.extensions_mut().insert(Rejected);
/// ```
///
/// With the `axum` feature it is also a response part: `(StatusCode::BAD_REQUEST, Rejected, "…")`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Rejected;
