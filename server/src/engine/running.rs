//! Running and completing: the handler runs under the claim, and its answer is stored with its
//! local effects — unless the answer is not an outcome (a recovery point, a rejection, a
//! failure of the store, the pool or the layer, a status the layer is told not to store).

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body::Body;
use http_body_util::BodyExt;
use tower_service::Service;

use crate::body::{BoxError, ReplyBody, Whole};
use crate::config::{Config, Count};
use crate::events::Event;
use crate::execution::{Execution, Snapshot};
use crate::problem::Problem;
use crate::store::{Claimed, Completion, Fence, RecordState, Store};
use crate::transport::{Mark, mark_of};

use super::answers::{own, replay, taken_over, unavailable, whole};
use super::claim::Owned;

/// What became of an execution, beside its answer: the reconciler counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ended {
    /// The answer is stored.
    Completed,
    /// The handler left the record at a recovery point, or failed without an outcome.
    Unfinished,
    /// The record had been started too often and ended failed.
    Failed,
    /// Another attempt took the record over.
    Fenced,
    /// The handler rejected the request; the record is gone.
    Rejected,
    /// The store failed.
    StoreFailed,
}

/// How many times the claimed record has been started in its generation, this start included.
pub(crate) fn starts(claimed: &Claimed) -> i64 {
    claimed.fence.attempt - claimed.generation + 1
}

/// Runs the handler for a claimed request and stores its outcome: the part of a request's way
/// that a resumption by the reconciler shares. From the claim until the outcome is written, a
/// failure or a drop of this future ends the lease at once (`held`), so a retry need not wait
/// it out.
pub(crate) async fn execute<Svc, S, B, R>(
    config: &Config<S>,
    mut inner: Svc,
    mut parts: Parts,
    body: Bytes,
    rebody: fn(Bytes) -> B,
    owned: Owned<S>,
) -> Result<(Response<ReplyBody<R>>, Ended), Svc::Error>
where
    Svc: Service<Request<B>, Response = Response<R>>,
    S: Store,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let (scope, key, claimed) = (&owned.scope, &owned.key, &owned.claimed);
    config.counters.add(Count::Claims);
    if claimed.taken_over {
        config.counters.add(Count::Takeovers);
        crate::events::emit!(config.events, Event::Takeover, scope = %scope, key = %key, attempt = claimed.fence.attempt);
    } else {
        crate::events::emit!(config.events, Event::Claim, scope = %scope, key = %key);
    }
    if starts(claimed) > i64::from(config.max_attempts) {
        let detail = format!(
            "the request was started {} times without finishing; it is kept failed, with its last recovery point, for an operator",
            config.max_attempts
        );
        return Ok(end_failed(config, &owned, &detail).await);
    }
    let execution = Execution::new(
        config.store.clone(),
        crate::execution::Claimed {
            scope: scope.clone(),
            key: key.clone(),
            identity: claimed.identity.as_str().into(),
            fence: claimed.fence,
            taken_over: claimed.taken_over,
            lease: config.lease,
            counters: config.counters.clone(),
            snapshot: Snapshot::of(&parts, &body, &config.saved_headers),
            events: config.events.clone(),
        },
    );
    parts.extensions.insert(execution.clone());
    // The handler failed without an answer: its transaction rolls back as it drops, and
    // `held` ends the lease, so a retry takes the record over.
    let response = inner.call(Request::from_parts(parts, rebody(body))).await?;
    let Ok(tx) = execution.close() else {
        config.counters.add(Count::StoreFailures);
        crate::events::emit!(config.events, Event::LocalHeld, scope = %scope, key = %key);
        let detail =
            "the handler still held its Local transaction when it answered; nothing was recorded";
        return Ok((
            own(config, Problem::HandlerFailed, detail, None),
            Ended::Unfinished,
        ));
    };
    Ok(settle(config, response, tx, &owned).await)
}

/// What the handler's answer makes of the record.
async fn settle<S, R>(
    config: &Config<S>,
    response: Response<R>,
    tx: Option<S::Tx>,
    owned: &Owned<S>,
) -> (Response<ReplyBody<R>>, Ended)
where
    S: Store,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let (scope, key, fence) = (&owned.scope, &owned.key, owned.claimed.fence);
    let (mut head, body) = response.into_parts();
    let mark = mark_of(&*config.front, &mut head);
    let passed = |head, body| Response::from_parts(head, ReplyBody::inner(Bytes::new(), body));
    match mark {
        None => complete(config, head, body, tx, owned).await,
        Some(Mark::Fenced) => {
            // Another attempt holds the record: this holder wrote nothing, and says what
            // happened.
            drop(tx);
            owned.held.done();
            (fenced_answer(config, owned).await, Ended::Fenced)
        }
        Some(Mark::Unfinished) => {
            // Not an outcome: the record stays at its last recovery point, and its lease ends
            // before the answer leaves, so a retry with the key, or the reconciler, resumes it.
            drop(tx);
            owned.held.end_now().await;
            config.counters.add(Count::Unfinished);
            let status = head.status.as_u16();
            crate::events::emit!(config.events, Event::Unfinished, scope = %scope, key = %key, attempt = fence.attempt, status);
            (passed(head, body), Ended::Unfinished)
        }
        Some(Mark::Rejected) => match config.store.release(tx, fence).await {
            Ok(_) => {
                owned.held.done();
                config.counters.add(Count::Rejections);
                crate::events::emit!(config.events, Event::Rejected, scope = %scope, key = %key, status = head.status.as_u16());
                (passed(head, body), Ended::Rejected)
            }
            Err(error) => (unavailable(config, &error), Ended::StoreFailed),
        },
    }
}

/// Reads the answer up to the storage limit, stores it with the local effects, then sends it.
async fn complete<S, R>(
    config: &Config<S>,
    head: http::response::Parts,
    mut body: R,
    tx: Option<S::Tx>,
    owned: &Owned<S>,
) -> (Response<ReplyBody<R>>, Ended)
where
    S: Store,
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let (scope, key, fence) = (&owned.scope, &owned.key, owned.claimed.fence);
    let read = match read_answer(&mut body, config.max_answer_body).await {
        Ok(read) => read,
        Err(error) => {
            config.counters.add(Count::StoreFailures);
            crate::events::emit!(config.events, Event::AnswerFailed, scope = %scope, key = %key, error = %error);
            // Dropping `tx` rolls the local effects back; `held` lets a retry run it.
            drop(tx);
            let detail = "the handler's answer failed while it was read; nothing was recorded; retry with the same key";
            return (
                own(config, Problem::HandlerFailed, detail, None),
                Ended::Unfinished,
            );
        }
    };
    let stored = match &read {
        Read::Whole(whole) => {
            config
                .front
                .stored(&head, Some(&whole.data), whole.trailers.as_ref())
        }
        Read::Over(_) => config.front.stored(&head, None, None),
    };
    match config.store.complete(tx, fence, &stored).await {
        Err(error) => (unavailable(config, &error), Ended::StoreFailed),
        Ok(Completion::Completed) => {
            owned.held.done();
            config.counters.add(Count::Completions);
            crate::events::emit!(config.events, Event::Completed, scope = %scope, key = %key, status = head.status.as_u16());
            let body = match read {
                Read::Whole(whole) => ReplyBody::whole(whole),
                Read::Over(read) => ReplyBody::inner(read, body),
            };
            (Response::from_parts(head, body), Ended::Completed)
        }
        Ok(Completion::Fenced) => {
            owned.held.done();
            (fenced_answer(config, owned).await, Ended::Fenced)
        }
    }
}

/// What was read of an answer.
enum Read {
    /// All of it, within the limit: its bytes and its trailers.
    Whole(Whole),
    /// The first bytes past the limit; the rest is still in the body.
    Over(Bytes),
}

/// The answer's body up to `limit` bytes, with its trailers when it ends within it.
async fn read_answer<R>(body: &mut R, limit: usize) -> Result<Read, BoxError>
where
    R: Body<Data = Bytes> + Unpin,
    R::Error: Into<BoxError>,
{
    let mut read = BytesMut::new();
    let mut trailers: Option<HeaderMap> = None;
    while let Some(frame) = body.frame().await {
        match frame.map_err(Into::into)?.into_data() {
            Ok(data) => {
                read.extend_from_slice(&data);
                if read.len() > limit {
                    return Ok(Read::Over(read.freeze()));
                }
            }
            Err(frame) => {
                if let Ok(more) = frame.into_trailers() {
                    trailers.get_or_insert_with(HeaderMap::new).extend(more);
                }
            }
        }
    }
    Ok(Read::Whole(Whole {
        data: read.freeze(),
        trailers,
    }))
}

/// The answer of a holder that another attempt took over (at a recovery point or at its
/// completion): it wrote nothing, and its caller is still waiting for its own request. It
/// waits up to `fenced_wait` for the other attempt's outcome and replays it; if the record is
/// still running then, or is no longer this holder's generation (renewed, or swept and made
/// again: another identity), it answers `503 taken-over`, which a client retries with the same
/// key. Never the other generation's outcome, and never `409`.
pub(crate) async fn fenced_answer<S: Store, R>(
    config: &Config<S>,
    owned: &Owned<S>,
) -> Response<ReplyBody<R>> {
    let (scope, key) = (&owned.scope, &owned.key);
    config.counters.add(Count::Fenced);
    crate::events::emit!(
        config.events,
        Event::Fenced,
        scope = %scope,
        key = %key,
        attempt = owned.claimed.fence.attempt,
        "another attempt took this record over; this holder's writes were rolled back"
    );
    let until = tokio::time::Instant::now() + config.fenced_wait;
    let mut pause = Duration::from_millis(10);
    loop {
        match config.store.read(scope, key).await {
            Err(error) => return unavailable(config, &error),
            Ok(Some(record))
                if record.identity == owned.claimed.identity
                    && record.fingerprint == owned.fingerprint =>
            {
                if let RecordState::Completed(stored) = record.state {
                    return replay(config, scope, key, &stored);
                }
            }
            // Renewed or made again: another generation's outcome is not this request's.
            Ok(_) => return taken_over(config),
        }
        let now = tokio::time::Instant::now();
        if now >= until {
            return taken_over(config);
        }
        tokio::time::sleep(pause.min(until - now)).await;
        pause = (pause * 2).min(Duration::from_millis(200));
    }
}

/// Ends the record `failed` with a `gave-up` problem that every later request with its key is
/// sent: a record started too often, or one whose saved request cannot be run again.
pub(crate) async fn end_failed<S: Store, R>(
    config: &Config<S>,
    owned: &Owned<S>,
    detail: &str,
) -> (Response<ReplyBody<R>>, Ended) {
    let (scope, key, fence): (&str, &str, Fence) = (&owned.scope, &owned.key, owned.claimed.fence);
    let answer = config.front.own(Problem::GaveUp, detail, None);
    let (head, body) = answer.into_parts();
    let stored = config.front.stored(&head, Some(&body), None);
    match config
        .store
        .fail(fence, &stored, config.failed_retention)
        .await
    {
        Err(error) => (unavailable(config, &error), Ended::StoreFailed),
        Ok(Completion::Fenced) => {
            owned.held.done();
            (fenced_answer(config, owned).await, Ended::Fenced)
        }
        Ok(Completion::Completed) => {
            owned.held.done();
            config.counters.add(Count::Failed);
            crate::events::emit!(
                config.events,
                Event::GaveUp,
                scope,
                key,
                attempt = fence.attempt,
                detail
            );
            (whole(Response::from_parts(head, body)), Ended::Failed)
        }
    }
}
