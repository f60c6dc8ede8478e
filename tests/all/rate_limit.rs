//! RateLimit fields: a spent quota holds the next first attempts until its reset.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{FakeClock, RetryError, RetryMiddleware, RetryPolicy, StopReason};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

fn client(policy: RetryPolicy) -> (reqwest_middleware::ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy).with_clock(clock.clone()))
        .build();
    (client, clock)
}

#[tokio::test]
async fn a_spent_quota_delays_the_next_first_attempt_until_its_reset() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200).insert_header("ratelimit", r#""default";r=0;t=5"#))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(200).insert_header("ratelimit", r#""default";r=9;t=60"#),
        )
        .mount(&server)
        .await;
    let (client, clock) = client(RetryPolicy::default());

    client.get(server.uri()).send().await.unwrap();
    assert!(clock.sleeps().is_empty());
    // The second request waits out the 5 s before anything is sent...
    client.get(server.uri()).send().await.unwrap();
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);
    // ...and its answer, with quota left, clears the hold.
    client.get(server.uri()).send().await.unwrap();
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
}

#[tokio::test]
async fn a_reset_past_what_a_request_may_wait_fails_at_once_and_sends_nothing() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(429).insert_header("ratelimit", r#""daily";r=0;t=3600"#),
        )
        .mount(&server)
        .await;
    let policy = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let (client, clock) = client(policy);

    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 429);
    let err = client.get(server.uri()).send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (0, StopReason::QuotaExhausted)
    );
    assert!(clock.sleeps().is_empty());
    assert_eq!(server.received_requests().await.unwrap().len(), 1);

    // Turned off, the field is not heeded.
    let off = RetryPolicy::builder()
        .max_attempts(1)
        .rate_limit_fields(false)
        .build()
        .unwrap();
    let (client, _) = self::client(off);
    client.get(server.uri()).send().await.unwrap();
    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 429);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
}

/// A `Retry-After` on the same answer takes precedence: the field is not read.
#[tokio::test]
async fn retry_after_takes_precedence_over_the_field() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("ratelimit", r#""default";r=0;t=5"#)
                .insert_header("retry-after", "1"),
        )
        .mount(&server)
        .await;
    let (client, clock) = client(RetryPolicy::default());

    client.get(server.uri()).send().await.unwrap();
    client.get(server.uri()).send().await.unwrap();
    assert!(clock.sleeps().is_empty());
}
