//! Hedged reads, the driver's side: one attempt raced against a second copy of it, sent when
//! the first has waited past the dependency's hedging percentile.
//!
//! # Why, and why budgeted
//!
//! A dependency that answers most attempts in 10 ms and one in a hundred in a second makes the
//! tail of every caller that waits on it a second long. A second copy sent when the first has
//! waited longer than nearly all answers take (the `p(1 - m)` latency) answers in the usual
//! time nearly always, for about `m` more requests ("The Tail at Scale", Dean and Barroso,
//! 2013). Unbounded, hedging is a retry storm in waiting: a dependency that slows down for
//! everyone gets every request twice. So each hedge is paid for from the dependency's retry
//! budget, and the throttle, a spent quota and the deadline apply to it (`decide`).
//!
//! # The race
//!
//! The first copy goes at once; a timer for the hedging delay runs beside it. When the timer
//! fires with the first copy still out, the core is asked whether a hedge may go
//! (`Decider::hedge`); if so, a second copy goes with its own time limit, down the rest of the
//! chain with a copy of the request's extensions (so that instances of this middleware further
//! in see it as claimed, and pass it through). The first answer that is not a transient failure
//! wins, and the other copy is dropped: hyper then closes its connection, and the server sees
//! the cancellation. A copy that fails transiently while the other is out does not end the
//! attempt: the other may still answer. Only when both have failed is the last failure the
//! attempt's outcome, and the usual retry rules apply to it.
//!
//! Nothing here decides: which requests may be hedged is `classify`'s rule, when and whether is
//! the core's.

use std::future::Future;
use std::pin::Pin;
use std::task::Poll;
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::Next;

use crate::attempt_headers::AttemptHeaders;
use crate::body;
use crate::chain::{self, Claiming};
use crate::classify::{Judging, Verdict};
use crate::clock::{AttemptTimer, SharedClock};
use crate::decide::Decider;
use crate::rng::RandomSource;

/// What one hedged attempt needs of its request.
pub(crate) struct Hedged<'s, 'a> {
    pub(crate) kept: &'s mut Option<Request>,
    pub(crate) extensions: &'s mut Extensions,
    pub(crate) next: &'s Next<'a>,
    pub(crate) span: &'s tracing::Span,
    /// The attempt's number (the hedge carries the same).
    pub(crate) number: u32,
    /// The first copy's time limit, and the delay before a hedge.
    pub(crate) limit: Duration,
    pub(crate) after: Duration,
    pub(crate) headers: &'s AttemptHeaders,
    /// What is left before the deadline when the first copy is sent.
    pub(crate) left: Duration,
    pub(crate) judging: &'s Judging<'s>,
}

/// A copy running down the rest of the chain.
type Running<'a> = Pin<Box<dyn Future<Output = reqwest_middleware::Result<Response>> + Send + 'a>>;

/// What ended, when the copies are polled.
enum Event {
    First(reqwest_middleware::Result<Response>),
    Second(reqwest_middleware::Result<Response>),
    HedgeDue,
}

/// The attempt's outcome and verdict, from whichever copy answered; `timer` is the first
/// copy's.
pub(crate) async fn attempt(
    hedged: Hedged<'_, '_>,
    decider: &mut Decider<'_>,
    clock: &SharedClock,
    rng: &dyn RandomSource,
    mut timer: Pin<&mut AttemptTimer>,
) -> (reqwest_middleware::Result<Response>, Verdict) {
    let Hedged {
        kept,
        extensions,
        next,
        span,
        number,
        limit,
        after,
        headers,
        left,
        judging,
    } = hedged;
    // Copied before the first copy borrows the request's own for as long as it runs; lent to
    // the hedge, once.
    let mut second_extensions = extensions.clone();
    let second_id = chain::claim_id(&second_extensions);
    let mut spare = Some(&mut second_extensions);
    // Each copy's headers say what is left at its own send.
    let copy = |kept: &mut Option<Request>, left: Duration| {
        let mut sending = chain::take_attempt(kept, true);
        if headers.are_on() {
            headers.put_on(&mut sending, number, left);
        }
        sending
    };
    // Armed as the first copy starts (a middleware may take time before its future is
    // polled); without a timer there is no hedge, and the first copy goes on alone.
    let mut due = clock.timeout(after, None).ok().map(Box::pin);
    let sending = copy(kept, left);
    let id = chain::claim_id(extensions);
    let mut first = Some(Claiming::new(id, span, || {
        next.clone().run(sending, extensions)
    }));
    decider.attempt_started();
    let mut second: Option<Claiming<'_, Running<'_>>> = None;
    let mut second_timer: Option<(Pin<Box<AttemptTimer>>, Duration)> = None;
    // A copy's transient failure, kept while the other copy is out.
    let mut failed: Option<(reqwest_middleware::Result<Response>, Verdict, bool)> = None;
    loop {
        let event = std::future::poll_fn(|cx| {
            if let Some(work) = first.as_mut() {
                if let Poll::Ready(done) = Pin::new(work).poll(cx) {
                    return Poll::Ready(Event::First(done));
                }
                if timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::First(Err(chain::timed_out(limit))));
                }
            }
            if let (Some(work), Some((hedge_timer, hedge_limit))) =
                (second.as_mut(), second_timer.as_mut())
            {
                if let Poll::Ready(done) = Pin::new(work).poll(cx) {
                    return Poll::Ready(Event::Second(done));
                }
                if hedge_timer.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::Second(Err(chain::timed_out(*hedge_limit))));
                }
            }
            if let Some(hedge_due) = due.as_mut() {
                if hedge_due.as_mut().poll(cx).is_ready() {
                    return Poll::Ready(Event::HedgeDue);
                }
            }
            Poll::Pending
        })
        .await;
        let (outcome, by_hedge) = match event {
            Event::HedgeDue => {
                due = None;
                let now = clock.get().now();
                let url = kept.as_ref().map(Request::url);
                let Some(hedge_limit) = url.and_then(|url| decider.hedge(now, url, rng)) else {
                    continue;
                };
                let (Ok(hedge_timer), Some(running)) =
                    (clock.timeout(hedge_limit, Some(now)), spare.take())
                else {
                    decider.hedge_unsent();
                    continue;
                };
                let sending = copy(kept, decider.remaining(now));
                decider.hedge_started();
                second = Some(Claiming::new(second_id, span, || {
                    next.clone().run(sending, running)
                }));
                second_timer = Some((Box::pin(hedge_timer), hedge_limit));
                continue;
            }
            Event::First(outcome) => {
                first = None;
                (outcome, false)
            }
            Event::Second(outcome) => {
                second = None;
                (outcome, true)
            }
        };
        let (outcome, verdict) = match judging.body_first() {
            None => {
                let verdict = judging.verdict(&outcome, number);
                (outcome, verdict)
            }
            // Read for the classifier to see, within the first copy's time (see below).
            Some(max) => {
                let how = (judging, number, limit);
                Box::pin(chain::read_then_judge(outcome, max, how, timer.as_mut())).await
            }
        };
        let other_out = if by_hedge {
            first.is_some()
        } else {
            second.is_some()
        };
        if matches!(verdict, Verdict::Transient(..)) && other_out {
            // The other copy may still answer.
            failed = Some((outcome, verdict, by_hedge));
            continue;
        }
        drop(failed);
        // The other copy, if out, is given up here: dropped, its connection closed.
        drop((first, second));
        if by_hedge {
            decider.hedge_won();
        }
        // The body is read within the first copy's time, which began first: a hedge's answer
        // gets a little less than its own limit, never more than the attempt's.
        let (outcome, verdict) = match body::to_read(judging, &outcome, verdict) {
            None => (outcome, verdict),
            Some(max) => {
                let read = (outcome, verdict, max, (judging, number, limit));
                Box::pin(chain::read_body(read, timer.as_mut())).await
            }
        };
        return (outcome, verdict);
    }
}
