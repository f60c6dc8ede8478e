//! Running the rest of the chain for one attempt: the request marked as claimed while it runs,
//! the attempt (and the body read inside it) raced against its timer, and the copy kept for the
//! next attempt.
//!
//! # One layer retries
//!
//! Three layers that each retry three times turn one request into twenty-seven, and a layer
//! whose attempt timeout is shorter than an inner layer's whole loop would retry that loop. So
//! the first instance to see a request (the outermost) marks it as its own while it runs the
//! rest of the chain, and every instance further in that finds the mark passes the request
//! through untouched: one layer retries, whatever the timing, and it can tell the others before
//! anything is sent. The mark is a thread-local holding the address of the request's
//! extensions (see `Claiming`): no allocation, unlike a mark in the extensions themselves, and
//! sound because the rest of a chain cannot leave the task that polls it (`Next` borrows the
//! extensions). The limit: only instances of this crate know each other; retries made by
//! another library in the same chain are not seen.

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::Poll;

use std::time::Duration;

use http::Extensions;
use reqwest::Request;

use crate::classify::{Judging, Verdict};
use crate::clock::AttemptTimer;

/// Tells the middleware and transport beneath which attempt this is, before they see it (a first
/// attempt carries nothing: [`RetryAttempt::of`](crate::RetryAttempt::of) reads its absence).
#[inline]
pub(crate) fn announce(extensions: &mut Extensions, span: &tracing::Span, number: u32) {
    if number > 1 {
        extensions.insert(crate::observe::RetryAttempt { number });
        span.record("http.request.resend_count", number - 1);
    }
}

/// Whether an instance further out on this request's path already makes its attempts.
pub(crate) fn claimed(extensions: &Extensions) -> bool {
    CLAIMED.get() == claim_id(extensions)
}

/// The request for the next attempt, from what is kept: a copy when another attempt may follow
/// (the original stays kept), else the original itself, and the original too when it cannot be
/// copied (nothing is then kept).
pub(crate) fn take_attempt(kept: &mut Option<Request>, copy: bool) -> Request {
    if let Some(copy) = kept.as_ref().filter(|_| copy).and_then(Request::try_clone) {
        return copy;
    }
    let Some(original) = kept.take() else {
        unreachable!("a request is kept for every attempt that is made");
    };
    original
}

thread_local! {
    /// Which request's chain is being run on this thread, if any: the address of its
    /// extensions, set by the instance that makes its attempts while it runs the rest of the
    /// chain (0: none).
    static CLAIMED: Cell<usize> = const { Cell::new(0) };
}

/// What identifies a request's passage through the chain: every middleware of it is handed the
/// same extensions, which stay at one address while the request is in the chain, and a
/// middleware's future cannot move the rest of the chain to another task (it borrows them).
pub(crate) fn claim_id(extensions: &Extensions) -> usize {
    std::ptr::from_ref(extensions) as usize
}

/// The rest of the chain for one attempt, run with its request marked as claimed on the
/// thread, so that instances nearer the transport pass it through instead of retrying it again.
/// Costs no allocation, unlike a mark in the extensions; the mark is the extensions' address,
/// so a request that a middleware of the chain makes of its own (a token refresh, say) through
/// another client is not mistaken for this one.
///
/// The logical request's span is entered for as long as the rest of the chain runs, so the
/// spans and events of the middleware and transport beneath are its children.
pub(crate) struct Claiming<'s, F> {
    id: usize,
    span: &'s tracing::Span,
    run: F,
}

impl<'s, F> Claiming<'s, F> {
    /// Starts the rest of the chain (`start`) with the request already marked: a middleware may
    /// do work before its future is first polled.
    #[inline]
    pub(crate) fn new(id: usize, span: &'s tracing::Span, start: impl FnOnce() -> F) -> Self {
        let _marked = Mark::set(id);
        let run = span.in_scope(start);
        Claiming { id, span, run }
    }
}

impl<F: Future + Unpin> Future for Claiming<'_, F> {
    type Output = F::Output;

    fn poll(mut self: Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<F::Output> {
        let _marked = Mark::set(self.id);
        if self.span.is_disabled() {
            return Pin::new(&mut self.run).poll(cx);
        }
        let _entered = self.span.enter();
        Pin::new(&mut self.run).poll(cx)
    }
}

/// Marks a request as claimed until dropped, then puts back the mark it replaced (a chain may
/// run inside another's, for a request of its own).
struct Mark(usize);

impl Mark {
    fn set(id: usize) -> Mark {
        Mark(CLAIMED.replace(id))
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        CLAIMED.set(self.0);
    }
}

/// Polls `work` until it finishes, or `timer` fires first (`None`). `work` is polled first.
pub(crate) fn race<F: Future + Unpin, T: Future<Output = ()>>(
    mut work: F,
    mut timer: Pin<&mut T>,
) -> impl Future<Output = Option<F::Output>> {
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(done) = Pin::new(&mut work).poll(cx) {
            return Poll::Ready(Some(done));
        }
        timer.as_mut().poll(cx).map(|()| None)
    })
}

/// Polls `work` until it finishes, or `timer` fires first (`None`) and `at_limit` gives no
/// longer timer to run on with: called each time the timer fires, it answers the timer that
/// replaces it, or `None` to cut the attempt there. `work` is polled first.
pub(crate) fn race_on<F, L>(
    mut work: F,
    mut timer: Pin<&mut AttemptTimer>,
    mut at_limit: L,
) -> impl Future<Output = Option<F::Output>>
where
    F: Future + Unpin,
    L: FnMut() -> Option<AttemptTimer>,
{
    std::future::poll_fn(move |cx| {
        if let Poll::Ready(done) = Pin::new(&mut work).poll(cx) {
            return Poll::Ready(Some(done));
        }
        while timer.as_mut().poll(cx).is_ready() {
            match at_limit() {
                Some(longer) => timer.set(longer),
                None => return Poll::Ready(None),
            }
        }
        Poll::Pending
    })
}

/// The body of an attempt's answer read inside the attempt (the policy's `buffer_body`, up to
/// `max` bytes), racing the attempt's timer; judged again if reading it failed: a body cut off
/// is transient. With the outcome and its verdict come how to judge it, the attempt's number
/// and its time limit.
pub(crate) async fn read_body(
    (outcome, verdict, max, (judging, number, limit)): (
        reqwest_middleware::Result<reqwest::Response>,
        Verdict,
        usize,
        (&Judging<'_>, u32, Duration),
    ),
    timer: Pin<&mut AttemptTimer>,
) -> (reqwest_middleware::Result<reqwest::Response>, Verdict) {
    let Ok(response) = outcome else {
        return (outcome, verdict);
    };
    let reading = std::pin::pin!(crate::body::buffer(response, max));
    let outcome = match race(reading, timer).await {
        // The same status and head: the verdict stands.
        Some(Ok((read, _))) => return (Ok(read), verdict),
        Some(Err(e)) => Err(reqwest_middleware::Error::Reqwest(e)),
        None => Err(timed_out(limit)),
    };
    let verdict = judging.verdict(&outcome, number);
    (outcome, verdict)
}

/// The verdict on an attempt's outcome under a policy that reads bodies (`buffer_body`): the
/// body read first when the classifier is to see it, else after the verdict for an answer that
/// will not be retried. With the outcome come how to judge it, the attempt's number and its
/// time limit.
pub(crate) async fn judged(
    outcome: reqwest_middleware::Result<reqwest::Response>,
    (judging, number, limit): (&Judging<'_>, u32, Duration),
    timer: Pin<&mut AttemptTimer>,
) -> (reqwest_middleware::Result<reqwest::Response>, Verdict) {
    if let Some(max) = judging.body_first() {
        return read_then_judge(outcome, max, (judging, number, limit), timer).await;
    }
    let verdict = judging.verdict(&outcome, number);
    match crate::body::to_read(judging, &outcome, verdict) {
        None => (outcome, verdict),
        Some(max) => read_body((outcome, verdict, max, (judging, number, limit)), timer).await,
    }
}

/// An answer's body read inside the attempt (up to `max` bytes, racing the attempt's timer)
/// before it is judged, so that the classifier sees it; a body cut off, or out of time, makes
/// the outcome an error, judged as one. With the outcome come how to judge it, the attempt's
/// number and its time limit.
pub(crate) async fn read_then_judge(
    outcome: reqwest_middleware::Result<reqwest::Response>,
    max: usize,
    (judging, number, limit): (&Judging<'_>, u32, Duration),
    timer: Pin<&mut AttemptTimer>,
) -> (reqwest_middleware::Result<reqwest::Response>, Verdict) {
    let (outcome, body) = match outcome {
        Err(e) => (Err(e), None),
        Ok(response) => {
            let reading = std::pin::pin!(crate::body::buffer(response, max));
            match race(reading, timer).await {
                Some(Ok((read, body))) => (Ok(read), body),
                Some(Err(e)) => (Err(reqwest_middleware::Error::Reqwest(e)), None),
                None => (Err(timed_out(limit)), None),
            }
        }
    };
    let verdict = judging.verdict_on(&outcome, number, body.as_ref());
    (outcome, verdict)
}

/// The error of an attempt that ran out of its time.
pub(crate) fn timed_out(limit: Duration) -> reqwest_middleware::Error {
    reqwest_middleware::Error::middleware(crate::error::AttemptTimeout { after: limit })
}
