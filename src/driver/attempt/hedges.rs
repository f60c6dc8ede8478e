//! A hedged gRPC call in flight (A6's hedging policy): up to the policy's attempts copies of
//! the call, each with its own limit (the call's deadline), sent when the course
//! (`engine::course::Course`) says, the door asked for readiness first and the core
//! (`Decider::copy`) whether each may go; every copy's end judged and counted as it comes,
//! and the call's outcome the copy that ends it, the others dropped (hyper resets their
//! streams, and the server sees the cancellation).
//!
//! Nothing here decides: when a copy goes and when the call ends is the course's rule, whether
//! a copy may go the core's, and what each copy carries `request::Sent::copy`'s.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use http::Extensions;

use super::{Chain, Lent, Running};
use crate::clock::AttemptTimer;
use crate::driver::body::Outcome;
use crate::driver::claim::{self, Beneath, Claiming};
use crate::driver::trace::{LogLevels, Traced};
use crate::engine::classify::Verdict;
use crate::engine::course::{Course, Then};
use crate::engine::decide::Plan;
use crate::engine::observed::Observed;
use crate::engine::schedule::Wait;
use crate::error::LastError;
use crate::stop::StopReason;

/// A hedged call in flight: its copies out, its course, the timer of its next copy, and the
/// last failure, which is its outcome if no copy answers.
pub(crate) struct Hedges<'s, 'l, 'p, 'q, 'd, N: Beneath> {
    lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    door: &'s N,
    span: &'s tracing::Span,
    /// Where each copy's end that does not end the call is traced.
    log: &'s LogLevels,
    /// The extensions the further copies go with, one for each the policy allows.
    spares: std::slice::IterMut<'s, Extensions>,
    copies: Vec<Copy<'s, N>>,
    course: Course,
    /// The next copy's timer, and the instant it was armed for.
    due: Option<(AttemptTimer, Instant)>,
    /// The next copy's time has come, and the door is being asked whether it can take it: what
    /// it made ready so far.
    asking: Option<Option<N::Ready>>,
    /// The last failure, and its copy's number.
    last: Option<(Outcome<N::Reply>, u32)>,
}

/// One copy out: its number, the door's future, its timer and its limit.
struct Copy<'s, N: Beneath + 's> {
    number: u32,
    running: Pin<Box<Running<'s, N>>>,
    timer: AttemptTimer,
    limit: Duration,
}

impl<'s, 'l, 'p, 'q, 'd, N: Beneath + 's> Hedges<'s, 'l, 'p, 'q, 'd, N> {
    /// Sends the call's first copy down `chain` as `plan` says, its course started with
    /// `delay` between copies; `spares` holds a copy of the request's extensions for each
    /// further copy. `None` when no timer can be made for the first copy.
    pub(crate) fn launch(
        chain: Chain<'s, N>,
        spares: &'s mut [Extensions],
        (plan, delay, log): (&Plan, Duration, &'s LogLevels),
        lent: &'l mut Lent<'p, 'q, 'd, N::Request, N::Reply>,
    ) -> Option<Self> {
        let Chain {
            extensions,
            next,
            span,
        } = chain;
        let clock = lent.tools.clock;
        let now = clock.get().now();
        let timer = clock.timeout(plan.limit, Some(now)).ok()?;
        claim::announce(extensions, span, plan.number);
        let sending = lent.sent.copy(lent.kept, plan, lent.decider.rules());
        let id = (claim::claim_id(extensions), lent.sent.print);
        let running = Claiming::new(id, span, || next.run(sending, extensions));
        lent.decider.sent();
        let first = Copy {
            number: plan.number,
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
            course: Course::start(delay, now),
            due: None,
            asking: None,
            last: None,
        };
        Some(hedges)
    }

    /// The call's outcome and verdict (final), once it has them.
    fn poll_course(&mut self, cx: &mut Context<'_>) -> Poll<(Outcome<N::Reply>, Verdict, bool)> {
        loop {
            if let Some(ended) = self.poll_copies(cx) {
                return Poll::Ready(ended);
            }
            let now = self.lent.tools.clock.get().now();
            if self.asking.is_none() {
                // Never past the call's deadline: there the core refuses the copy.
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
            assert!(waits, "a hedged call waits on nothing");
            return Poll::Pending;
        }
    }

    /// Polls the copies out and their timers; the call's outcome when a copy's end ends it.
    fn poll_copies(&mut self, cx: &mut Context<'_>) -> Option<(Outcome<N::Reply>, Verdict, bool)> {
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
            let number = self.copies.swap_remove(at).number;
            let lent = &mut *self.lent;
            let seen = self.door.seen(&outcome, lent.kept.went_to());
            let verdict = lent.judge().verdict(&seen, number);
            let observed = Observed::of(&seen, verdict, lent.kept.resend());
            let clock = lent.tools.clock.get();
            let now = clock.now();
            let end = lent.decider.copy_ended(observed, now, &|| clock.wall_now());
            let then = self.course.ended(end, now);
            match then {
                Then::End(stop) => return Some(self.end(outcome, number, stop)),
                Then::Go => {
                    // Traced as an attempt is, with the wait before the next copy.
                    if let Some(watcher) = lent.sent.watcher.as_deref() {
                        let decision = match self.course.due() {
                            Some(at) => Wait::Sleep(
                                lent.decider.copy_at(at, now).saturating_duration_since(now),
                            ),
                            None => Wait::Stop(self.course.closed()),
                        };
                        let traced = Traced {
                            number,
                            outcome: &outcome,
                            fault: seen.fault(),
                            verdict,
                            decision,
                            floor: None,
                        };
                        self.span.in_scope(|| self.log.attempt(watcher, traced));
                    }
                    self.last = Some((outcome, number));
                }
            }
        }
        None
    }

    /// The next copy's time has come and the door is `ready`: the copy goes if the core lets
    /// it, else no copy goes any more; the call's outcome if that ends it.
    fn send(&mut self, ready: N::Ready) -> Option<(Outcome<N::Reply>, Verdict, bool)> {
        let lent = &mut *self.lent;
        let clock = lent.tools.clock;
        let now = clock.get().now();
        let plan = match lent.decider.copy(now, lent.kept.resend()) {
            Ok(plan) => plan,
            Err(stop) => return self.close(stop),
        };
        let Ok(timer) = clock.timeout(plan.limit, Some(now)) else {
            return self.close(StopReason::TimerUnavailable);
        };
        let Some(extensions) = self.spares.next() else {
            return self.close(StopReason::AttemptsExhausted);
        };
        claim::announce(extensions, self.span, plan.number);
        let sending = lent.sent.copy(lent.kept, &plan, lent.decider.rules());
        lent.decider.sent();
        let id = (claim::claim_id(extensions), lent.sent.print);
        let door = self.door;
        let running = Claiming::new(id, self.span, || door.run_ready(ready, sending, extensions));
        self.copies.push(Copy {
            number: plan.number,
            running: Box::pin(running),
            timer,
            limit: plan.limit,
        });
        self.course.sent(now);
        None
    }

    /// No copy goes any more, for `stop`: the call's outcome, the last failure, if no copy is
    /// out.
    fn close(&mut self, stop: StopReason) -> Option<(Outcome<N::Reply>, Verdict, bool)> {
        self.due = None;
        match self.course.close(stop) {
            Then::Go => None,
            Then::End(stop) => {
                let (last, number) = self.last.take().expect("a call ends after a failure");
                Some(self.end(last, number, stop))
            }
        }
    }

    /// The call ends with copy `number`'s `outcome`, for `stop`: every other copy is given up
    /// here (dropped, its stream reset).
    fn end(
        &mut self,
        outcome: Outcome<N::Reply>,
        number: u32,
        stop: StopReason,
    ) -> (Outcome<N::Reply>, Verdict, bool) {
        self.copies.clear();
        if number > 1 {
            self.lent.decider.copy_won();
        }
        (outcome, Verdict::Final(stop), false)
    }
}

// Nothing in it is pinned in place: each copy's future is boxed.
impl<'s, N: Beneath + 's> Unpin for Hedges<'s, '_, '_, '_, '_, N> {}

impl<'s, N: Beneath + 's> Future for Hedges<'s, '_, '_, '_, '_, N> {
    type Output = (Outcome<N::Reply>, Verdict, bool);

    /// The call's outcome, with a final verdict.
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.poll_course(cx)
    }
}

#[cfg(all(test, feature = "grpc"))]
mod tests;
