//! What the public types promise about threads: a type that stops being `Send`, `Sync` or
//! `Unpin` breaks the code of every user that relies on it (cargo-semver-checks reports it
//! against a release; this test reports it on the change that does it). `UnwindSafe` is not
//! promised: the types hold the user's own clocks, classifiers, observers, key sources and
//! errors as trait objects, which it would require of them too.

#[cfg(any(feature = "tower", feature = "grpc"))]
use reqwest_safe_retry::body::*;
use reqwest_safe_retry::classify::*;
use reqwest_safe_retry::error::*;
#[cfg(feature = "grpc")]
use reqwest_safe_retry::grpc::*;
use reqwest_safe_retry::*;

/// Sent between threads, shared by reference, and moved freely.
fn everywhere<T: Send + Sync + Unpin>() {}

#[test]
fn the_public_types_are_send_sync_and_unpin() {
    everywhere::<RetryMiddleware>();
    everywhere::<Dependency>();
    everywhere::<RetryPolicy>();
    everywhere::<RetryPolicyBuilder>();
    everywhere::<RetryBudget>();
    everywhere::<RetryBudgetBuilder>();
    everywhere::<RetryOverride>();
    everywhere::<IdempotencyKeys>();
    everywhere::<IdempotencyKeysBuilder>();
    everywhere::<KeyFormat>();
    everywhere::<NaturalKey>();
    everywhere::<SeededKeys>();
    everywhere::<AdaptiveThrottle>();
    everywhere::<AdaptiveThrottleBuilder>();
    everywhere::<Jitter>();
    everywhere::<TokioClock>();
    everywhere::<SeededRng>();
    everywhere::<FakeClock>();
    everywhere::<RetryRecord>();
    everywhere::<RetryError>();
    everywhere::<InvalidConfig>();
    everywhere::<AttemptTimeout>();
    everywhere::<NotSent>();
    everywhere::<StopReason>();
    everywhere::<AttemptErrorKind>();
    everywhere::<CounterSnapshot>();
    everywhere::<RetryAttempt>();
    everywhere::<RetryEvent>();
    everywhere::<Retryable>();
    // The answer's head a classifier reads; `Attempt` and `Outcome` lend the attempt's error,
    // which need not be `Sync`, and stay on the thread that asks.
    everywhere::<ResponseHead<'static>>();
}

#[cfg(feature = "grpc")]
#[test]
fn the_grpc_door_s_types_are_send_sync_and_unpin() {
    everywhere::<GrpcConfig>();
    everywhere::<GrpcRetryPolicy>();
    everywhere::<GrpcRetryPolicyBuilder>();
    everywhere::<GrpcHedgingPolicy>();
    everywhere::<GrpcHedgingPolicyBuilder>();
    everywhere::<RetryThrottling>();
    everywhere::<GrpcRetryLayer>();
    everywhere::<GrpcRetryService<tonic::transport::Channel>>();
}

/// The bodies the tower and gRPC doors hand on, over a body that is.
#[cfg(any(feature = "tower", feature = "grpc"))]
#[test]
fn the_doors_bodies_are_send_sync_and_unpin_over_a_body_that_is() {
    type Full = http_body_util::Full<bytes::Bytes>;
    everywhere::<SendBody<Full>>();
    everywhere::<RetryBody<Full>>();
}

#[cfg(feature = "tower")]
#[test]
fn the_tower_door_s_service_is_send_sync_and_unpin_over_a_client_that_is() {
    type Client = hyper_util::client::legacy::Client<
        hyper_util::client::legacy::connect::HttpConnector,
        SendBody<http_body_util::Full<bytes::Bytes>>,
    >;
    everywhere::<Client>();
    everywhere::<RetryService<Client>>();
}
