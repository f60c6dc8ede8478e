//! Why a logical request stopped making attempts: the reason its record and its error carry.

use std::fmt;

/// Why the middleware stopped making attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StopReason {
    /// The last outcome was a success (a response that is not a retryable failure and has a
    /// status below 400).
    Succeeded,
    /// The last outcome was a failure that repeating would not change: a status outside the
    /// retryable set, or a permanent error (TLS, builder, redirect, decode, another middleware).
    NotRetryable,
    /// The failure was transient, but repeating the request could repeat its effect: a
    /// non-idempotent method without an idempotency key, after bytes may have reached the server.
    NotSafeToRetry,
    /// The server answered with a failure it had stored under the request's idempotency key,
    /// replayed (`Idempotent-Replayed: true`): it answers every further attempt with that key
    /// the same way, so none is made. Its answer is returned. Only under a key sent before
    /// (an earlier attempt's, a caller's own, a derived one): without a key, or on the first
    /// answer under a key just made, the marker means nothing.
    ReplayedFailure,
    /// The server said its failure is not worth another attempt (`x-should-retry: false`, or
    /// `stripe-should-retry: false`), though its status is in the retryable set; its answer is
    /// returned. See
    /// [`RetryPolicyBuilder::should_retry_fields`](crate::RetryPolicyBuilder::should_retry_fields).
    ServerDeclinedRetry,
    /// The request body is a stream that cannot be sent twice; the request was sent once.
    BodyNotCloneable,
    /// Every allowed attempt was made.
    AttemptsExhausted,
    /// The idempotency key cannot be sent: the key source returned one that is not valid in the
    /// configured format, or the caller set one that is not (empty, unquoted where quotes are
    /// expected, spaces in a bare key...). Nothing was sent.
    InvalidIdempotencyKey,
    /// The total deadline was reached, or the next wait would have ended at or past it; or the
    /// request's [`RetryOverride::deadline`](crate::RetryOverride::deadline) was too short for
    /// any retry's wait, so its one attempt was the last.
    DeadlineReached,
    /// The server's `Retry-After` asked for a wait longer than `max_retry_after`, or longer than
    /// the deadline leaves; its response is returned.
    RetryAfterTooLong,
    /// The retry budget refused to pay for another retry.
    BudgetExhausted,
    /// The request's [`RetryOverride::no_retries`](crate::RetryOverride::no_retries) forbade
    /// retries, or its method is not among the policy's
    /// [`retryable_methods`](crate::RetryPolicyBuilder::retryable_methods).
    RetriesDisabled,
    /// The request's [`RetryOverride`](crate::RetryOverride) contradicts itself or would make
    /// its dependency's policy invalid (0 attempts, an attempt timeout under a millisecond), or
    /// the request carries another of this crate's settings where only a `RetryOverride` is
    /// read (a `RetryPolicy`, say); nothing was sent. The error's source says what to change.
    /// A deadline never makes an override invalid.
    InvalidOverride,
    /// The origin said its quota is spent (a `RateLimit` field with `r=0`), and the reset is
    /// further off than `max_retry_after`, or than the deadline leaves time for: before a first
    /// attempt nothing was sent; before a retry the answer that spent it is returned.
    QuotaExhausted,
    /// The dependency's [`AdaptiveThrottle`](crate::AdaptiveThrottle) rejected the attempt
    /// locally, before anything was sent: the dependency has been turning attempts away. A
    /// first attempt so rejected makes 0 attempts; a retry so rejected hands back the last
    /// outcome.
    Throttled,
    /// The middleware's clock could not make a timer (a [`TokioClock`](crate::TokioClock) on a
    /// runtime without tokio's time driver); nothing was sent.
    TimerUnavailable,
    /// A gRPC call was answered: the server sent its headers, so the call is committed (gRFC
    /// A6): its messages and its status (in its trailers) are the caller's, and it is never
    /// retried. The success of a unary call that tonic hands back as `Ok` (a status other
    /// than `OK` in the trailers is tonic's `Err`); a stream's status comes at its end.
    Committed,
}

impl StopReason {
    /// A short, stable, lowercase name (`deadline_reached`), as the tracing events' `reason`
    /// field has it: for metrics labels and log queries. Its `Display` is a sentence for people
    /// ("the deadline was reached").
    pub fn as_str(&self) -> &'static str {
        match self {
            StopReason::Succeeded => "succeeded",
            StopReason::NotRetryable => "not_retryable",
            StopReason::NotSafeToRetry => "not_safe_to_retry",
            StopReason::ReplayedFailure => "replayed_failure",
            StopReason::ServerDeclinedRetry => "server_declined_retry",
            StopReason::BodyNotCloneable => "body_not_cloneable",
            StopReason::AttemptsExhausted => "attempts_exhausted",
            StopReason::InvalidIdempotencyKey => "invalid_idempotency_key",
            StopReason::DeadlineReached => "deadline_reached",
            StopReason::RetryAfterTooLong => "retry_after_too_long",
            StopReason::BudgetExhausted => "budget_exhausted",
            StopReason::RetriesDisabled => "retries_disabled",
            StopReason::InvalidOverride => "invalid_override",
            StopReason::Throttled => "throttled",
            StopReason::QuotaExhausted => "quota_exhausted",
            StopReason::TimerUnavailable => "timer_unavailable",
            StopReason::Committed => "committed",
        }
    }
}

impl fmt::Display for StopReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            StopReason::Succeeded => "succeeded",
            StopReason::NotRetryable => "the failure is not retryable",
            StopReason::NotSafeToRetry => "retrying could repeat the request's effect",
            StopReason::ReplayedFailure => "the server replayed a failure stored under the key",
            StopReason::ServerDeclinedRetry => "the server said not to retry",
            StopReason::BodyNotCloneable => "the request body cannot be sent twice",
            StopReason::AttemptsExhausted => "attempts exhausted",
            StopReason::InvalidIdempotencyKey => "the idempotency key cannot be sent",
            StopReason::DeadlineReached => "deadline reached",
            StopReason::RetryAfterTooLong => "the server asked to wait longer than allowed",
            StopReason::BudgetExhausted => "the retry budget is exhausted",
            StopReason::RetriesDisabled => "retries are disabled for this request",
            StopReason::InvalidOverride => "the request's retry override is invalid",
            StopReason::Throttled => "the dependency is turning attempts away: throttled locally",
            StopReason::QuotaExhausted => {
                "the dependency's quota is spent until after the request could wait"
            }
            StopReason::TimerUnavailable => "no timer to time the attempt with",
            StopReason::Committed => "answered: the server took the call, its status follows",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stop_reason_has_a_distinct_name_and_a_sentence() {
        use StopReason::*;
        let all = [
            Succeeded,
            NotRetryable,
            NotSafeToRetry,
            ReplayedFailure,
            ServerDeclinedRetry,
            BodyNotCloneable,
            AttemptsExhausted,
            InvalidIdempotencyKey,
            DeadlineReached,
            RetryAfterTooLong,
            BudgetExhausted,
            RetriesDisabled,
            InvalidOverride,
            Throttled,
            QuotaExhausted,
            TimerUnavailable,
            Committed,
        ];
        let mut names: Vec<&str> = all.iter().map(StopReason::as_str).collect();
        let mut sentences: Vec<String> = all.iter().map(ToString::to_string).collect();
        assert!(
            names
                .iter()
                .all(|n| n.chars().all(|c| c.is_ascii_lowercase() || c == '_'))
        );
        assert_eq!(StopReason::DeadlineReached.as_str(), "deadline_reached");
        assert_eq!(StopReason::ReplayedFailure.as_str(), "replayed_failure");
        assert_eq!(
            StopReason::ServerDeclinedRetry.as_str(),
            "server_declined_retry"
        );
        assert_eq!(
            StopReason::RetriesDisabled.to_string(),
            "retries are disabled for this request"
        );
        names.sort_unstable();
        names.dedup();
        sentences.sort_unstable();
        sentences.dedup();
        assert_eq!((names.len(), sentences.len()), (all.len(), all.len()));
    }
}
