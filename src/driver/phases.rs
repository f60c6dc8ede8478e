//! The driver: the only code in the crate that awaits, and it decides nothing.
//!
//! One call to `send()` is one logical request, driven through three phases: *asking* the core
//! (`decide`) what the next attempt may do, an attempt *in flight* (`attempt`: its copy, or a
//! hedged request's course of copies, down the chain, judged by `classify`, its body read), and
//! *waiting* (a hold for
//! a spent quota, or the wait before a retry). Every answer comes from below: the plan of each
//! attempt and what follows it from the core, the key and what a copy carries from `attempt`
//! and `idempotency`, the verdict from `classify`, whether this instance retries at all from
//! `chain`. What is left here is the awaiting, and the order of the phases.

use std::borrow::BorrowMut;
use std::future::Future;
use std::ops::ControlFlow;
use std::ops::Deref;
use std::pin::Pin;
use std::time::Duration;

use crate::clock::Instant;

use http::Extensions;

use crate::clock::TimerUnavailable;
use crate::driver::attempt::{Chain, Flight, Lent, Tools, hedged};
use crate::driver::body;
use crate::driver::body::{Outcome, Reply};
use crate::driver::claim::{Beneath, Outgoing};
use crate::driver::middleware::RetryMiddleware;
use crate::driver::request::{Ends, Kept, KeptUrl, Last, Sent};
use crate::driver::trace::{self, Ended, Traced};
use crate::engine::advice;
use crate::engine::budget::RetryBudget;
use crate::engine::classify::Verdict;
use crate::engine::decide::{Decider, Plan, Step};
use crate::engine::dependency::{Dependency, RetryOverride};
use crate::engine::observed::Observed;
use crate::engine::schedule::Wait;
use crate::error::{InvalidConfig, LastError, NotSent, RetryError};
use crate::fault::Fault;
use crate::maybe_send::MaybeSend;
use crate::record::RetryRecord;
use crate::stop::StopReason;

impl RetryMiddleware {
    /// The logical request, as its phases: asking the core what the next attempt may do, an
    /// attempt in flight ([`Flight`]: one copy, or a hedged request's course of copies, its
    /// body read), and waiting
    /// (a hold for a spent quota, or the wait before a retry, with the last answer's body kept
    /// through it).
    ///
    /// Its future is the one boxed for the chain; its size is `tests/all/future_size.rs`'s
    /// bound, which says why. The rare states (an override, a body read, a kept answer, a
    /// hedged request's copies) are boxed where they arise.
    ///
    /// `next` is where each copy goes: the rest of the chain, or a tower service.
    ///
    /// `this` and `extensions` are borrowed by the reqwest door (the chain owns them) and owned
    /// by the tower door (its future owns everything it holds): either way they are held once,
    /// inside this future.
    pub(crate) fn execute<'a, N: Beneath + 'a>(
        this: impl Deref<Target = RetryMiddleware> + MaybeSend + 'a,
        request: N::Request,
        mut extensions: impl BorrowMut<Extensions> + MaybeSend + 'a,
        next: N,
    ) -> impl Future<Output = Handed<N::Reply>> + MaybeSend + 'a {
        let mut kept = Kept::new(request);
        async move {
            let (this, extensions) = (&*this, extensions.borrow_mut());
            let (dependency, span) = this.dependency_of(kept.request());
            let (overriding, cap, refused) = RetryOverride::of_request(extensions, dependency);
            let policy = overriding.as_deref().unwrap_or(&dependency.policy);
            let (method, mut now) = (kept.request().method(), this.clock.get().now());
            let mut decider = Decider::start(policy, dependency.accounts(), cap, method, now);
            let given = (&kept, &*extensions, &span, refused);
            let mut sent = match this.prepare(dependency, &mut decider, given) {
                ControlFlow::Continue(sent) => sent,
                ControlFlow::Break(end) => return end,
            };
            let mut phase = Phase::Asking;
            loop {
                phase = match phase {
                    Phase::Asking => match decider.plan(now, kept.resend(), &*this.rng.0) {
                        Step::Send(plan) => Phase::InFlight(plan),
                        Step::Hold(hold) => Phase::Waiting(hold),
                        Step::Stop(stop) => {
                            return this.stop(&span, stop, &decider, &mut kept, &mut sent);
                        }
                    },
                    Phase::InFlight(plan) => {
                        let Ok(mut timer) = this.clock.timeout(plan.limit, Some(now)) else {
                            break;
                        };
                        let lent = Lent::new(&mut kept, &sent, &mut decider, this.tools());
                        let chain = Chain::new(&mut *extensions, &next, &span);
                        let lent = &mut lent(&mut timer);
                        // One copy runs here, in this future; a course of copies is boxed (few
                        // are hedged). One not kept for another copy goes once: the core says.
                        let first = std::pin::pin!(None);
                        let judged = match plan.hedge_after {
                            None => Flight::launch(chain, first, &plan, lent).await,
                            Some(delay) => {
                                let course = hedged(chain, (plan, delay, &this.log), lent);
                                let Some(judged) = Box::pin(course).await else {
                                    break;
                                };
                                judged
                            }
                        };
                        let request = (&mut sent, &kept, &next);
                        let (outcome, fault, delay) =
                            match this.after(&span, plan.number, judged, &mut decider, request) {
                                ControlFlow::Continue(retried) => retried,
                                ControlFlow::Break(end) => return end,
                            };
                        // The body is read within the wait, not past it (none: what has come).
                        let reading = this.clock.get().now();
                        let Ok(kept_body) = this.keep_within(outcome, delay, reading) else {
                            break;
                        };
                        kept.previous = Some(Box::new((kept_body.await, fault)));
                        now = this.clock.get().now();
                        Phase::Waiting(delay.saturating_sub(now.saturating_duration_since(reading)))
                    }
                    Phase::Waiting(delay) => match this.clock.wait(delay).await {
                        Ok(()) => {
                            now = this.clock.get().now();
                            Phase::Asking
                        }
                        Err(_) => break,
                    },
                };
            }
            // The clock had no timer to time an attempt or a wait with.
            this.no_timer(&span, &decider, sent.ends(&kept))
        }
    }

    /// The dependency `request` goes to, and the request's span.
    #[inline(always)]
    fn dependency_of(&self, request: &impl Outgoing) -> (&Dependency, tracing::Span) {
        let dependency = (self.dependencies).pick(request.locate(), || request.address().path);
        (dependency, trace::request_span(&dependency.name, request))
    }

    /// The last outcome kept through the wait of `delay` that follows it, read at `reading`:
    /// its body read within the wait, not past it (with no wait, what has come); boxed, as
    /// only a retry needs it.
    fn keep_within<R: Reply>(
        &self,
        outcome: Outcome<R>,
        delay: Duration,
        reading: Instant,
    ) -> Result<Pin<Box<impl Future<Output = Outcome<R>>>>, TimerUnavailable> {
        let within = (!delay.is_zero()).then(|| self.clock.timeout(delay, Some(reading)));
        Ok(Box::pin(body::keep_within(
            outcome,
            body::KEPT,
            within.transpose()?,
        )))
    }

    /// What the request needs after it has gone (its key, who watches), with what the core
    /// needs to know of it told to `decider`; or its end, when it may not go (`refused`, an
    /// invalid key).
    #[inline(always)]
    fn prepare<'p, Q: Outgoing, R: Reply>(
        &'p self,
        dependency: &'p Dependency,
        decider: &mut Decider<'_>,
        (kept, extensions, span, refused): (&Kept<Q, R>, &Extensions, &tracing::Span, Refused),
    ) -> ControlFlow<Handed<R>, Sent<'p>> {
        let observer = self.observer.as_ref().map(|observer| &*observer.0);
        let watched = observer.is_some() || self.log.enabled();
        let given = (kept.request(), extensions);
        match Sent::prepare(dependency, observer, watched, given, refused) {
            Ok((sent, facts)) => {
                decider.know(facts);
                ControlFlow::Continue(sent)
            }
            Err(unsent) => {
                let ends = Ends {
                    key: None,
                    watcher: unsent.watcher.as_deref(),
                    url: kept,
                    answered: StopReason::Succeeded,
                };
                let last = (Err(LastError::NotSent(unsent.cause)), None);
                ControlFlow::Break(self.finish(span, last, unsent.stop, decider, ends))
            }
        }
    }

    /// What follows attempt `number`'s judged outcome: the core's decision, traced; the
    /// outcome, its fault and the wait when a retry follows, else the caller's outcome.
    #[inline(always)]
    fn after<Q: Outgoing, R: Reply>(
        &self,
        span: &tracing::Span,
        number: u32,
        (outcome, verdict, by_hedge): (Outcome<R>, Verdict, bool),
        decider: &mut Decider<'_>,
        (sent, kept, door): (
            &mut Sent<'_>,
            &Kept<Q, R>,
            &impl Beneath<Request = Q, Reply = R>,
        ),
    ) -> ControlFlow<Handed<R>, (Outcome<R>, Option<Fault>, Duration)> {
        let seen = door.seen(&outcome, kept.went_to());
        let fault = seen.fault();
        sent.took(&seen);
        let clock = self.clock.get();
        let observed = Observed::of(&seen, verdict, kept.resend());
        let times = (&|| clock.now(), &|| clock.wall_now());
        let decision = decider.ended(observed, by_hedge, times.0, times.1, &*self.rng.0);
        if let Some(watcher) = sent.watcher.as_deref() {
            let traced = Traced {
                number,
                outcome: &outcome,
                fault,
                verdict,
                decision,
                floor: decider.floor(),
            };
            span.in_scope(|| self.log.attempt(watcher, traced));
        }
        match decision {
            Wait::Stop(stop) => {
                let last = (outcome, fault);
                let ends = Ends {
                    answered: door.answered(),
                    ..sent.ends(kept)
                };
                ControlFlow::Break(self.finish(span, last, stop, decider, ends))
            }
            Wait::Sleep(delay) => ControlFlow::Continue((outcome, fault, delay)),
        }
    }

    /// The end of a request the core stopped before an attempt: its last outcome, or what says
    /// nothing was sent.
    fn stop<Q: Outgoing, R: Reply>(
        &self,
        span: &tracing::Span,
        stop: StopReason,
        decider: &Decider<'_>,
        kept: &mut Kept<Q, R>,
        sent: &mut Sent<'_>,
    ) -> Handed<R> {
        let last = kept.last_outcome(stop);
        self.finish(span, last, stop, decider, sent.ends(kept))
    }

    /// The caller's outcome, the request's end traced in its span: the response with its
    /// record, or the error wrapped with the count, the reason and the fault found in it.
    fn finish<R: Reply>(
        &self,
        span: &tracing::Span,
        (outcome, fault): Last<R>,
        stop: StopReason,
        decider: &Decider<'_>,
        ends: Ends<'_, '_>,
    ) -> Handed<R> {
        let (attempts, waited) = (decider.attempts(), decider.waited());
        if let Some(watcher) = ends.watcher {
            let ended = Ended {
                attempts,
                stop,
                waited,
                outcome: &outcome,
                fault,
            };
            span.in_scope(|| self.log.stopped(watcher, ended));
        }
        // Under no key, or a key no server had seen before this answer's attempt, the marker
        // means nothing (a proxy may echo it).
        let replay_counts = ends.key.as_ref().is_some_and(|(_, sent)| *sent);
        let replayed = replay_counts
            && (outcome.as_ref()).is_ok_and(|answer| advice::replayed(answer.headers()));
        let record = RetryRecord {
            attempts,
            stop,
            waited,
            key: ends.key.map(|(key, _)| key.value),
            replayed,
            answered_by_hedge: decider.hedge_answered(),
            tally: decider.tally(),
        };
        let budget = (stop == StopReason::BudgetExhausted)
            .then(|| decider.budget().map(RetryBudget::capacity))
            .flatten();
        hand_back(record, (outcome, fault), ends.url, budget, ends.answered)
    }

    /// The clock and the random source, for an attempt.
    fn tools(&self) -> Tools<'_> {
        Tools {
            clock: &self.clock,
            rng: &*self.rng.0,
        }
    }

    /// The end of a request whose clock has no timer to wait or time an attempt with.
    fn no_timer<R: Reply>(
        &self,
        span: &tracing::Span,
        decider: &Decider<'_>,
        ends: Ends<'_, '_>,
    ) -> Handed<R> {
        let stop = StopReason::TimerUnavailable;
        let cause = LastError::NotSent(NotSent::because(stop, TimerUnavailable));
        self.finish(span, (Err(cause), None), stop, decider, ends)
    }
}

/// The caller's outcome with its `record`: on the response, or in the error that wraps the
/// last one, with the fault found in it, the request's `url` and the `budget` that refused a
/// retry. The most common outcome, a first attempt's answer that stands for what the door's
/// bare answers do (`answered`: an HTTP success, a committed gRPC call) without a key or a
/// wait, carries none: [`RetryRecord::of`] infers it, and the success path is spared an
/// allocation and a map insertion.
#[inline]
fn hand_back<R: Reply>(
    record: RetryRecord,
    (outcome, fault): Last<R>,
    url: &dyn KeptUrl,
    budget: Option<f64>,
    answered: StopReason,
) -> Handed<R> {
    match outcome {
        Ok(mut response) => {
            let inferred = record.attempts == 1
                && record.stop == answered
                && record.key.is_none()
                && record.waited.is_zero()
                && !record.answered_by_hedge;
            if !inferred {
                response.carry(record);
            }
            Ok(response)
        }
        Err(last) => {
            let err = RetryError::new(record.attempts, record.stop, record.key, last);
            let err = err
                .with_fault(fault)
                .with(record.waited, url.url().as_ref())
                .with_tally(record.tally);
            Err(err.with_budget(budget).into())
        }
    }
}

/// Why a request may not go at all (an invalid override), if it may not.
type Refused = Option<InvalidConfig>;

/// A request's outcome as the driver hands it back through its door: the answer, or the
/// door's error, which holds the [`RetryError`].
pub(crate) type Handed<R> = Result<R, <R as Reply>::Error>;

/// Where a logical request is between its awaits.
enum Phase {
    /// Asking the core what the next attempt may do.
    Asking,
    /// An attempt on its way, as planned.
    InFlight(Plan),
    /// A hold for a spent quota, or the wait before a retry.
    Waiting(Duration),
}

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::Arc;
    use std::task::Poll;

    use reqwest::{Request, Response};

    use super::*;

    use crate::driver::scripted::Scripted;
    use crate::engine::policy::RetryPolicy;

    /// A body that has nothing to give until its gate opens, then `text`.
    struct Gated {
        open: Arc<std::sync::atomic::AtomicBool>,
        text: Option<bytes::Bytes>,
    }

    impl http_body::Body for Gated {
        type Data = bytes::Bytes;
        type Error = std::io::Error;

        fn poll_frame(
            mut self: Pin<&mut Self>,
            _: &mut std::task::Context<'_>,
        ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, std::io::Error>>> {
            if !self.open.load(std::sync::atomic::Ordering::Relaxed) {
                return Poll::Pending;
            }
            Poll::Ready(
                self.text
                    .take()
                    .map(|text| Ok(http_body::Frame::data(text))),
            )
        }
    }

    /// One hedged attempt, poll by poll, on a fake clock: the first copy goes at once; the
    /// hedge goes when its delay (the window's p95) has passed and not before; the hedge's
    /// answer wins and the first copy is dropped; its body is read inside the first copy's
    /// time, which cuts a body that stalls; the cut is a timeout, retried after the planned
    /// wait, and the retry's answer is the request's.
    #[test]
    fn an_attempt_in_flight_poll_by_poll() {
        use std::task::{Context, Poll as P, Waker};

        let clock = crate::fake_clock::FakeClock::new();
        let policy = RetryPolicy::builder()
            .attempt_timeout(Duration::from_secs(5))
            .hedge_reads(0.05, Duration::from_secs(1))
            .buffer_body(1024)
            .build()
            .unwrap();
        let dependency = Dependency::new("scripted", policy);
        let middleware = RetryMiddleware::new(dependency.clone())
            .with_clock(clock.clone())
            .with_rng(crate::rng::SeededRng::new(3));
        let request = || Request::new(http::Method::GET, "http://127.0.0.1/x".parse().unwrap());
        let mut cx = Context::from_waker(Waker::noop());
        // The latency window learns 10 ms answers: its p95 is then 10.24 ms.
        let warm = Scripted {
            answer_after: Some((clock.clone(), Duration::from_millis(10))),
            ..Scripted::default()
        };
        for _ in 0..150 {
            let mut extensions = Extensions::new();
            let run = std::pin::pin!(RetryMiddleware::execute(
                &middleware,
                request(),
                &mut extensions,
                warm.clone()
            ));
            assert!(matches!(run.poll(&mut cx), P::Ready(Ok(_))));
        }
        clock.advance(Duration::from_secs(1));
        assert_eq!(dependency.counters().hedges, 0);

        let door = Scripted::default();
        let mut extensions = Extensions::new();
        let mut run = std::pin::pin!(RetryMiddleware::execute(
            &middleware,
            request(),
            &mut extensions,
            door.clone()
        ));
        // The first copy goes at once.
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!(door.sent(), 1);
        // Not before the hedging delay...
        clock.advance(Duration::from_millis(10));
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!(door.sent(), 1, "no hedge before the p95");
        // ...and at it, the hedge.
        clock.advance(Duration::from_millis(1));
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!((door.sent(), dependency.counters().hedges), (2, 1));
        // The hedge answers; its body stalls. The first copy is given up, and the body read.
        let open = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let body = Gated {
            open: open.clone(),
            text: Some(bytes::Bytes::from_static(b"late")),
        };
        let answer = http::Response::new(reqwest::Body::wrap(body));
        door.answer(1, Ok(Response::from(answer)));
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!(door.dropped(), 1, "the first copy is dropped");
        assert_eq!(door.sent(), 2);
        // The body is read within the first copy's time, 5 s from its start: not cut before...
        clock.advance(Duration::from_millis(4_988));
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!((door.sent(), clock.sleeps().len()), (2, 0));
        // ...cut at it: a timeout, retried after its wait (the fake clock's sleeps end at once).
        clock.advance(Duration::from_millis(1));
        assert!(run.as_mut().poll(&mut cx).is_pending());
        assert_eq!(door.sent(), 3, "the retry went");
        assert_eq!(clock.sleeps().len(), 1, "one wait before it");
        assert!(!open.load(std::sync::atomic::Ordering::Relaxed));
        // The retry's answer is the request's.
        door.answer(2, Ok(Response::from(http::Response::new("second"))));
        let P::Ready(Ok(response)) = run.as_mut().poll(&mut cx) else {
            panic!("the retry's answer ends the request");
        };
        let record = crate::record::RetryRecord::of(&response).unwrap();
        assert_eq!((record.attempts(), record.answered_by_hedge()), (2, false));
        // The hedge's answer was the first attempt's outcome (then cut, and retried after).
        assert_eq!(dependency.counters().hedges_won, 1);
    }
}
