//! The adaptive throttle end to end: what it rejects never reaches the server, and says why.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    AdaptiveThrottle, Clock, Dependency, FakeClock, RetryError, RetryMiddleware, RetryPolicy,
    RetryRecord, StopReason,
};

use crate::support::always;

fn throttle() -> AdaptiveThrottle {
    AdaptiveThrottle::builder()
        .window(Duration::from_secs(12))
        .build()
        .unwrap()
}

/// With the lowest draw, any probability above zero rejects: the first turned-away attempt
/// makes the next one's probability 1/2.
#[tokio::test]
async fn a_rejected_first_attempt_sends_nothing_and_says_why() {
    let server = always(503).await;
    let throttle = throttle();
    let clock = FakeClock::new();
    let counters = Dependency::new(
        "default",
        RetryPolicy::builder().max_attempts(1).build().unwrap(),
    )
    .with_throttle(throttle.clone());
    let middleware = RetryMiddleware::new(counters.clone())
        .with_clock(clock.clone())
        .with_rng(|| 0u64);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();

    let first = client.get(server.uri()).send().await.unwrap();
    assert_eq!(first.status(), 503);
    assert_eq!(throttle.counts(clock.now()), (1, 0));

    let err = client.get(server.uri()).send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.stop_reason(), StopReason::Throttled);
    assert_eq!(retry.attempts(), 0);
    assert!(
        std::error::Error::source(retry)
            .unwrap()
            .to_string()
            .contains("rejected locally by the adaptive throttle"),
        "{err}"
    );
    // Nothing of it reached the server; it counts as a request all the same.
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    assert_eq!(throttle.counts(clock.now()), (2, 0));
    let counts = counters.counters();
    assert_eq!(
        (counts.requests, counts.attempts, counts.throttled),
        (2, 1, 1)
    );
}

#[tokio::test]
async fn a_rejected_retry_hands_back_the_last_answer() {
    let server = always(503).await;
    let throttle = throttle();
    let counters = Dependency::new("default", RetryPolicy::default()).with_throttle(throttle);
    let middleware = RetryMiddleware::new(counters.clone())
        .with_clock(FakeClock::new())
        .with_rng(|| 0u64);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 503);
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::Throttled)
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    let counts = counters.counters();
    // The retry was paid for and then given back: no retry counted, the budget whole.
    assert_eq!(
        (counts.attempts, counts.retries, counts.throttled),
        (1, 0, 1)
    );
}

/// Answers the dependency accepts keep the probability at zero, whatever the draw.
#[tokio::test]
async fn a_dependency_that_accepts_is_never_throttled() {
    let server = always(200).await;
    let throttle = throttle();
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", RetryPolicy::default()).with_throttle(throttle.clone()),
            )
            .with_clock(clock.clone())
            .with_rng(|| 0u64),
        )
        .build();

    for _ in 0..20 {
        assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 200);
    }
    assert_eq!(throttle.counts(clock.now()), (20, 20));
    assert_eq!(throttle.rejection_probability(clock.now()), 0.0);
    assert_eq!(server.received_requests().await.unwrap().len(), 20);
}

/// An attempt dropped in flight (the caller's own timeout) reached the dependency and got no
/// accept: the throttle counts it as a request without one, so callers that give up on a slow
/// dependency still turn the throttle on.
#[tokio::test]
async fn an_attempt_dropped_in_flight_counts_as_a_request_without_an_accept() {
    use crate::support::{Action, RawServer, ok};
    let server =
        RawServer::start(vec![Action::Delay(Duration::from_millis(300), ok("late"))]).await;
    let throttle = throttle();
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", RetryPolicy::default()).with_throttle(throttle.clone()),
            )
            .with_clock(clock.clone()),
        )
        .build();

    let dropped = tokio::time::timeout(
        Duration::from_millis(50),
        client.get(server.url("/")).send(),
    )
    .await;

    assert!(dropped.is_err());
    assert_eq!(server.requests(), 1);
    assert_eq!(throttle.counts(clock.now()), (1, 0));
}
