//! A hedged request in flight: the copies of an attempt the core planned with a hedge (an
//! HTTP read, two copies of one attempt), or of a hedged gRPC call (A6's hedging policy, up to
//! the policy's attempts, each an attempt of its own), one machine for both. The copies go
//! when the course (`engine::course::Course`) says, the door asked for readiness first and the
//! core (`Decider::copy`) whether each may go, each with its own limit; every copy's end is
//! judged (its body read first when the classifier is to see it) and told to the core and the
//! course as it comes, and the outcome is the copy that ends the request, or its attempt, the
//! others dropped (hyper closes their connections or resets their streams, and the server sees
//! the cancellation).
//!
//! Nothing here decides: when a copy goes and when the request ends is the course's rule,
//! whether a copy may go the core's, and what each copy carries `request::Sent::copy`'s.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use crate::clock::Instant;

use http::Extensions;

use super::{AfterRead, Chain, Lent, ReadingBody, Running, body_first};
use crate::clock::AttemptTimer;
use crate::driver::body::{self, Outcome};
use crate::driver::claim::{self, Beneath, Claiming};
use crate::driver::trace::{LogLevels, Traced};
use crate::engine::classify::Verdict;
use crate::engine::course::{Course, Then};
use crate::engine::decide::Plan;
use crate::engine::observed::Observed;
use crate::engine::schedule::Wait;
use crate::error::LastError;
use crate::stop::StopReason;

/// A hedged request in flight: its copies out, its course, the timer of its next copy, the
/// body being read, and the last failure, which is its outcome if no copy answers.
pub(crate) struct Hedges<'s, 'l, 'p, 'q, 'd, N: Beneath> {
    lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    door: &'s N,
    span: &'s tracing::Span,
    /// Where each copy's end that does not end a hedged call is traced.
    log: &'s LogLevels,
    /// The extensions the further copies go with, one for each the course allows.
    spares: std::slice::IterMut<'s, Extensions>,
    copies: Vec<Copy<'s, N>>,
    course: Course,
    /// The next copy's timer, and the instant it was armed for.
    due: Option<(AttemptTimer, Instant)>,
    /// The next copy's time has come, and the door is being asked whether it can take it: what
    /// it made ready so far.
    asking: Option<Option<N::Ready>>,
    /// The attempt's time limit: the first copy's, within which any body is read.
    limit: Duration,
    /// An answer's body being read, racing the first copy's timer (the attempt's, which began
    /// first: an answer of a later copy gets a little less than its own limit, never more
    /// than the attempt's); while it is, the copies are not polled.
    reading: Option<Read<N::Reply>>,
    /// The last failure, its copy and its verdict.
    last: Option<(Outcome<N::Reply>, Which, Verdict)>,
}

/// One copy out: which it is, the door's future, its timer and its limit.
struct Copy<'s, N: Beneath + 's> {
    which: Which,
    running: Pin<Box<Running<'s, N>>>,
    timer: AttemptTimer,
    limit: Duration,
}

/// Which copy an outcome came from: its attempt's number, and whether it went first.
#[derive(Debug, Clone, Copy)]
struct Which {
    number: u32,
    first: bool,
}

/// A body being read, and the copy it came from.
struct Read<R: crate::driver::body::Reply> {
    body: Box<ReadingBody<R>>,
    which: Which,
}

/// The request's outcome, its verdict, and whether a copy after the first gave it.
pub(crate) type Ending<R> = (Outcome<R>, Verdict, bool);

/// A hedged request's copies in flight, planned by `plan` with `delay` between them, on the
/// course the core sets: each further copy with its own copy of the request's extensions
/// (made before the first copy borrows them, and held here, for as long as the copies run);
/// `None` when no timer can be made for its first copy.
pub(crate) async fn run<'s, N: Beneath + 's>(
    chain: Chain<'s, N>,
    (plan, delay, log): (Plan, Duration, &'s LogLevels),
    lent: &mut Lent<'_, '_, '_, N::Request, N::Reply>,
) -> Option<Ending<N::Reply>> {
    let now = lent.now();
    let course = lent.course(delay, now);
    let mut spares = vec![Extensions::new(); course.most() as usize];
    for spare in &mut spares {
        spare.clone_from(chain.extensions);
    }
    let launched = Hedges::launch(chain, &mut spares, (course, now), (&plan, log), lent);
    Some(launched?.await)
}

impl<'s, 'l, 'p, 'q, 'd, N: Beneath + 's> Hedges<'s, 'l, 'p, 'q, 'd, N> {
    /// Sends the request's first copy down `chain` as `plan` says, on `course`, started at
    /// `now`; `spares` holds a copy of the request's extensions for each further copy the
    /// course allows. `None` when no timer can be made for the first copy.
    pub(crate) fn launch(
        chain: Chain<'s, N>,
        spares: &'s mut [Extensions],
        (course, now): (Course, Instant),
        (plan, log): (&Plan, &'s LogLevels),
        lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    ) -> Option<Self> {
        let Chain {
            extensions,
            next,
            span,
        } = chain;
        let timer = lent.tools.clock.timeout(plan.limit, Some(now)).ok()?;
        claim::announce(extensions, span, plan.number);
        let sending = lent.sent.copy(lent.kept, plan, lent.decider.rules());
        let id = (claim::claim_id(extensions), lent.sent.print);
        let running = Claiming::new(id, span, || next.run(sending, extensions));
        lent.decider.sent();
        let first = Copy {
            which: Which {
                number: plan.number,
                first: true,
            },
            running: Box::pin(running),
            timer,
            limit: plan.limit,
        };
        let mut copies = Vec::with_capacity(spares.len() + 1);
        copies.push(first);
        let hedges = Hedges {
            lent,
            door: next,
            span,
            log,
            spares: spares.iter_mut(),
            copies,
            course,
            due: None,
            asking: None,
            limit: plan.limit,
            reading: None,
            last: None,
        };
        Some(hedges)
    }

    /// The request's (or its attempt's) outcome and verdict, once it has them.
    fn poll_course(&mut self, cx: &mut Context<'_>) -> Poll<Ending<N::Reply>> {
        loop {
            if let Some(read) = self.reading.as_mut() {
                let Poll::Ready((outcome, body)) = read.body.poll(self.lent.timer, self.limit, cx)
                else {
                    return Poll::Pending;
                };
                let Some(Read {
                    body: reading,
                    which,
                }) = self.reading.take()
                else {
                    unreachable!("a body was being read");
                };
                // Judged with the body the classifier is to see; after the verdict that ended
                // the request, judged again: a body cut off is transient (a read happens only
                // under a policy that buffers bodies, which a gRPC call's never does).
                let seen = self.door.seen(&outcome, self.lent.kept.went_to());
                let verdict = (self.lent.judge()).verdict_on(&seen, which.number, body.as_ref());
                match reading.then {
                    AfterRead::Done => return Poll::Ready((outcome, verdict, !which.first)),
                    AfterRead::Judge => {
                        if let Some(ended) = self.copy_end(outcome, which, verdict) {
                            return Poll::Ready(ended);
                        }
                        continue;
                    }
                }
            }
            if let Some(ended) = self.poll_copies(cx) {
                return Poll::Ready(ended);
            }
            if self.reading.is_some() {
                continue;
            }
            let now = self.lent.tools.clock.get().now();
            if self.asking.is_none() {
                // Never past the request's deadline: there the core refuses the copy.
                let due = self.course.due();
                match due.map(|at| self.lent.decider.copy_at(at, now)) {
                    Some(at) if at <= now => {
                        self.due = None;
                        self.asking = Some(None);
                    }
                    Some(at) => {
                        if self.due.as_ref().is_none_or(|(_, armed)| *armed != at) {
                            let wait = at.saturating_duration_since(now);
                            match self.lent.tools.clock.timeout(wait, Some(now)) {
                                Ok(timer) => self.due = Some((timer, at)),
                                Err(_) => {
                                    if let Some(ended) = self.close(StopReason::TimerUnavailable) {
                                        return Poll::Ready(ended);
                                    }
                                    continue;
                                }
                            }
                        }
                        if let Some((timer, _)) = self.due.as_mut() {
                            if Pin::new(timer).poll(cx).is_ready() {
                                self.due = None;
                                self.asking = Some(None);
                            }
                        }
                    }
                    None => self.due = None,
                }
            }
            // The door is asked with this task's waker, so a door that becomes ready wakes it;
            // once it is ready the core decides the copy, and the loop turns again to poll it.
            if let Some(ready) = self.asking.as_mut() {
                if let Poll::Ready(able) = self.door.poll_ready(ready, cx) {
                    let ready = self.asking.take().flatten();
                    let ended = match (able, ready) {
                        (true, Some(ready)) => self.send(ready),
                        // The door failed to become ready: no copy may go any more.
                        _ => self.close(StopReason::AttemptsExhausted),
                    };
                    if let Some(ended) = ended {
                        return Poll::Ready(ended);
                    }
                    continue;
                }
            }
            let waits = !self.copies.is_empty() || self.due.is_some() || self.asking.is_some();
            assert!(waits, "a hedged request waits on nothing");
            return Poll::Pending;
        }
    }

    /// Polls the copies out and their timers; the request's outcome when a copy's end ends it.
    /// A copy whose body the classifier is to see first has it read (`reading`), and this
    /// returns.
    fn poll_copies(&mut self, cx: &mut Context<'_>) -> Option<Ending<N::Reply>> {
        let mut at = 0;
        while at < self.copies.len() {
            let copy = &mut self.copies[at];
            let outcome = match copy.running.as_mut().poll(cx) {
                Poll::Ready(done) => done.map_err(LastError::Beneath),
                Poll::Pending => match Pin::new(&mut copy.timer).poll(cx) {
                    Poll::Ready(()) => Err(claim::timed_out(copy.limit)),
                    Poll::Pending => {
                        at += 1;
                        continue;
                    }
                },
            };
            let which = self.copies.swap_remove(at).which;
            if let Some(max) = body_first(&self.lent.judge(), &outcome) {
                let body = ReadingBody::start(outcome, max, AfterRead::Judge);
                self.reading = Some(Read { body, which });
                return None;
            }
            let seen = self.door.seen(&outcome, self.lent.kept.went_to());
            let verdict = self.lent.judge().verdict(&seen, which.number);
            if let Some(ended) = self.copy_end(outcome, which, verdict) {
                return Some(ended);
            }
            if self.reading.is_some() {
                return None;
            }
        }
        None
    }

    /// Copy `which` ended in `outcome`, judged `verdict`, told to the core and the course: the
    /// request's outcome if that ends it (its body first read, if the policy reads it: then
    /// `reading` holds it, and this returns `None`).
    fn copy_end(
        &mut self,
        outcome: Outcome<N::Reply>,
        which: Which,
        verdict: Verdict,
    ) -> Option<Ending<N::Reply>> {
        let lent = &mut *self.lent;
        let seen = self.door.seen(&outcome, lent.kept.went_to());
        let observed = Observed::of(&seen, verdict, lent.kept.resend());
        let clock = lent.tools.clock.get();
        let now = clock.now();
        let end = lent.decider.copy_ended(observed, now, &|| clock.wall_now());
        match self.course.ended(end, now) {
            Then::End(stop) => {
                // Every other copy is given up here (dropped, its stream reset).
                self.copies.clear();
                let judging = lent.judge().judging;
                if let Some(max) = body::to_read(&judging, &outcome, Verdict::Final(stop)) {
                    let body = ReadingBody::start(outcome, max, AfterRead::Done);
                    self.reading = Some(Read { body, which });
                    return None;
                }
                Some((outcome, Verdict::Final(stop), !which.first))
            }
            Then::Failed => Some((outcome, verdict, !which.first)),
            Then::Go => {
                // A hedged call's copy is traced as an attempt is, with the wait before the
                // next copy.
                if let (Some(watcher), true) = (lent.sent.watcher.as_deref(), self.course.is_call())
                {
                    let decision = match self.course.due() {
                        Some(at) => Wait::Sleep(
                            lent.decider.copy_at(at, now).saturating_duration_since(now),
                        ),
                        None => Wait::Stop(self.course.closed()),
                    };
                    let traced = Traced {
                        number: which.number,
                        outcome: &outcome,
                        fault: seen.fault(),
                        verdict,
                        decision,
                        floor: None,
                    };
                    self.span.in_scope(|| self.log.attempt(watcher, traced));
                }
                self.last = Some((outcome, which, verdict));
                None
            }
        }
    }

    /// The next copy's time has come and the door is `ready`: the copy goes if the core lets
    /// it, else no copy goes any more; the request's outcome if that ends it.
    fn send(&mut self, ready: N::Ready) -> Option<Ending<N::Reply>> {
        let lent = &mut *self.lent;
        let clock = lent.tools.clock;
        let now = clock.get().now();
        let plan = match lent.decider.copy(now, lent.kept.resend(), lent.tools.rng) {
            Ok(plan) => plan,
            Err(stop) => return self.close(stop),
        };
        let (Ok(timer), Some(extensions)) =
            (clock.timeout(plan.limit, Some(now)), self.spares.next())
        else {
            lent.decider.copy_sent(false);
            return self.close(StopReason::TimerUnavailable);
        };
        claim::announce(extensions, self.span, plan.number);
        let sending = lent.sent.copy(lent.kept, &plan, lent.decider.rules());
        lent.decider.copy_sent(true);
        let id = (claim::claim_id(extensions), lent.sent.print);
        let door = self.door;
        let running = Claiming::new(id, self.span, || door.run_ready(ready, sending, extensions));
        self.copies.push(Copy {
            which: Which {
                number: plan.number,
                first: false,
            },
            running: Box::pin(running),
            timer,
            limit: plan.limit,
        });
        self.course.sent(now);
        None
    }

    /// No copy goes any more, for `stop`: the request's outcome, the last failure, if no copy
    /// is out.
    fn close(&mut self, stop: StopReason) -> Option<Ending<N::Reply>> {
        self.due = None;
        let (last, which, verdict) = match self.course.close(stop) {
            Then::Go => return None,
            Then::End(stop) => {
                let (last, which, _) = self.last.take().expect("a call ends after a failure");
                (last, which, Verdict::Final(stop))
            }
            Then::Failed => self.last.take().expect("an attempt fails after a failure"),
        };
        Some((last, verdict, !which.first))
    }
}

// Nothing in it is pinned in place: each copy's future is boxed.
impl<'s, N: Beneath + 's> Unpin for Hedges<'s, '_, '_, '_, '_, N> {}

impl<'s, N: Beneath + 's> Future for Hedges<'s, '_, '_, '_, '_, N> {
    type Output = Ending<N::Reply>;

    /// The request's outcome and verdict (final for a hedged call), and whether a copy after
    /// the first gave it.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_course(cx)
    }
}

#[cfg(all(test, feature = "grpc"))]
mod tests;

#[cfg(test)]
mod attempts;
