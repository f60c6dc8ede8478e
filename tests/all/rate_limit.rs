//! RateLimit fields: a spent quota holds the next first attempts until its reset.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryError, RetryMiddleware, RetryPolicy, StopReason,
};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

fn client(policy: RetryPolicy) -> (reqwest_middleware::ClientWithMiddleware, FakeClock) {
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(policy)
                .with_clock(clock.clone())
                .with_rng(|| 0u64),
        )
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

/// A `Retry-After` on the same transient answer takes precedence: the field is not read, the
/// retry waits what `Retry-After` asks, and the next request is not held. (On a final answer
/// no wait field is read: `doors::a_wait_field_on_a_final_answer_...`.)
#[tokio::test]
async fn retry_after_takes_precedence_over_the_field() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(503)
                .insert_header("ratelimit", r#""default";r=0;t=5"#)
                .insert_header("retry-after", "1"),
        )
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    let (client, clock) = client(RetryPolicy::default());

    client.get(server.uri()).send().await.unwrap();
    client.get(server.uri()).send().await.unwrap();
    assert_eq!(clock.sleeps(), [Duration::from_secs(1)]);
}

/// A wait field that cannot be read is absent for every rule: the `RateLimit` beside it stays
/// in force, for the retry of a 429 and for the next first attempt after a 200.
#[tokio::test]
async fn an_unreadable_wait_field_leaves_the_field_beside_it_in_force() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(429)
                .insert_header("ratelimit", r#""d";r=0;t=5"#)
                .insert_header("retry-after-ms", "soon"),
        )
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    let (retrying, clock) = client(RetryPolicy::default());
    let response = retrying.get(server.uri()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    // The retry waited for the reset (the rng draws 0: no jitter above the floor).
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);

    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("ratelimit", r#""d";r=0;t=5"#)
                .insert_header("retry-after", "1.5"),
        )
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    let (client, clock) = self::client(RetryPolicy::default());
    client.get(server.uri()).send().await.unwrap();
    client.get(server.uri()).send().await.unwrap();
    // The second request was held until the reset before anything was sent.
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

/// A server whose first answer says the quota is spent for `secs` seconds, and whose later
/// answers have quota left.
async fn spent_for(secs: u64) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(200)
                .insert_header("ratelimit", format!(r#""default";r=0;t={secs}"#).as_str()),
        )
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    server
}

/// Under tokio's paused clock with the default clock, the hold is virtual time; a request
/// dropped during it (the caller's own timeout) sent nothing and counted no attempt.
#[tokio::test(start_paused = true)]
async fn a_request_dropped_while_its_quota_is_held_sends_nothing_and_counts_no_attempt() {
    let server = spent_for(5).await;
    let counters = Dependency::from(RetryPolicy::default());
    let middleware = RetryMiddleware::new(counters.clone());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    client.get(server.uri()).send().await.unwrap();

    let real = std::time::Instant::now();
    let dropped =
        tokio::time::timeout(Duration::from_secs(1), client.get(server.uri()).send()).await;
    assert!(dropped.is_err(), "held for 5 s, dropped after 1 s");
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    assert_eq!(
        counters.counters().requests,
        2,
        "the dropped one was a call to send()"
    );
    assert_eq!(counters.counters().attempts, 1);
    // Then one that waits out the rest of the hold in virtual time, not in real time.
    let virtual_start = tokio::time::Instant::now();
    client.get(server.uri()).send().await.unwrap();
    assert!(virtual_start.elapsed() >= Duration::from_secs(4));
    assert!(
        real.elapsed() < Duration::from_secs(4),
        "{:?}",
        real.elapsed()
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 2);
}

/// A held quota on a runtime without tokio's timer: the hold cannot be waited, and the request
/// fails with the timer error instead of panicking, nothing sent.
#[tokio::test(flavor = "multi_thread")]
async fn a_quota_hold_without_a_timer_fails_clearly() {
    let server = spent_for(5).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()))
        .build();
    client.get(server.uri()).send().await.unwrap();

    let (uri, held) = (server.uri(), client.clone());
    let outcome = tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap()
            .block_on(held.get(uri).send())
    })
    .await
    .unwrap();
    let err = outcome.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (0, StopReason::TimerUnavailable)
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

/// Requests held together by one spent quota are released together at its reset, under
/// tokio's paused clock with the default clock: their holds overlap in virtual time. (A
/// `FakeClock` cannot say this: each of its sleeps moves its one time at once, so held requests
/// would come back one after another, 2 s apart.)
#[tokio::test(start_paused = true)]
async fn under_the_paused_clock_requests_held_by_one_quota_are_released_together() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200).insert_header("ratelimit", r#""default";r=0;t=2"#))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    // No jitter above the reset: each hold is the 2 s exactly.
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(RetryPolicy::default()).with_rng(|| 0u64))
        .build();
    client.get(server.uri()).send().await.unwrap();

    let start = tokio::time::Instant::now();
    let mut held = tokio::task::JoinSet::new();
    for _ in 0..5 {
        let (client, url) = (client.clone(), server.uri());
        held.spawn(async move {
            let response = client.get(url).send().await.unwrap();
            (
                start.elapsed(),
                reqwest_safe_retry::RetryRecord::of(&response)
                    .unwrap()
                    .waited(),
            )
        });
    }
    let mut released = Vec::new();
    while let Some(done) = held.join_next().await {
        released.push(done.unwrap());
    }

    assert_eq!(released.len(), 5);
    for (at, waited) in released {
        assert_eq!(waited, Duration::from_secs(2));
        assert!(
            at >= Duration::from_secs(2) && at < Duration::from_millis(2_050),
            "{at:?}"
        );
    }
    assert_eq!(server.received_requests().await.unwrap().len(), 1 + 5);
}
