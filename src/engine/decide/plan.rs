//! What the core answers the driver: a few verbs whose answers carry everything the driver
//! needs, so that it asks nothing else.
//!
//! Before each attempt the driver asks [`Decider::plan`]: the answer is a hold, a stop, or a
//! [`Plan`] that says the attempt's number, its time limit, the time left at its send (for the
//! time-left header), whether a copy of the request must be kept for an attempt after it, and
//! when a hedge of it may go. While it is out the driver says [`Decider::sent`] once it is on
//! its way and asks [`Decider::at_limit`] when its timer fires. An attempt planned with a
//! hedge is a course of copies (`engine::course`, [`Decider::course`]): when its next copy is
//! due the driver asks [`Decider::copy`] (then [`Decider::copy_sent`]), and tells
//! [`Decider::copy_ended`] how each copy ended. When it ends the driver hands
//! [`Decider::ended`] the outcome, which copy answered and a way to read the time, and gets a
//! wait or a stop back. The finer steps these verbs are made of stay private to the core, where
//! its tests drive them one by one.

use std::time::{Duration, SystemTime};

use crate::clock::Instant;

use crate::engine::seen::Locate;

use super::{Decider, Next};
use crate::engine::observed::Observed;
use crate::engine::schedule::Wait;
use crate::rng::RandomSource;
use crate::stop::StopReason;

/// What the core needs to know of a request before its first attempt, from the rules that
/// read the request (`idempotency`, `classify`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Facts {
    /// Its key was stamped here: counted when its first attempt is sent.
    pub(crate) stamped: bool,
    /// It may be hedged, if its policy hedges reads (`classify::may_be_hedged`).
    pub(crate) hedgeable: bool,
}

/// What the driver is to do before an attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Step {
    /// Send the attempt as planned.
    Send(Plan),
    /// Hold this long (a spent quota), then ask again.
    Hold(Duration),
    /// Send nothing more.
    Stop(StopReason),
}

/// One copy of the request the core allows: everything the driver needs to send it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Plan {
    /// The attempt's number, 1 for the first (a hedge carries its attempt's).
    pub(crate) number: u32,
    /// How long the copy may take.
    pub(crate) limit: Duration,
    /// The time left before the deadline at the copy's send.
    pub(crate) left: Duration,
    /// Another copy may follow this one: the driver keeps a copy of the request.
    pub(crate) keep_copy: bool,
    /// When a further copy of this attempt may go, if one may: an HTTP read's hedge, or the
    /// next copy of a hedged gRPC call (the attempt is then the course of its copies).
    pub(crate) hedge_after: Option<Duration>,
}

impl Decider<'_> {
    /// Takes in what the request is (see [`Facts`]), before its first attempt is planned.
    #[inline]
    pub(crate) fn know(&mut self, facts: Facts) {
        if facts.stamped {
            self.key_stamped();
        }
        if facts.hedgeable && self.accounts.latency.is_some() {
            self.allow_hedges();
        }
    }

    /// What the next attempt may do at `now`, to `resend` (where a copy of the request would
    /// go, if one is at hand): called before the first attempt, after each wait and each hold.
    /// The rules and their order are [`next_attempt`](Self::next_attempt)'s.
    #[inline]
    pub(crate) fn plan(
        &mut self,
        now: Instant,
        resend: Option<&dyn Locate>,
        rng: &dyn RandomSource,
    ) -> Step {
        match self.next_attempt(now, resend, rng) {
            Next::Send(limit) => Step::Send(Plan {
                number: self.attempt + 1,
                limit,
                left: self.remaining(now),
                keep_copy: self.may_retry_after_next(),
                hedge_after: self.hedge_after().or_else(|| self.call_course()),
            }),
            Next::Hold(hold) => Step::Hold(hold),
            Next::Stop(stop) => Step::Stop(stop),
        }
    }

    /// The attempt last planned is on its way: counted (with the retry it uses, and a stamped
    /// key on the first).
    #[inline]
    pub(crate) fn sent(&mut self) {
        self.attempt_started();
    }

    /// What follows the attempt that just ended in `observed`, answered by its hedge if
    /// `by_hedge`: a wait before the next attempt, or a stop. The time is read (`now`, and
    /// `wall` for a `Retry-After` date) only when a rule needs it: most requests end with a
    /// final verdict that none does.
    #[inline(always)]
    pub(crate) fn ended(
        &mut self,
        mut observed: Observed<'_>,
        by_hedge: bool,
        now: &dyn Fn() -> Instant,
        wall: &dyn Fn() -> SystemTime,
        rng: &dyn RandomSource,
    ) -> Wait {
        if by_hedge {
            self.hedge_won();
        }
        self.count_end(&mut observed);
        self.ended_at_deadline(&mut observed, now);
        match self.stop_without_time(&observed) {
            Some(stop) => Wait::Stop(stop),
            None => self.after_attempt(observed, now(), wall, rng),
        }
    }
}
