//! One attempt, the driver's side: the copy of the request it sends down the rest of the
//! chain, raced against its timer, and the outcome it ends in, judged, with its body read.
//!
//! An attempt of one copy (nearly every attempt) is a [`Flight`]: its copy goes at once,
//! racing its timer; when the timer fires the core says whether the copy is cut there or runs
//! on (`Decider::at_limit`). An attempt the core planned with a hedge, or a hedged gRPC call,
//! is a course of copies, [`Hedges`] (`hedges.rs`), boxed: few requests are hedged, and this
//! path is kept lean.
//!
//! # Why a hedge, and why budgeted
//!
//! A dependency that answers most attempts in 10 ms and one in a hundred in a second makes the
//! tail of every caller that waits on it a second long. A second copy sent when the first has
//! waited longer than nearly all answers take (the `p(1 - m)` latency) answers in the usual
//! time nearly always, for about `m` more requests ("The Tail at Scale", Dean and Barroso,
//! 2013). Unbounded, hedging is a retry storm in waiting; so a hedge is a retry sent early, and
//! everything that limits a retry limits it (`decide`).
//!
//! Nothing here decides: which requests may be hedged is `classify`'s rule, when and whether the
//! core's; what a copy carries is `request::Sent::copy`'s, the one place that puts the key and
//! the attempt headers on a copy.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use http::Extensions;

use crate::clock::{AttemptTimer, SharedClock};
use crate::driver::body;
use crate::driver::body::{Outcome, Reply};
use crate::driver::claim::{self, Beneath, Claiming, Outgoing};
use crate::driver::request::{Kept, Sent};
use crate::engine::classify::Verdict;
use crate::engine::course::Course;
use crate::engine::decide::{Decider, Plan};
use crate::engine::rules::Judge;
use crate::error::LastError;
use crate::maybe_send::BoxFuture;
use crate::rng::RandomSource;

/// Where an attempt's copies go: the rest of the chain, with the request's extensions, in its
/// span.
pub(crate) struct Chain<'s, N> {
    pub(crate) extensions: &'s mut Extensions,
    pub(crate) next: &'s N,
    pub(crate) span: &'s tracing::Span,
}

impl<'s, N> Chain<'s, N> {
    /// Copies go down `next` with `extensions`, in `span`.
    #[inline(always)]
    pub(crate) fn new(
        extensions: &'s mut Extensions,
        next: &'s N,
        span: &'s tracing::Span,
    ) -> Self {
        Chain {
            extensions,
            next,
            span,
        }
    }
}

/// What an attempt borrows while it runs: the request's own state and how its outcomes are
/// judged, the core, the clock (for the time, and a hedge's timers) and the random source,
/// and the first copy's timer, which the driver keeps for the answer's body after it.
pub(crate) struct Lent<'p, 's, 'd, Q: Outgoing, R: Reply> {
    kept: &'p mut Kept<Q, R>,
    sent: &'p Sent<'s>,
    decider: &'p mut Decider<'d>,
    tools: Tools<'p>,
    timer: &'p mut AttemptTimer,
}

/// The clock and the random source.
#[derive(Clone, Copy)]
pub(crate) struct Tools<'p> {
    pub(crate) clock: &'p SharedClock,
    pub(crate) rng: &'p dyn RandomSource,
}

impl<'p, 's, 'd, Q: Outgoing, R: Reply> Lent<'p, 's, 'd, Q, R> {
    /// What an attempt borrows, judged under the request's policy, all but the timer, which the
    /// returned closure takes.
    #[inline]
    pub(crate) fn new(
        kept: &'p mut Kept<Q, R>,
        sent: &'p Sent<'s>,
        decider: &'p mut Decider<'d>,
        tools: Tools<'p>,
    ) -> impl FnOnce(&'p mut AttemptTimer) -> Self {
        move |timer| Lent {
            kept,
            sent,
            decider,
            tools,
            timer,
        }
    }
}

impl<Q: Outgoing, R: Reply> Lent<'_, '_, '_, Q, R> {
    /// How the request's outcomes are judged: under its policy and rules (made when asked,
    /// not held across the attempt's waits).
    #[inline]
    pub(crate) fn judge(&self) -> Judge<'_> {
        Judge {
            judging: self.sent.judging(self.decider.policy()),
            rules: self.decider.rules(),
        }
    }

    /// The time on the request's clock.
    pub(crate) fn now(&self) -> crate::clock::Instant {
        self.tools.clock.get().now()
    }

    /// The course of the attempt about to go at `now`, planned with a hedge after `delay`.
    pub(crate) fn course(&self, delay: Duration, now: crate::clock::Instant) -> Course {
        self.decider.course(delay, now)
    }
}

/// A copy running down the rest of the chain: the door's own future, marked as claimed.
pub(crate) type Running<'s, N> = Claiming<'s, <N as Beneath>::Running<'s>>;

/// A body being read into memory (`buffer_body`), with the bytes read.
type Reading<R> = BoxFuture<'static, ReadBody<R>>;
type ReadBody<R> = Result<(R, Option<bytes::Bytes>), <R as Reply>::Error>;

/// An answer's body being read, racing its copy's timer: for the classifier to see it before
/// the verdict, or, the verdict given, for the caller. While it is, an attempt's copies are
/// not polled.
struct ReadingBody<R: Reply> {
    read: Reading<R>,
    then: AfterRead,
}

/// What follows a body read.
#[derive(Clone, Copy)]
enum AfterRead {
    /// Judge the answer with its body, as the classifier sees it.
    Judge,
    /// The verdict was given: the answer is the attempt's outcome.
    Done,
}

impl<R: Reply> ReadingBody<R> {
    /// Starts reading the body of `outcome`, an answer, up to `max` bytes.
    fn start(outcome: Outcome<R>, max: usize, then: AfterRead) -> Box<Self> {
        let Ok(response) = outcome else {
            unreachable!("only an answer has a body to read");
        };
        Box::new(ReadingBody {
            read: Box::pin(body::buffer(response, max)),
            then,
        })
    }

    /// The answer with its body, or the error that cut it: the read's, or the copy's `timer`
    /// (its limit `limit`) firing first.
    fn poll(
        &mut self,
        timer: &mut AttemptTimer,
        limit: Duration,
        cx: &mut Context<'_>,
    ) -> Poll<(Outcome<R>, Option<bytes::Bytes>)> {
        Poll::Ready(match self.read.as_mut().poll(cx) {
            Poll::Ready(Ok((response, body))) => (Ok(response), body),
            Poll::Ready(Err(e)) => (Err(LastError::Beneath(e)), None),
            Poll::Pending => {
                ready!(Pin::new(timer).poll(cx));
                (Err(claim::timed_out(limit)), None)
            }
        })
    }
}

/// How much of `outcome`'s body to read before its verdict, for the classifier to see it, if
/// any: an answer's, when the judge reads bodies first.
fn body_first<R: Reply>(judge: &Judge<'_>, outcome: &Outcome<R>) -> Option<usize> {
    (judge.judging.body_first()).filter(|_| R::READS_BODY && outcome.is_ok())
}

/// One attempt of one copy in flight: polled until it has an outcome, judged, with its body
/// read as the policy says.
pub(crate) struct Flight<'s, 'l, 'p, 'q, 'd, N: Beneath> {
    lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    /// The door beneath: where the copy goes, and what reads what it ends in.
    door: &'s N,
    number: u32,
    /// The copy's time limit, longer if it ran on past it.
    limit: Duration,
    /// The copy, in the place the driver keeps for it: the door's future as it is, not boxed.
    first: Pin<&'l mut Option<Running<'s, N>>>,
    /// An answer's body being read, racing the copy's timer. Boxed: only a policy that reads
    /// bodies needs room for it.
    reading: Option<Box<ReadingBody<N::Reply>>>,
}

impl<'s, 'l, 'p, 'q, 'd, N: Beneath + 's> Flight<'s, 'l, 'p, 'q, 'd, N> {
    /// Sends attempt `plan.number`'s copy down `chain`, into `first`.
    #[inline(always)]
    pub(crate) fn launch(
        chain: Chain<'s, N>,
        mut first: Pin<&'l mut Option<Running<'s, N>>>,
        plan: &Plan,
        lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    ) -> Self {
        let Chain {
            extensions,
            next,
            span,
        } = chain;
        claim::announce(extensions, span, plan.number);
        let sending = lent.sent.copy(lent.kept, plan, lent.decider.rules());
        let id = (claim::claim_id(extensions), lent.sent.print);
        first.set(Some(Claiming::new(id, span, || {
            next.run(sending, extensions)
        })));
        lent.decider.sent();
        Flight {
            lent,
            door: next,
            number: plan.number,
            limit: plan.limit,
            first,
            reading: None,
        }
    }

    /// The attempt's outcome and verdict once it has them. The outcome is looked at where it
    /// lies and moved once, to where it goes: nearly every request's answer passes through
    /// here.
    #[inline(always)]
    fn poll_judged(&mut self, cx: &mut Context<'_>) -> Poll<(Outcome<N::Reply>, Verdict, bool)> {
        loop {
            if let Some(reading) = self.reading.as_deref_mut() {
                let (outcome, body) = ready!(reading.poll(self.lent.timer, self.limit, cx));
                self.reading = None;
                // Judged with the body the classifier is to see (a body read for it is not
                // read again); after a verdict, judged again: a body cut off is transient,
                // and a body read whole leaves the verdict as it was (the same status and
                // head).
                let seen = self.door.seen(&outcome, self.lent.kept.went_to());
                let verdict = (self.lent.judge()).verdict_on(&seen, self.number, body.as_ref());
                return Poll::Ready((outcome, verdict, false));
            }
            let outcome = ready!(self.poll_copy(cx));
            // Read first when the classifier is to see the body.
            if let Some(max) = body_first(&self.lent.judge(), &outcome) {
                self.reading = Some(ReadingBody::start(outcome, max, AfterRead::Judge));
                continue;
            }
            let seen = self.door.seen(&outcome, self.lent.kept.went_to());
            let verdict = self.lent.judge().verdict(&seen, self.number);
            // The body is read within the copy's time.
            if let Some(max) = body::to_read(&self.lent.judge().judging, &outcome, verdict) {
                self.reading = Some(ReadingBody::start(outcome, max, AfterRead::Done));
                continue;
            }
            return Poll::Ready((outcome, verdict, false));
        }
    }

    /// Polls the copy and its timer until one of them ends: when the timer fires the core
    /// says whether the copy is cut or runs on.
    #[inline(always)]
    fn poll_copy(&mut self, cx: &mut Context<'_>) -> Poll<Outcome<N::Reply>> {
        let lent = &mut *self.lent;
        let clock = lent.tools.clock;
        let Some(work) = self.first.as_mut().as_pin_mut() else {
            unreachable!("an attempt is polled with its copy out");
        };
        if let Poll::Ready(done) = work.poll(cx) {
            self.first.set(None);
            return Poll::Ready(done.map_err(LastError::Beneath));
        }
        while Pin::new(&mut *lent.timer).poll(cx).is_ready() {
            let now = clock.get().now();
            let longer = (lent.decider.at_limit(now))
                .and_then(|more| Some((more, clock.timeout(more, Some(now)).ok()?)));
            let Some((more, longer)) = longer else {
                self.first.set(None);
                return Poll::Ready(Err(claim::timed_out(self.limit)));
            };
            self.limit += more;
            *lent.timer = longer;
        }
        Poll::Pending
    }
}

impl<'s, N: Beneath + 's> Future for Flight<'s, '_, '_, '_, '_, N> {
    type Output = (Outcome<N::Reply>, Verdict, bool);

    /// The attempt's outcome and verdict (and `false`: no hedge answered).
    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_judged(cx)
    }
}

mod hedges;
pub(crate) use hedges::run as hedged;

#[cfg(test)]
mod tests {
    use std::task::{Context, Waker};

    use http::Method;
    use reqwest::{Request, Response};

    use super::*;
    use crate::driver::scripted::Scripted;
    use crate::engine::decide::Cap;
    use crate::engine::decide::Step;
    use crate::engine::dependency::Dependency;
    use crate::engine::policy::RetryPolicy;

    /// One attempt, on no socket: its first copy goes when launched, carrying the key the
    /// request was given and the attempt header; it is pending until the door answers; a 503
    /// is judged transient and the attempt ends with it, its copy no longer out. Its timer, on
    /// a fake clock, cuts a copy that has not answered when the clock passes its limit, as a
    /// timeout (transient).
    #[test]
    fn one_attempt_sends_its_copy_and_ends_with_its_judged_outcome() {
        let clock = crate::fake_clock::FakeClock::new();
        let shared = SharedClock::new(clock.clone());
        let rng = crate::rng::SeededRng::new(1);
        let policy = RetryPolicy::builder()
            .attempt_timeout(Duration::from_secs(2))
            .build()
            .unwrap();
        let dependency = Dependency::new("one", policy);
        let mut cx = Context::from_waker(Waker::noop());
        for answers in [true, false] {
            let door = Scripted::default();
            let request = Request::new(Method::POST, "http://127.0.0.1/x".parse().unwrap());
            let mut extensions = Extensions::new();
            let now = shared.get().now();
            let (policy, accounts) = (&dependency.policy, dependency.accounts());
            let mut decider = Decider::start(policy, accounts, Cap::Policy, &Method::POST, now);
            let given = (&request, &extensions);
            let Ok((sent, facts)) = Sent::prepare(&dependency, None, false, given, None) else {
                panic!("a POST with a key may go");
            };
            decider.know(facts);
            let key = sent
                .key
                .as_ref()
                .map(|key| key.value.clone())
                .expect("a key");
            let mut kept = Kept::<Request, Response>::new(request);
            let Step::Send(plan) = decider.plan(now, kept.resend(), &rng) else {
                panic!("the first attempt goes");
            };
            assert_eq!((plan.number, plan.limit), (1, Duration::from_secs(2)));
            let mut timer = shared.timeout(plan.limit, Some(now)).unwrap();
            let tools = Tools {
                clock: &shared,
                rng: &rng,
            };
            let lent = &mut Lent::new(&mut kept, &sent, &mut decider, tools)(&mut timer);
            let span = tracing::Span::none();
            let chain = Chain {
                extensions: &mut extensions,
                next: &door,
                span: &span,
            };
            let first = std::pin::pin!(None);
            let flight = Flight::launch(chain, first, &plan, lent);
            let mut flight = std::pin::pin!(flight);
            assert_eq!(
                door.sent(),
                1,
                "the first copy goes when the attempt is launched"
            );
            assert!(flight.as_mut().poll(&mut cx).is_pending(), "no answer yet");
            let (outcome, verdict, by_hedge) = if answers {
                let mut answer = http::Response::new(reqwest::Body::from(""));
                *answer.status_mut() = http::StatusCode::SERVICE_UNAVAILABLE;
                door.answer(0, Ok(Response::from(answer)));
                let Poll::Ready(ended) = flight.as_mut().poll(&mut cx) else {
                    panic!("the answer ends the attempt");
                };
                ended
            } else {
                clock.advance(Duration::from_millis(1_999));
                assert!(
                    flight.as_mut().poll(&mut cx).is_pending(),
                    "within its limit"
                );
                clock.advance(Duration::from_millis(1));
                let Poll::Ready(ended) = flight.as_mut().poll(&mut cx) else {
                    panic!("the timer cuts the copy at its limit");
                };
                assert_eq!(door.dropped(), 1, "the cut copy is dropped");
                ended
            };
            assert!(!by_hedge);
            assert!(matches!(verdict, Verdict::Transient(_)), "{verdict:?}");
            match (answers, outcome) {
                (true, Ok(response)) => assert_eq!(response.status(), 503),
                (false, Err(err)) => assert!(
                    err.to_string().contains("attempt timed out after 2s"),
                    "{err}"
                ),
                (answers, other) => panic!("{answers}: {other:?}"),
            }
            // The copy carried the request's key;
            // the original is kept for a retry without it: keys go on copies only.
            let seen = door.headers.lock().unwrap().clone();
            assert_eq!(seen.len(), 1);
            assert_eq!(seen[0].get("idempotency-key"), Some(&key));
            assert!(kept.request().headers().get("idempotency-key").is_none());
        }
    }
}
