//! The course of a hedged call: when each copy goes and when the call ends, as the driver
//! follows it. A rules' `course` (`engine::rules`) asks for one: today gRPC's hedging policy
//! (A6, "Summary of Retry and Hedging Logic").
//!
//! The first copy goes at once; each further one `delay` after the one before it, while the
//! decider allows it. A copy that ends:
//!
//! - **answered**, or **fatally** (as the rules' verdict says): the call ends with it, every
//!   other copy is cancelled;
//! - **non-fatally**: the next copy goes at once, and those after it resume `delay` apart; when
//!   the server asked for a wait of `n` ms, the next goes `n` ms later instead; when it said not
//!   to retry, no copy goes any more (those out run on);
//! - when no copy is out and none may go any more, the call ends with the last failure.
//!
//! Whether a further copy may go (the attempts, the deadline, the rules' own account) is the
//! decider's word, asked when it is due; a refusal is taken as "no more copies".

use std::time::{Duration, Instant};

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

/// What the driver does next in a hedged call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Then {
    /// Wait for the copies out and for the next one's time, if any.
    Go,
    /// The call ends with the copy that just ended, for this reason.
    End(StopReason),
}

/// One hedged call's course: how many copies are out, when the next may go, and why no more
/// will.
#[derive(Debug, Clone)]
pub(crate) struct Course {
    delay: Duration,
    /// Copies out: sent, and not ended.
    out: u32,
    /// When the next copy is due, if one may go (none past what the clock can count: a delay
    /// too long for it is never due).
    next: Option<Instant>,
    /// Why no copy goes any more, once none will.
    closed: Option<StopReason>,
}

impl Course {
    /// The course of a call whose first copy went at `now`.
    pub(crate) fn start(delay: Duration, now: Instant) -> Course {
        Course {
            delay,
            out: 1,
            next: now.checked_add(delay),
            closed: None,
        }
    }

    /// When the next copy is due, if one may go.
    pub(crate) fn due(&self) -> Option<Instant> {
        self.next
    }

    /// Why no copy goes any more; the attempts, while copies may still go.
    pub(crate) fn closed(&self) -> StopReason {
        self.closed.unwrap_or(StopReason::AttemptsExhausted)
    }

    /// A further copy went at `now`: the one after it is due `delay` later.
    pub(crate) fn sent(&mut self, now: Instant) {
        self.out += 1;
        self.next = now.checked_add(self.delay);
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

    /// Whether the call has ended: no copy out, and none will go.
    fn settled(&self) -> Then {
        match (self.out, self.next) {
            (0, None) => Then::End(self.closed()),
            _ => Then::Go,
        }
    }
}

#[cfg(test)]
mod tests;
