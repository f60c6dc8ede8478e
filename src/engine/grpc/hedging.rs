//! A6's hedging policy: up to `maxAttempts` copies of one call, `hedgingDelay` apart, the first
//! answer that is not a non-fatal failure taken and the rest cancelled. The copies follow a
//! course (`engine::course`), which the gRPC rules ask for (`GrpcRules::course`).

use std::time::Duration;

use crate::engine::grpc::rules::GrpcRules;
use crate::engine::grpc::{CodeSet, bad_in, in_range, max_attempts, status_codes};
use crate::engine::policy::RetryPolicy;
use crate::error::InvalidConfig;

/// The area named in the hedging policy's configuration errors.
const AREA: &str = "gRPC hedging policy";

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

/// Builds a [`GrpcHedgingPolicy`], checking A6's rules.
#[derive(Debug, Clone, Default)]
pub struct GrpcHedgingPolicyBuilder {
    max_attempts: Option<u32>,
    most: Option<u32>,
    delay: Duration,
    codes: Vec<i32>,
}

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

#[cfg(test)]
mod tests;
