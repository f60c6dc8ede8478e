//! The service: one request's way through the layer.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::{Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower_service::Service;

use crate::body::{BoxError, ReplyBody};
use crate::config::{Config, Counters};
use crate::execution::Snapshot;
use crate::execution::{Execution, Rejected};
use crate::headers::{IDEMPOTENT_REPLAYED, end_to_end};
use crate::problem::Problem;
use crate::step::Unfinished;
use crate::store::{
    Claim, Claimed, Completion, Fence, RecordState, Store, StoreError, StoredAnswer,
};

/// The service the [`IdempotencyLayer`](crate::layer::IdempotencyLayer) makes.
pub struct Idempotent<Svc, S> {
    pub(crate) inner: Svc,
    pub(crate) config: Arc<Config<S>>,
}

impl<Svc: Clone, S> Clone for Idempotent<Svc, S> {
    fn clone(&self) -> Self {
        Idempotent {
            inner: self.inner.clone(),
            config: self.config.clone(),
        }
    }
}

impl<Svc: std::fmt::Debug, S> std::fmt::Debug for Idempotent<Svc, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotent")
            .field("inner", &self.inner)
            .finish_non_exhaustive()
    }
}

/// The future of an [`Idempotent`] service.
pub type IdempotentFuture<R, E> =
    Pin<Box<dyn Future<Output = Result<Response<ReplyBody<R>>, E>> + Send>>;

impl<Svc, S, B, R> Service<Request<B>> for Idempotent<Svc, S>
where
    Svc: Service<Request<B>, Response = Response<R>> + Clone + Send + 'static,
    Svc::Future: Send,
    Svc::Error: Send,
    S: Store,
    B: Body + From<Bytes> + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin + Send + 'static,
    R::Error: Into<BoxError>,
{
    type Response = Response<ReplyBody<R>>;
    type Error = Svc::Error;
    type Future = IdempotentFuture<R, Svc::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<B>) -> Self::Future {
        // The service polled ready goes with this request; a clone stays for the next.
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let config = self.config.clone();
        if !config.methods.contains(request.method())
            || request.extensions().get::<Resumed>().is_some()
        {
            return Box::pin(pass(inner, request));
        }
        Box::pin(run(config, inner, request))
    }
}

async fn pass<Svc, B, R>(
    mut inner: Svc,
    request: Request<B>,
) -> Result<Response<ReplyBody<R>>, Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
{
    Ok(inner
        .call(request)
        .await?
        .map(|body| ReplyBody::inner(Bytes::new(), body)))
}

fn answer<R>(response: Response<Bytes>) -> Response<ReplyBody<R>> {
    response.map(ReplyBody::full)
}

fn refuse<S, R>(config: &Config<S>, problem: Problem, detail: &str) -> Response<ReplyBody<R>> {
    Counters::add(&config.counters.refused);
    tracing::debug!(target: "safe_retry_server", event = "refused", problem = problem.name(), detail);
    answer(problem.response(detail))
}

pub(crate) fn unavailable<S, R>(
    config: &Config<S>,
    error: &dyn std::error::Error,
) -> Response<ReplyBody<R>> {
    Counters::add(&config.counters.store_failures);
    tracing::warn!(target: "safe_retry_server", event = "store_failed", error = %error);
    let mut response = Problem::StoreUnavailable
        .response("the outcome store failed; nothing was recorded; retry with the same key");
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    answer(response)
}

async fn run<Svc, S, B, R>(
    config: Arc<Config<S>>,
    inner: Svc,
    request: Request<B>,
) -> Result<Response<ReplyBody<R>>, Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: Body + From<Bytes>,
    B::Error: Into<BoxError>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();

    // The key, when it does not need the body: a request that lacks one is answered (or passed
    // through) before its body is read.
    let mut key = None;
    if !config.key.needs_body() {
        match config.key.read(&parts, &Bytes::new(), config.max_key_len) {
            Err(error) => return Ok(refuse(&config, Problem::MalformedKey, &error.to_string())),
            Ok(None) if config.require_key => {
                return Ok(refuse(
                    &config,
                    Problem::MissingKey,
                    "this route requires an Idempotency-Key header",
                ));
            }
            Ok(None) => return pass(inner, Request::from_parts(parts, body)).await,
            Ok(Some(found)) => key = Some(found),
        }
    }
    let Some(scope) = (config.scope)(&parts) else {
        return Ok(refuse(
            &config,
            Problem::NoScope,
            "no caller to scope the idempotency key to",
        ));
    };
    let bytes = match Limited::new(body, config.max_request_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(error) if error.downcast_ref::<LengthLimitError>().is_some() => {
            let detail = format!(
                "the request body is over {} bytes; nothing was done",
                config.max_request_body
            );
            return Ok(refuse(&config, Problem::BodyTooLarge, &detail));
        }
        Err(error) => return Ok(refuse(&config, Problem::BodyUnreadable, &error.to_string())),
    };
    let key = match key {
        Some(key) => key,
        None => match config.key.read(&parts, &bytes, config.max_key_len) {
            Err(error) => return Ok(refuse(&config, Problem::MalformedKey, &error.to_string())),
            Ok(Some(key)) => key,
            Ok(None) if config.require_key => {
                return Ok(refuse(
                    &config,
                    Problem::MissingKey,
                    "this route requires an idempotency key",
                ));
            }
            Ok(None) => return pass(inner, Request::from_parts(parts, B::from(bytes))).await,
        },
    };
    let fingerprint = config.fingerprint.of(&parts, &bytes);
    let claim = Claim {
        scope: &scope,
        key: &key,
        fingerprint: &fingerprint,
        lease: config.lease,
        retention: config.retention,
    };

    // The claim: one atomic statement decides the owner. A loser reads the record to learn
    // why; a record that changes between the two (a lease ending, a sweep) is claimed again,
    // at most three times.
    let held = Held::new(config.store.clone(), config.counters.clone());
    let mut claimed = None;
    for _ in 0..3 {
        match held.claim(&claim).await {
            Err(error) => return Ok(unavailable(&config, &error)),
            Ok(Some(owned)) => {
                claimed = Some(owned);
                break;
            }
            Ok(None) => {}
        }
        match config.store.read(&scope, &key).await {
            Err(error) => return Ok(unavailable(&config, &error)),
            Ok(None) => continue,
            Ok(Some(record)) if record.fingerprint != fingerprint => {
                Counters::add(&config.counters.mismatches);
                tracing::info!(target: "safe_retry_server", event = "mismatch", scope, key);
                return Ok(answer(Problem::KeyReused.response(
                    "this idempotency key was used with another request (method, path or body); use a new key for a new request",
                )));
            }
            Ok(Some(record)) => match record.state {
                RecordState::Completed(stored) => {
                    return Ok(replay(&config, &scope, &key, &stored));
                }
                RecordState::InProgress { lease_left } if !lease_left.is_zero() => {
                    Counters::add(&config.counters.in_progress);
                    tracing::debug!(target: "safe_retry_server", event = "in_progress", scope, key);
                    return Ok(answer(Problem::in_progress(config.in_progress_retry_after)));
                }
                RecordState::InProgress { .. } => continue,
            },
        }
    }
    let Some(claimed) = claimed else {
        return Ok(unavailable(
            &config,
            &std::io::Error::other("the record changed under three claims in a row"),
        ));
    };
    let scope: Arc<str> = scope.into();
    let key: Arc<str> = key.into();
    execute(
        &config,
        inner,
        parts,
        bytes,
        Owned {
            scope,
            key,
            fingerprint,
            claimed,
            held,
        },
    )
    .await
    .map(|(answer, _)| answer)
}

/// A problem answer as a record stores it.
pub(crate) fn stored_problem(answer: &Response<Bytes>) -> StoredAnswer {
    StoredAnswer {
        status: answer.status(),
        headers: end_to_end(answer.headers()),
        body: Some(answer.body().clone()),
    }
}

/// A request its claim owns, on its way to the handler.
pub(crate) struct Owned<S: Store> {
    pub(crate) scope: Arc<str>,
    pub(crate) key: Arc<str>,
    pub(crate) fingerprint: [u8; 32],
    pub(crate) claimed: crate::store::Claimed,
    pub(crate) held: Held<S>,
}

/// What became of an execution, beside its answer: the reconciler counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The answer is stored.
    Completed,
    /// The handler left the record at a recovery point (or failed without an answer).
    Unfinished,
    /// The record had been resumed too often and ended failed.
    Failed,
    /// Another attempt took the record over.
    Fenced,
    /// The handler rejected the request; the record is gone.
    Rejected,
    /// The store failed.
    StoreFailed,
}

/// The marker of a request the reconciler resumes: the layer, if the reconciler's service
/// has it too, passes the request straight to the handler.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resumed;

/// Runs the handler for a claimed request and stores its outcome: the part of a request's way
/// that a resumption by the reconciler shares.
pub(crate) async fn execute<Svc, S, B, R>(
    config: &Config<S>,
    mut inner: Svc,
    mut parts: http::request::Parts,
    bytes: Bytes,
    owned: Owned<S>,
) -> Result<(Response<ReplyBody<R>>, Ended), Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    B: From<Bytes>,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let Owned {
        scope,
        key,
        fingerprint,
        claimed,
        held,
    } = owned;
    Counters::add(&config.counters.claims);
    if claimed.taken_over {
        Counters::add(&config.counters.takeovers);
        tracing::info!(target: "safe_retry_server", event = "takeover", %scope, %key, attempt = claimed.fence.attempt);
    } else {
        tracing::debug!(target: "safe_retry_server", event = "claim", %scope, %key);
    }

    // From here until the outcome is written, a failure or a drop of this future ends the
    // lease at once (`held`), so that a retry need not wait it out.

    // A record resumed more often than allowed ends failed, with an answer that says so.
    if claimed.fence.attempt > i64::from(config.max_attempts) {
        let answer = Problem::GaveUp.response(&format!(
            "the request was started {} times without finishing; it is kept failed, with its last recovery point, for an operator",
            config.max_attempts
        ));
        let stored = stored_problem(&answer);
        return match config
            .store
            .fail(claimed.fence, &stored, config.failed_retention)
            .await
        {
            Err(error) => Ok((unavailable(config, &error), Ended::StoreFailed)),
            Ok(Completion::Fenced) => Ok((
                self::answer(Problem::in_progress(config.in_progress_retry_after)),
                Ended::Fenced,
            )),
            Ok(Completion::Completed) => {
                held.done();
                Counters::add(&config.counters.failed);
                tracing::error!(target: "safe_retry_server", event = "gave_up", %scope, %key, attempt = claimed.fence.attempt);
                Ok((self::answer(answer), Ended::Failed))
            }
        };
    }

    // The handler, with its execution in the request's extensions.
    let snapshot = Snapshot::of(&parts, &bytes);
    let execution = Execution::new(
        config.store.clone(),
        crate::execution::Claimed {
            scope: scope.clone(),
            key: key.clone(),
            fence: claimed.fence,
            taken_over: claimed.taken_over,
            lease: config.lease,
            counters: config.counters.clone(),
            snapshot,
        },
    );
    parts.extensions.insert(execution.clone());
    let response = inner.call(Request::from_parts(parts, B::from(bytes))).await;
    let tx = execution.close();
    let response = match response {
        Ok(response) => response,
        // The handler failed without an answer: its transaction rolls back as it drops, and
        // `held` ends the lease, so a retry takes the record over.
        Err(error) => return Err(error),
    };
    let Ok(tx) = tx else {
        Counters::add(&config.counters.store_failures);
        tracing::error!(target: "safe_retry_server", event = "local_held", %scope, %key);
        return Ok((
            answer(Problem::HandlerFailed.response(
                "the handler still held its Local transaction when it answered; nothing was recorded",
            )),
            Ended::Unfinished,
        ));
    };

    if response.extensions().get::<Unfinished>().is_some() {
        // The record stays at its last recovery point; its lease ends before the answer
        // leaves, so a retry with the key, or the reconciler, resumes it at once.
        drop(tx);
        held.end_now().await;
        Counters::add(&config.counters.unfinished);
        tracing::info!(target: "safe_retry_server", event = "unfinished", %scope, %key, attempt = claimed.fence.attempt);
        let ended_as = if response.status() == http::StatusCode::CONFLICT {
            Ended::Fenced
        } else {
            Ended::Unfinished
        };
        return Ok((
            response.map(|body| ReplyBody::inner(Bytes::new(), body)),
            ended_as,
        ));
    }

    if response.extensions().get::<Rejected>().is_some() {
        return match config.store.release(tx, claimed.fence).await {
            Ok(_) => {
                held.done();
                Counters::add(&config.counters.rejections);
                tracing::debug!(target: "safe_retry_server", event = "rejected", %scope, %key);
                Ok((
                    response.map(|body| ReplyBody::inner(Bytes::new(), body)),
                    Ended::Rejected,
                ))
            }
            Err(error) => Ok((unavailable(config, &error), Ended::StoreFailed)),
        };
    }

    // The answer: read up to the limit, stored with the local effects, then sent.
    let (head, mut body) = response.into_parts();
    let mut read = BytesMut::new();
    let mut over = false;
    while let Some(frame) = body.frame().await {
        match frame {
            Ok(frame) => {
                if let Ok(data) = frame.into_data() {
                    read.extend_from_slice(&data);
                    if read.len() > config.max_answer_body {
                        over = true;
                        break;
                    }
                }
            }
            Err(error) => {
                let error: BoxError = error.into();
                Counters::add(&config.counters.store_failures);
                tracing::error!(target: "safe_retry_server", event = "answer_failed", %scope, %key, error = %error);
                // Dropping `tx` rolls the local effects back; `held` lets a retry run it.
                drop(tx);
                return Ok((
                    answer(Problem::HandlerFailed.response(
                        "the handler's answer failed while it was read; nothing was recorded; retry with the same key",
                    )),
                    Ended::Unfinished,
                ));
            }
        }
    }
    let read = read.freeze();
    let stored = StoredAnswer {
        status: head.status,
        headers: end_to_end(&head.headers),
        body: (!over).then(|| read.clone()),
    };
    let completion = config.store.complete(tx, claimed.fence, &stored).await;
    if completion.is_ok() {
        held.done();
    }
    match completion {
        Err(error) => Ok((unavailable(config, &error), Ended::StoreFailed)),
        Ok(Completion::Completed) => {
            Counters::add(&config.counters.completions);
            tracing::debug!(target: "safe_retry_server", event = "completed", %scope, %key, status = head.status.as_u16());
            let body = if over {
                ReplyBody::inner(read, body)
            } else {
                ReplyBody::full(read)
            };
            Ok((Response::from_parts(head, body), Ended::Completed))
        }
        Ok(Completion::Fenced) => {
            Counters::add(&config.counters.fenced);
            tracing::warn!(
                target: "safe_retry_server",
                event = "fenced",
                %scope,
                %key,
                attempt = claimed.fence.attempt,
                "another attempt took this record over; this completion and its local effects were rolled back"
            );
            let response = match config.store.read(&scope, &key).await {
                Ok(Some(record)) if record.fingerprint == fingerprint => match record.state {
                    RecordState::Completed(stored) => replay(config, &scope, &key, &stored),
                    RecordState::InProgress { .. } => {
                        answer(Problem::in_progress(config.in_progress_retry_after))
                    }
                },
                Ok(_) => answer(Problem::in_progress(config.in_progress_retry_after)),
                Err(error) => unavailable(config, &error),
            };
            Ok((response, Ended::Fenced))
        }
    }
}

/// Where a request's claim stands, shared by the request's future and its claim's task.
enum Hold {
    /// The claim statement is on its way.
    Claiming,
    /// The request holds the record under this fence.
    Holding(Fence),
    /// The request went away (dropped, or failed without an outcome).
    Gone,
    /// The outcome is written (or the record released): nothing to end.
    Done,
}

/// The request's hold on its record. Dropped while it holds one (the handler failed, its
/// answer failed, or the request's future was dropped, even while the claim statement was on
/// its way), it ends the record's lease at once, fenced, so the next request with the key
/// takes it over instead of waiting the lease out.
pub(crate) struct Held<S: Store> {
    store: S,
    state: Arc<Mutex<Hold>>,
    counters: Arc<Counters>,
}

fn lock(state: &Mutex<Hold>) -> std::sync::MutexGuard<'_, Hold> {
    state
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl<S: Store> Held<S> {
    pub(crate) fn new(store: S, counters: Arc<Counters>) -> Held<S> {
        Held {
            store,
            state: Arc::new(Mutex::new(Hold::Claiming)),
            counters,
        }
    }

    /// Runs the claim statement in a task of its own: if the request is dropped while the
    /// statement is on its way, the task ends the lease it took, so no record is left claimed
    /// with nobody holding it.
    pub(crate) async fn claim(&self, claim: &Claim<'_>) -> Result<Option<Claimed>, StoreError> {
        let (answer, heard) = tokio::sync::oneshot::channel();
        let (store, state, counters) = (
            self.store.clone(),
            self.state.clone(),
            self.counters.clone(),
        );
        let (scope, key, fingerprint) = (
            claim.scope.to_owned(),
            claim.key.to_owned(),
            *claim.fingerprint,
        );
        let (lease, retention) = (claim.lease, claim.retention);
        tokio::spawn(async move {
            let claim = Claim {
                scope: &scope,
                key: &key,
                fingerprint: &fingerprint,
                lease,
                retention,
            };
            let result = store.try_claim(&claim).await;
            if let Ok(Some(claimed)) = &result {
                let gone = {
                    let mut hold = lock(&state);
                    let gone = matches!(*hold, Hold::Gone);
                    if !gone {
                        *hold = Hold::Holding(claimed.fence);
                    }
                    gone
                };
                if gone {
                    abandon(store, claimed.fence, &counters).await;
                    return;
                }
            }
            let _ = answer.send(result);
        });
        heard
            .await
            .unwrap_or_else(|_| Err(StoreError::new("the claim's task ended without an answer")))
    }

    /// Ends the lease now, while this request still holds it, before going on.
    pub(crate) async fn end_now(&self) {
        let holding = std::mem::replace(&mut *lock(&self.state), Hold::Done);
        if let Hold::Holding(fence) = holding {
            abandon(self.store.clone(), fence, &self.counters).await;
        }
    }

    /// The outcome is written, or the record released.
    pub(crate) fn done(&self) {
        *lock(&self.state) = Hold::Done;
    }
}

async fn abandon<S: Store>(store: S, fence: Fence, counters: &Counters) {
    Counters::add(&counters.abandoned);
    tracing::info!(target: "safe_retry_server", event = "abandoned", attempt = fence.attempt, "the request ended without an outcome; its lease ends now");
    if let Err(error) = store.abandon(fence).await {
        tracing::warn!(target: "safe_retry_server", event = "abandon_failed", %error, "the lease will run out instead");
    }
}

impl<S: Store> Drop for Held<S> {
    fn drop(&mut self) {
        let fence = match std::mem::replace(&mut *lock(&self.state), Hold::Gone) {
            Hold::Holding(fence) => fence,
            // A claim on its way sees `Gone` and ends its own lease; nothing else holds.
            Hold::Claiming | Hold::Gone | Hold::Done => return,
        };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, counters) = (self.store.clone(), self.counters.clone());
        runtime.spawn(async move { abandon(store, fence, &counters).await });
    }
}

/// The stored answer again, marked as a replay.
fn replay<S, R>(
    config: &Config<S>,
    scope: &str,
    key: &str,
    stored: &StoredAnswer,
) -> Response<ReplyBody<R>> {
    Counters::add(&config.counters.replays);
    tracing::debug!(target: "safe_retry_server", event = "replay", scope, key);
    let mut response = match &stored.body {
        Some(body) => {
            let mut response = Response::new(ReplyBody::full(body.clone()));
            let headers = response.headers_mut();
            for (name, value) in &stored.headers {
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
