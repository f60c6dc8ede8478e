//! An attempt's outcome as the core is told it: the verdict, the answer's head (its status,
//! headers and origin), whether a copy is at hand for another attempt, and what the fault says
//! of the attempt (it timed out; it certainly sent nothing). The decider and the protocols'
//! rules (`engine::rules`) read it.

use http::{HeaderMap, StatusCode};

use crate::engine::classify::Verdict;
use crate::engine::seen::{Locate, Seen};
use crate::fault::Fault;

/// The dependency's answer to an attempt: what the core reads of it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Answer<'a> {
    pub(crate) status: StatusCode,
    pub(crate) headers: &'a HeaderMap,
    /// Where the answer came from (after any redirect): its quota is that origin's.
    pub(crate) from: &'a dyn Locate,
}

/// What the decider is told about one attempt's outcome.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Observed<'a> {
    /// Transient or final, from `classify`.
    pub(crate) verdict: Verdict,
    /// The answer, if the dependency answered with an HTTP response (of any status).
    pub(crate) answer: Option<Answer<'a>>,
    /// Where a copy of the request would go, when one is at hand for another attempt.
    pub(crate) resend: Option<&'a dyn Locate>,
    /// The attempt timed out (the policy's attempt timeout, or reqwest's).
    pub(crate) timed_out: bool,
    /// The attempt certainly sent nothing the server acted on (a connection never made, a
    /// stream the server refused unprocessed).
    pub(crate) unsent: bool,
}

impl<'a> Observed<'a> {
    /// What the core reads of an attempt's outcome, `seen`, with `verdict`; `resend`: where a
    /// copy of the request would go, if one is at hand.
    #[inline]
    pub(crate) fn of(seen: &Seen<'a>, verdict: Verdict, resend: Option<&'a dyn Locate>) -> Self {
        let answer = match seen {
            Seen::Answer(head) => Some(Answer {
                status: head.status,
                headers: head.headers,
                from: head.from,
            }),
            Seen::Failed(_) => None,
        };
        Observed {
            verdict,
            answer,
            resend,
            timed_out: seen.fault() == Some(Fault::Timeout),
            unsent: !seen.may_have_reached(),
        }
    }
}
