//! One attempt, the driver's side: the copies of the request it sends down the rest of the
//! chain, raced against their timers, and the outcome it ends in, judged, with its body read.
//!
//! An attempt is one path with one optional state more. Its first copy goes at once, racing its
//! timer; when the timer fires the core says whether the copy is cut there or runs on
//! (`Decider::at_limit`). When the core planned a hedge, a second timer runs beside it: when it
//! fires with the first copy still out, the core is asked whether a hedge may go
//! (`Decider::hedge_plan`); if so, a second copy goes with its own limit, down the rest of the
//! chain with a copy of the request's extensions (so that instances of this middleware further
//! in see it as claimed, and pass it through). The first answer that is not a transient
//! failure wins, and the other copy is dropped: hyper then closes its connection, and the
//! server sees the cancellation. A copy that fails transiently while the other is out does not
//! end the attempt: the other may still answer.
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
use crate::engine::decide::{Decider, Plan};
use crate::engine::rules::Judge;
use crate::error::LastError;
use crate::rng::RandomSource;

/// Where an attempt's copies go: the rest of the chain, with the request's extensions, in its
/// span.
pub(crate) struct Chain<'s, N> {
    pub(crate) extensions: &'s mut Extensions,
    pub(crate) next: &'s N,
    pub(crate) span: &'s tracing::Span,
}

/// What an attempt borrows while it runs: the request's own state and how its outcomes are
/// judged, the core, the clock (for the time, and the hedge's timers) and the random source,
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

    /// The most copies the request's policy allows, the first included.
    pub(crate) fn most_copies(&self) -> u32 {
        self.decider.policy().max_attempts()
    }
}

/// A copy running down the rest of the chain: the door's own future, marked as claimed.
pub(crate) type Running<'s, N> = Claiming<'s, <N as Beneath>::Running<'s>>;

/// A body being read into memory (`buffer_body`), with the bytes read.
type Reading<R> = Pin<Box<dyn Future<Output = ReadBody<R>> + Send>>;
type ReadBody<R> = Result<(R, Option<bytes::Bytes>), <R as Reply>::Error>;

/// One attempt in flight: its first copy and, when the core planned a hedge, the hedged state;
/// polled until it has an outcome, judged, with its body read as the policy says.
pub(crate) struct Flight<'s, 'l, 'p, 'q, 'd, N: Beneath> {
    lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    /// The door beneath: where each copy goes, and what reads what it ends in.
    door: &'s N,
    number: u32,
    /// The first copy's time limit, longer if it ran on past it.
    limit: Duration,
    /// The first copy, in the place the driver keeps for it: the door's future as it is, not
    /// boxed.
    first: Pin<&'l mut Option<Running<'s, N>>>,
    /// Boxed: only a read the core may hedge needs room for a second copy.
    hedged: Option<Box<Hedged<'s, N>>>,
    /// An answer's body being read, racing the first copy's timer: for the classifier to see
    /// it before the verdict, or, the verdict given, for the caller. While it is, the copies
    /// are not polled. Boxed: only a policy that reads bodies needs room for it.
    reading: Option<Box<ReadingBody<N::Reply>>>,
}

/// A body being read, and what follows.
struct ReadingBody<R: Reply> {
    read: Reading<R>,
    then: AfterRead,
    by_hedge: bool,
}

/// What follows a body read.
#[derive(Clone, Copy)]
enum AfterRead {
    /// Judge the answer with its body, as the classifier sees it.
    Judge,
    /// The verdict was given: the answer is the attempt's outcome.
    Done,
}

/// The hedged state: its delay's timer, the extensions lent to its copy, the copy (boxed, as
/// only a hedge needs it), and a transient failure of one copy kept while the other is out.
struct Hedged<'s, N: Beneath> {
    due: Option<AttemptTimer>,
    /// The delay has passed and the door is being asked whether it can take a copy: what it
    /// made ready so far. A copy that waits for readiness is no hedge yet: nothing is decided
    /// or paid until the door is ready.
    asking: Option<Option<N::Ready>>,
    lend: Option<&'s mut Extensions>,
    span: &'s tracing::Span,
    second: Option<Second<'s, N>>,
    failed: Option<(Outcome<N::Reply>, Verdict)>,
}

/// A hedge's copy on its way (boxed: only a hedge needs room for it), its timer and its limit.
struct Second<'s, N: Beneath + 's> {
    running: Pin<Box<Running<'s, N>>>,
    timer: AttemptTimer,
    limit: Duration,
}

impl<'s, 'l, 'p, 'q, 'd, N: Beneath + 's> Flight<'s, 'l, 'p, 'q, 'd, N> {
    /// Sends attempt `plan.number`'s first copy down `chain`, into `first`; `spare` takes the
    /// copy of the extensions a hedge would go with, if the core planned one. The hedging
    /// delay's timer is armed as the first copy starts (a middleware may take time before its
    /// future is polled); without a timer there is no hedge.
    #[inline(always)]
    pub(crate) fn launch(
        chain: Chain<'s, N>,
        spare: &'s mut Extensions,
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
        let hedged = plan.hedge_after.map(|after| {
            // Copied before the first copy borrows the request's own for as long as it runs.
            spare.clone_from(extensions);
            Box::new(Hedged {
                due: lent.tools.clock.timeout(after, None).ok(),
                asking: None,
                lend: Some(spare),
                span,
                second: None,
                failed: None,
            })
        });
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
            hedged,
            reading: None,
        }
    }

    /// The attempt's outcome and verdict, and whether its hedge answered, once it has them. The
    /// outcome is looked at where it lies and moved once, to where it goes: nearly every
    /// request's answer passes through here.
    #[inline(always)]
    fn poll_judged(&mut self, cx: &mut Context<'_>) -> Poll<(Outcome<N::Reply>, Verdict, bool)> {
        loop {
            let (outcome, verdict, by_hedge) = if self.reading.is_some() {
                let (outcome, verdict, by_hedge, then) = ready!(self.poll_read(cx));
                if let AfterRead::Done = then {
                    return Poll::Ready((outcome, verdict, by_hedge));
                }
                (outcome, verdict, by_hedge)
            } else {
                let (outcome, by_hedge) = ready!(self.poll_copies(cx));
                // Read first when the classifier is to see the body.
                if let (Some(max), true) = (self.lent.judge().judging.body_first(), outcome.is_ok())
                {
                    self.read(outcome, max, AfterRead::Judge, by_hedge);
                    continue;
                }
                let seen = self.door.seen(&outcome, self.lent.kept.went_to());
                let verdict = self.lent.judge().verdict(&seen, self.number);
                (outcome, verdict, by_hedge)
            };
            if let Some(hedged) = self.hedged.as_deref_mut() {
                let other_out = if by_hedge {
                    self.first.is_some()
                } else {
                    hedged.second.is_some()
                };
                if other_out && matches!(verdict, Verdict::Transient(..)) {
                    // The other copy may still answer.
                    hedged.failed = Some((outcome, verdict));
                    continue;
                }
                // The other copy, if out, is given up here: dropped, its connection closed.
                (hedged.failed, hedged.second) = (None, None);
            }
            self.first.set(None);
            // The body is read within the first copy's time, which began first: a hedge's
            // answer gets a little less than its own limit, never more than the attempt's.
            if let Some(max) = body::to_read(&self.lent.judge().judging, &outcome, verdict) {
                self.read(outcome, max, AfterRead::Done, by_hedge);
                continue;
            }
            return Poll::Ready((outcome, verdict, by_hedge));
        }
    }

    /// Starts reading the body of `outcome`, an answer, up to `max` bytes.
    fn read(&mut self, outcome: Outcome<N::Reply>, max: usize, then: AfterRead, by_hedge: bool) {
        let Ok(response) = outcome else {
            unreachable!("only an answer has a body to read");
        };
        self.reading = Some(Box::new(ReadingBody {
            read: Box::pin(body::buffer(response, max)),
            then,
            by_hedge,
        }));
    }

    /// Polls the body being read, racing the first copy's timer: the answer with its body, or
    /// the error that cut it, judged (again, after a verdict: a body cut off is transient).
    fn poll_read(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<(Outcome<N::Reply>, Verdict, bool, AfterRead)> {
        let Some(reading) = self.reading.as_deref_mut() else {
            unreachable!("polled only while a body is read");
        };
        let (then, by_hedge) = (reading.then, reading.by_hedge);
        let (outcome, body) = match reading.read.as_mut().poll(cx) {
            Poll::Ready(Ok((response, body))) => (Ok(response), body),
            Poll::Ready(Err(e)) => (Err(LastError::Beneath(e)), None),
            Poll::Pending => {
                ready!(Pin::new(&mut *self.lent.timer).poll(cx));
                (Err(claim::timed_out(self.limit)), None)
            }
        };
        self.reading = None;
        // Judged with the body the classifier is to see; after a verdict, judged again: a body
        // cut off is transient, and a body read whole leaves the verdict as it was (the same
        // status and head).
        let seen = self.door.seen(&outcome, self.lent.kept.went_to());
        let verdict = (self.lent.judge()).verdict_on(&seen, self.number, body.as_ref());
        Poll::Ready((outcome, verdict, by_hedge, then))
    }

    /// Polls the copies out and their timers, until one of them ends: the first copy's timer
    /// asks the core whether it is cut or runs on; when the hedging delay's fires, a hedge may
    /// go (and is polled at once).
    #[inline(always)]
    fn poll_copies(&mut self, cx: &mut Context<'_>) -> Poll<(Outcome<N::Reply>, bool)> {
        loop {
            let lent = &mut *self.lent;
            let clock = lent.tools.clock;
            if let Some(work) = self.first.as_mut().as_pin_mut() {
                if let Poll::Ready(done) = work.poll(cx) {
                    self.first.set(None);
                    return Poll::Ready((done.map_err(LastError::Beneath), false));
                }
                while Pin::new(&mut *lent.timer).poll(cx).is_ready() {
                    let now = clock.get().now();
                    let longer = (lent.decider.at_limit(now))
                        .and_then(|more| Some((more, clock.timeout(more, Some(now)).ok()?)));
                    let Some((more, longer)) = longer else {
                        self.first.set(None);
                        return Poll::Ready((Err(claim::timed_out(self.limit)), false));
                    };
                    self.limit += more;
                    *lent.timer = longer;
                }
            }
            let Some(hedged) = self.hedged.as_deref_mut() else {
                assert!(self.first.is_some(), "an attempt waits with no copy out");
                return Poll::Pending;
            };
            if let Some(second) = hedged.second.as_mut() {
                let ended = match second.running.as_mut().poll(cx) {
                    Poll::Ready(done) => done.map_err(LastError::Beneath),
                    Poll::Pending => match Pin::new(&mut second.timer).poll(cx) {
                        Poll::Ready(()) => Err(claim::timed_out(second.limit)),
                        Poll::Pending => return Poll::Pending,
                    },
                };
                hedged.second = None;
                return Poll::Ready((ended, true));
            }
            if let Some(Poll::Ready(())) = hedged.due.as_mut().map(|due| Pin::new(due).poll(cx)) {
                // Once: the delay's timer is gone.
                hedged.due = None;
                hedged.asking = Some(None);
            }
            // The door is asked with this task's waker, so a door that becomes ready wakes it;
            // once it is ready (at most once: the asking ends), the core decides the hedge, and
            // this loop turns once more to poll it.
            if let Some(ready) = hedged.asking.as_mut() {
                if let Poll::Ready(able) = self.door.poll_ready(ready, cx) {
                    let ready = hedged.asking.take().flatten();
                    if let (true, Some(ready)) = (able, ready) {
                        self.send_hedge(ready);
                        continue;
                    }
                }
            }
            let out = self.first.is_some() || hedged.second.is_some();
            assert!(out, "an attempt waits with no copy out");
            return Poll::Pending;
        }
    }

    /// The hedging delay has passed with the first copy out, and the door is `ready` for a
    /// copy: a second copy goes if the core plans one and a timer can be made for it.
    fn send_hedge(&mut self, ready: N::Ready) {
        let Some(hedged) = self.hedged.as_deref_mut() else {
            return;
        };
        let lent = &mut *self.lent;
        let Tools { clock, rng } = lent.tools;
        let now = clock.get().now();
        let Some(plan) = lent.decider.hedge_plan(now, lent.kept.resend(), rng) else {
            return;
        };
        let (Ok(timer), Some(extensions)) =
            (clock.timeout(plan.limit, Some(now)), hedged.lend.take())
        else {
            lent.decider.hedge_sent(false);
            return;
        };
        let sending = lent.sent.copy(lent.kept, &plan, lent.decider.rules());
        lent.decider.hedge_sent(true);
        let id = (claim::claim_id(extensions), lent.sent.print);
        let next = self.door;
        let running = Claiming::new(id, hedged.span, || {
            next.run_ready(ready, sending, extensions)
        });
        hedged.second = Some(Second {
            running: Box::pin(running),
            timer,
            limit: plan.limit,
        });
    }
}

impl<'s, N: Beneath + 's> Future for Flight<'s, '_, '_, '_, '_, N> {
    type Output = (Outcome<N::Reply>, Verdict, bool);

    /// The attempt's outcome and verdict, and whether its hedge answered.
    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_judged(cx)
    }
}

mod hedges;
pub(crate) use hedges::Hedges;

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
            let mut spare = Extensions::new();
            let first = std::pin::pin!(None);
            let flight = Flight::launch(chain, &mut spare, first, &plan, lent);
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
