//! A6's hedging policy: up to `maxAttempts` copies of one call, `hedgingDelay` apart, the first
//! answer that is not a non-fatal failure taken and the rest cancelled; and the course of one
//! hedged call, when each copy goes and when the call ends, as the driver follows it.
//!
//! # The course (A6, "Summary of Retry and Hedging Logic")
//!
//! The first copy goes at once; each further one `hedgingDelay` after the one before it, while
//! fewer than `maxAttempts` have gone. A copy that ends:
//!
//! - **answered** (`OK`, or committed: the server sent headers) or with a **fatal** code (one
//!   not in `nonFatalStatusCodes`): the call ends with it, every other copy is cancelled;
//! - with a **non-fatal** code: the next copy goes at once, and those after it resume
//!   `hedgingDelay` apart; with a pushback of `n` ms, the next goes `n` ms later instead; with
//!   a pushback that says not to retry, no copy goes any more (those out run on);
//! - when no copy is out and none may go any more, the call ends with the last failure.
//!
//! Whether a further copy may go (the attempts, the deadline, the throttling) is the decider's
//! word, asked when it is due; a refusal is taken as "no more copies".

#![cfg_attr(not(feature = "grpc"), allow(dead_code))]

use std::time::{Duration, Instant};

use crate::engine::grpc::Pushback;
#[cfg(feature = "grpc")]
use crate::engine::grpc::rules::GrpcRules;
#[cfg(feature = "grpc")]
use crate::engine::grpc::{CodeSet, bad_in, in_range, max_attempts, status_codes};
#[cfg(feature = "grpc")]
use crate::engine::policy::RetryPolicy;
#[cfg(feature = "grpc")]
use crate::error::InvalidConfig;
use crate::stop::StopReason;

/// The area named in the hedging policy's configuration errors.
#[cfg(feature = "grpc")]
const AREA: &str = "gRPC hedging policy";

#[cfg(feature = "grpc")]
/// A6's hedging policy for a method or a service (feature `grpc`): how many copies of a call
/// may be in flight, how far apart they go, and which status codes leave the others running.
///
/// Hedging is for methods that are safe to run more than once: every copy may reach the
/// server. A method marked [`non_idempotent`](crate::grpc::GrpcConfig::non_idempotent) carries the
/// same idempotency key on every copy, for a server that dedupes on it.
///
/// ```
/// use std::time::Duration;
/// use reqwest_safe_retry::grpc::GrpcHedgingPolicy;
///
/// let policy = GrpcHedgingPolicy::builder()
///     .max_attempts(3)
///     .hedging_delay(Duration::from_millis(50))
///     .non_fatal_codes([14]) // UNAVAILABLE; with tonic, its `Code::Unavailable`
///     .build()?;
/// assert_eq!(policy.max_attempts(), 3);
/// # Ok::<(), reqwest_safe_retry::InvalidConfig>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GrpcHedgingPolicy {
    max_attempts: u32,
    delay: Duration,
    codes: CodeSet,
}

#[cfg(feature = "grpc")]
impl GrpcHedgingPolicy {
    /// A builder: `maxAttempts` must be set; the non-fatal codes default to none (every failure
    /// ends the call), the delay to zero (every copy at once), as A6's.
    pub fn builder() -> GrpcHedgingPolicyBuilder {
        GrpcHedgingPolicyBuilder::default()
    }

    /// The most copies of a call, the first included.
    pub fn max_attempts(&self) -> u32 {
        self.max_attempts
    }

    /// How long after a copy the next one goes, while no answer has come.
    pub fn hedging_delay(&self) -> Duration {
        self.delay
    }

    /// Whether a copy that ends with `code` (a number, as tonic's `Code as i32`) leaves the
    /// others running.
    pub fn is_non_fatal(&self, code: i32) -> bool {
        u8::try_from(code).is_ok_and(|c| self.codes.has(c))
    }

    /// The non-fatal codes.
    pub(crate) fn codes(&self) -> CodeSet {
        self.codes
    }

    /// The crate's policy that carries it out: answers judged by their gRPC status (the
    /// non-fatal codes are the transient ones), the call's deadline over every copy, and no
    /// retry after the copies.
    pub(crate) fn to_policy(self) -> (RetryPolicy, GrpcRules) {
        GrpcRules::hedging(self.max_attempts, self.delay, self.codes)
    }
}

#[cfg(feature = "grpc")]
/// Builds a [`GrpcHedgingPolicy`], checking A6's rules.
#[derive(Debug, Clone, Default)]
pub struct GrpcHedgingPolicyBuilder {
    max_attempts: Option<u32>,
    most: Option<u32>,
    delay: Duration,
    codes: Vec<i32>,
}

#[cfg(feature = "grpc")]
impl GrpcHedgingPolicyBuilder {
    /// The most copies, the first included: at least 2. Above 5 it is cut to 5, as A6 says,
    /// unless [`allow_attempts_above_five`](Self::allow_attempts_above_five) raised the cap.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = Some(attempts);
        self
    }

    /// Raises A6's cap of 5 copies to `most`, on purpose.
    pub fn allow_attempts_above_five(mut self, most: u32) -> Self {
        self.most = Some(most);
        self
    }

    /// How long after a copy the next one goes (default zero: every copy at once).
    pub fn hedging_delay(mut self, delay: Duration) -> Self {
        self.delay = delay;
        self
    }

    /// Adds status codes (numbers, or anything that becomes one, such as tonic's `Code`) that
    /// leave the other copies running, and send the next one at once.
    pub fn non_fatal_codes<C: Into<i32>>(mut self, codes: impl IntoIterator<Item = C>) -> Self {
        self.codes.extend(codes.into_iter().map(Into::into));
        self
    }

    /// The policy.
    ///
    /// # Errors
    ///
    /// [`InvalidConfig`] naming the field (as a service config names it) that breaks A6's
    /// rules: no `maxAttempts` or one below 2, a `nonFatalStatusCodes` entry that is not a
    /// code (0 to 16), a `hedgingDelay` longer than a gRPC duration holds (about 292 years).
    /// No non-fatal codes is a policy: every failure ends the call, as A6's field is optional.
    pub fn build(self) -> Result<GrpcHedgingPolicy, InvalidConfig> {
        let attempts =
            max_attempts(self.max_attempts, self.most, "hedging").map_err(bad_in(AREA))?;
        let delay = in_range(self.delay, "hedgingDelay").map_err(bad_in(AREA))?;
        // None given: every failure is fatal, as A6's field is optional and grpc-java reads it.
        let codes = if self.codes.is_empty() {
            CodeSet::default()
        } else {
            status_codes(self.codes, "nonFatalStatusCodes").map_err(bad_in(AREA))?
        };
        Ok(GrpcHedgingPolicy {
            max_attempts: attempts,
            delay,
            codes,
        })
    }
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
