//! The course of a hedged request: when each copy goes and when the request, or its attempt,
//! ends, as the driver follows it. Two kinds, one course:
//!
//! - **a hedged call** (gRPC's hedging policy, A6's "Summary of Retry and Hedging Logic"),
//!   which a rules' `course` (`engine::rules`) asks for: every copy an attempt of its own, and
//!   no retry after them;
//! - **a hedged attempt** (an HTTP read hedged after the latency window's percentile,
//!   `engine::latency`): two copies of one attempt, which a retry may follow.
//!
//! The first copy goes at once; each further one `delay` after the one before it, while the
//! decider allows it and the course has copies left (a hedged attempt has one more). A copy
//! that ends:
//!
//! - **answered**, or **fatally** (as the rules' verdict says): the request ends with it, every
//!   other copy is cancelled;
//! - **non-fatally**, in a hedged call: the next copy goes at once, and those after it resume
//!   `delay` apart; when the server asked for a wait of `n` ms, the next goes `n` ms later
//!   instead; when it said not to retry, no copy goes any more (those out run on);
//! - **non-fatally**, in a hedged attempt: no further copy goes (a hedge is a retry sent early,
//!   and the retry that follows the attempt has its own wait), while the other copy, if out,
//!   may still answer;
//! - when no copy is out and none may go any more, a hedged call ends with the last failure
//!   (a final verdict), a hedged attempt fails with it (as judged: a retry may follow).
//!
//! Whether a further copy may go (the attempts, the deadline, the budget, the rules' own
//! account) is the decider's word, asked when it is due; a refusal is taken as "no more
//! copies".

use std::time::Duration;

use crate::clock::Instant;

use crate::stop::StopReason;

/// What the server said of the next copy: nothing, a wait (gRPC's pushback), or not to send
/// one at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushback {
    /// None was sent.
    Absent,
    /// Retry after exactly this long.
    Wait(Duration),
    /// Do not retry: a negative value, or one that is not a whole number of milliseconds
    /// (A6: "a negative or malformed value means do not retry").
    Stop,
}

/// How a copy of a hedged call ended, as the course reads it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyEnd {
    /// The call ends with it, for this reason (an answer, a fatal code, the deadline): the
    /// other copies are cancelled.
    Ends(StopReason),
    /// A non-fatal failure, with what the server said of the next copy.
    NonFatal(Pushback),
}

/// What the driver does next in a hedged request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Wait for the copies out and for the next one's time, if any.
    Go,
    /// The request ends with the copy that just ended, for this reason.
    End(StopReason),
    /// A hedged attempt failed: the last failure is its outcome, as judged (a retry may
    /// follow).
    Failed,
}

/// One hedged request's course: how many copies are out, when the next may go, and why no
/// more will.
#[derive(Debug, Clone)]
pub(crate) struct Course {
    delay: Duration,
    /// Copies out: sent, and not ended.
    out: u32,
    /// The most further copies the course may send (a hedged call's by its attempts, which
    /// the decider counts and refuses past).
    most: u32,
    /// Each copy is an attempt of its own (a hedged call); else the copies are one attempt's
    /// (a hedged attempt), which has one hedge.
    call: bool,
    /// When the next copy is due, if one may go (none past what the clock can count: a delay
    /// too long for it is never due).
    next: Option<Instant>,
    /// Why no copy goes any more, once none will.
    closed: Option<StopReason>,
}

impl Course {
    /// The course of a hedged call whose first copy went at `now`: further copies `delay`
    /// apart while the decider allows them, `most` at most.
    pub(crate) fn call(delay: Duration, most: u32, now: Instant) -> Course {
        Course::new(delay, most, true, now)
    }

    /// The course of a hedged attempt whose first copy went at `now`: one hedge, `delay`
    /// after it.
    pub(crate) fn attempt(delay: Duration, now: Instant) -> Course {
        Course::new(delay, 1, false, now)
    }

    fn new(delay: Duration, most: u32, call: bool, now: Instant) -> Course {
        Course {
            delay,
            out: 1,
            most,
            call,
            next: now.checked_add(delay),
            closed: None,
        }
    }

    /// Whether each copy is an attempt of its own (a hedged call).
    pub(crate) fn is_call(&self) -> bool {
        self.call
    }

    /// The most further copies the course may send.
    pub(crate) fn most(&self) -> u32 {
        self.most
    }

    /// When the next copy is due, if one may go.
    pub(crate) fn due(&self) -> Option<Instant> {
        self.next
    }

    /// Why no copy goes any more; the attempts, while copies may still go.
    pub(crate) fn closed(&self) -> StopReason {
        self.closed.unwrap_or(StopReason::AttemptsExhausted)
    }

    /// A further copy went at `now`: a hedged call's next is due `delay` later; a hedged
    /// attempt has sent its one hedge.
    pub(crate) fn sent(&mut self, now: Instant) {
        self.out += 1;
        self.next = now.checked_add(self.delay).filter(|_| self.call);
    }

    /// No further copy may go, for `stop` (the decider refused one): the call ends with the
    /// last failure once the copies out have ended, if they all fail.
    pub(crate) fn close(&mut self, stop: StopReason) -> Then {
        self.next = None;
        self.closed.get_or_insert(stop);
        self.settled()
    }

    /// A copy ended at `now`, as `end` says.
    pub(crate) fn ended(&mut self, end: CopyEnd, now: Instant) -> Then {
        self.out = self.out.saturating_sub(1);
        match end {
            CopyEnd::Ends(stop) => {
                self.next = None;
                return Then::End(stop);
            }
            CopyEnd::NonFatal(_) if !self.call => {
                // A hedge is a retry sent early: after a failure the attempt's retry, if
                // any, goes after its own wait.
                self.next = None;
            }
            CopyEnd::NonFatal(Pushback::Absent) => {
                if self.next.is_some() {
                    self.next = Some(now);
                }
            }
            CopyEnd::NonFatal(Pushback::Wait(wait)) => {
                if self.next.is_some() {
                    self.next = now.checked_add(wait);
                }
            }
            CopyEnd::NonFatal(Pushback::Stop) => {
                self.next = None;
                self.closed.get_or_insert(StopReason::ServerDeclinedRetry);
            }
        }
        self.settled()
    }

    /// Whether the request (a hedged call) or its attempt (a hedged one) has ended: no copy
    /// out, and none will go.
    fn settled(&self) -> Then {
        match (self.out, self.next, self.call) {
            (0, None, true) => Then::End(self.closed()),
            (0, None, false) => Then::Failed,
            _ => Then::Go,
        }
    }
}

#[cfg(test)]
mod tests;
