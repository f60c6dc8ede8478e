//! gRPC's per-call retry metrics (gRFC A96) through the `metrics` facade (feature `metrics`):
//! at the end of each call that made more than one attempt, how many were retries,
//! transparent retries and hedges, and how long the call had no attempt out; and, on a channel
//! with A6's throttling, its tokens. Labelled `grpc.method` (`pkg.Service/Method`) and
//! `grpc.target` (the layer's target, `GrpcRetryLayer::with_target`, else `other`), as A66
//! names them. As A96 says, a count of zero is not reported.

use std::sync::{Arc, Once};

use crate::engine::grpc::throttle::RetryThrottling;
use crate::record::RetryRecord;

/// The retries of a call (A6's transparent retries and hedges apart).
pub(super) const RETRIES: &str = "grpc.client.call.retries";
/// The transparent retries of a call.
pub(super) const TRANSPARENT_RETRIES: &str = "grpc.client.call.transparent_retries";
/// The hedges of a call (its copies after the first).
pub(super) const HEDGES: &str = "grpc.client.call.hedges";
/// How long a call had no attempt out, in seconds.
pub(super) const RETRY_DELAY: &str = "grpc.client.call.retry_delay";
/// A channel's throttling tokens, after each of its calls.
pub(super) const THROTTLE_TOKENS: &str = "reqwest_safe_retry_grpc_throttle_tokens";

/// Every metric described, once, with the recorder installed when a call first reports.
static DESCRIBED: Once = Once::new();

fn describe() {
    DESCRIBED.call_once(|| {
        use metrics::Unit;
        metrics::describe_histogram!(RETRIES, Unit::Count, "retries during the client call");
        metrics::describe_histogram!(
            TRANSPARENT_RETRIES,
            Unit::Count,
            "transparent retries during the client call"
        );
        metrics::describe_histogram!(HEDGES, Unit::Count, "hedges during the client call");
        metrics::describe_histogram!(
            RETRY_DELAY,
            Unit::Seconds,
            "total time of delay while there is no active attempt during the client call"
        );
        metrics::describe_gauge!(
            THROTTLE_TOKENS,
            "the tokens of a channel's gRPC retry throttling (gRFC A6), after its last call"
        );
    });
}

/// The tokens of a channel of `target` with `throttling`, now: after each of its calls ends,
/// and after a committed call's trailers are counted.
pub(super) fn tokens(target: &str, throttling: &RetryThrottling) {
    describe();
    let tokens = throttling.milli() as f64 / 1000.0;
    metrics::gauge!(THROTTLE_TOKENS, "grpc.target" => target.to_owned()).set(tokens);
}

/// What the calls of one method through one channel report: made once per method and channel
/// (see `Shared::reporter`), and held by each call.
#[derive(Debug)]
pub(crate) struct Reporter {
    /// `pkg.Service/Method`.
    pub(super) method: Box<str>,
    pub(super) target: Arc<str>,
    pub(super) throttling: Option<RetryThrottling>,
}

/// The most methods a channel reports apart; the calls of any other say `other`.
pub(super) const MOST_METHODS: usize = 1024;

/// The `grpc.method` label of a call to `method` through a channel that reports `known`
/// methods already: the method itself, or `other` past [`MOST_METHODS`].
pub(super) fn label(known: usize, method: &str) -> &str {
    if known < MOST_METHODS {
        method
    } else {
        "other"
    }
}

impl Reporter {
    /// What a call that ended with `record` (none: one attempt, answered) reports.
    pub(super) fn call_ended(&self, record: Option<&RetryRecord>) {
        call_ended(&self.method, &self.target, record, self.throttling.as_ref());
    }
}

/// What a call that ended with `record` (none: one attempt, answered) reports, to `method`
/// through a layer of `target`, and its channel's `throttling`, if it has throttling.
fn call_ended(
    method: &str,
    target: &str,
    record: Option<&RetryRecord>,
    throttling: Option<&RetryThrottling>,
) {
    describe();
    if let Some(throttling) = throttling {
        tokens(target, throttling);
    }
    let Some(record) = record.filter(|r| r.attempts > 1) else {
        return;
    };
    let labels = [
        ("grpc.method", method.to_owned()),
        ("grpc.target", target.to_owned()),
    ];
    let more = record.attempts - 1;
    let (retries, transparent, hedges) = if record.tally.hedged {
        // A hedged call's copies after the first are its hedges; A6 makes no transparent
        // retry of one apart (a copy that sent nothing is a non-fatal failure).
        (0, 0, more)
    } else {
        let transparent = u32::from(record.tally.transparent).min(more);
        (more - transparent, transparent, 0)
    };
    for (name, count) in [
        (RETRIES, retries),
        (TRANSPARENT_RETRIES, transparent),
        (HEDGES, hedges),
    ] {
        if count > 0 {
            metrics::histogram!(name, &labels).record(f64::from(count));
        }
    }
    metrics::histogram!(RETRY_DELAY, &labels).record(record.waited.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A channel reports 1,024 methods apart, by name, and any further one as `other`: a
    /// client that calls paths of its own making cannot grow the labels without bound.
    #[test]
    fn a_channel_labels_its_first_1024_methods_by_name_and_the_rest_other() {
        assert_eq!(label(0, "a.B/C"), "a.B/C");
        assert_eq!(label(MOST_METHODS - 1, "a.B/C"), "a.B/C");
        assert_eq!(label(MOST_METHODS, "a.B/C"), "other");
        assert_eq!(label(MOST_METHODS + 7, "a.B/C"), "other");
    }
}
