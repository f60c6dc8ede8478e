//! What real servers say beyond the RFCs, heeded through the whole chain on loopback, in
//! virtual time: millisecond `Retry-After` fields (Azure's, and the generated SDKs'), a
//! server's own verdict on its failure (`x-should-retry`, `stripe-should-retry`), and a failure
//! replayed under the request's key.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng, StopReason,
};
use wiremock::ResponseTemplate;

use crate::support::{self, client, client_with, unkeyed_client};

/// The jitter above a floor is the first retry's backoff window: [0, 100 ms] by default.
const FIRST_WINDOW: Duration = Duration::from_millis(100);

/// A server that answers 503 with `headers` once, then 200.
async fn once_then_ok(headers: &[(&str, &str)]) -> wiremock::MockServer {
    let mut first = ResponseTemplate::new(503);
    for (name, value) in headers {
        first = first.append_header(*name, *value);
    }
    support::first_then(first, 1, ResponseTemplate::new(200)).await
}

/// A server that answers every request with `template`.
async fn answering(template: ResponseTemplate) -> wiremock::MockServer {
    support::first_then(template.clone(), 0, template).await
}

/// The one wait before the retry that a 503 with `headers` brings, then 200.
async fn wait_after(headers: &[(&str, &str)]) -> Duration {
    let server = once_then_ok(headers).await;
    let (client, clock) = client();
    let response = client.get(server.uri()).send().await.unwrap();
    assert_eq!(response.status(), 200, "{headers:?}");
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    let sleeps = clock.sleeps();
    assert_eq!(sleeps.len(), 1, "{headers:?}");
    sleeps[0]
}

#[tokio::test]
async fn retry_after_ms_is_a_floor_with_the_first_window_of_jitter_above_it() {
    for name in ["retry-after-ms", "x-ms-retry-after-ms", "Retry-After-Ms"] {
        let wait = wait_after(&[(name, "1500")]).await;
        let floor = Duration::from_millis(1500);
        assert!(wait >= floor, "{name}: {wait:?}");
        assert!(wait <= floor + FIRST_WINDOW, "{name}: {wait:?}");
    }
}

#[tokio::test]
async fn milliseconds_come_before_retry_after_and_retry_after_ms_before_azure_s_spelling() {
    let read = |wait: Duration, floor: u64| {
        let floor = Duration::from_millis(floor);
        wait >= floor && wait <= floor + FIRST_WINDOW
    };
    let wait = wait_after(&[("retry-after", "9"), ("retry-after-ms", "250")]).await;
    assert!(read(wait, 250), "{wait:?}");
    let wait = wait_after(&[("x-ms-retry-after-ms", "4000"), ("retry-after-ms", "250")]).await;
    assert!(read(wait, 250), "{wait:?}");
    // A value that is not valid counts as absent: the next field is read.
    let wait = wait_after(&[("retry-after-ms", "-250"), ("retry-after", "3")]).await;
    assert!(read(wait, 3000), "{wait:?}");
    // A field on several lines asks for its largest valid value.
    let wait = wait_after(&[("retry-after-ms", "200"), ("retry-after-ms", "700")]).await;
    assert!(read(wait, 700), "{wait:?}");
}

#[tokio::test]
async fn hostile_millisecond_values_neither_panic_nor_stall_and_fall_back_to_the_backoff() {
    // Under the backoff's first window, as with no floor at all.
    for value in [
        "-1", "1e3", "1.", ".5", "0x10", "NaN", "inf", "1500 ms", "1,500", "", "+7",
    ] {
        let wait = wait_after(&[("retry-after-ms", value)]).await;
        assert!(wait <= FIRST_WINDOW, "{value:?}: {wait:?}");
    }
    // Fractions round up to the nanosecond.
    let wait = wait_after(&[("retry-after-ms", "1500.0000001")]).await;
    assert!(wait > Duration::from_millis(1500), "{wait:?}");
}

#[tokio::test]
async fn a_millisecond_floor_past_the_deadline_or_beyond_64_bits_returns_the_answer_at_once() {
    for value in [
        "30000",
        "18446744073709551615",
        "99999999999999999999999999",
    ] {
        for header in ["retry-after-ms", "x-ms-retry-after-ms"] {
            // With a Retry-After that alone would have been waited for.
            let server = support::first_then(
                ResponseTemplate::new(503)
                    .insert_header(header, value)
                    .insert_header("retry-after", "1"),
                1,
                ResponseTemplate::new(200),
            )
            .await;
            let (client, clock) = client();

            let response = client.get(server.uri()).send().await.unwrap();

            assert_eq!(response.status(), 503);
            assert_eq!(
                support::ended(&response),
                (1, StopReason::RetryAfterTooLong),
                "{header}: {value}"
            );
            assert!(clock.sleeps().is_empty(), "{header}: {value}");
        }
    }
}

#[tokio::test]
async fn a_503_the_server_marks_not_worth_retrying_is_returned_after_one_attempt() {
    for name in ["x-should-retry", "stripe-should-retry"] {
        let server = support::first_then(
            ResponseTemplate::new(503)
                .insert_header(name, "false")
                .set_body_string("deploy rolled back"),
            1,
            ResponseTemplate::new(200),
        )
        .await;
        let (client, clock) = client();

        let response = client.get(server.uri()).send().await.unwrap();

        assert_eq!(
            support::ended(&response),
            (1, StopReason::ServerDeclinedRetry),
            "{name}"
        );
        assert_eq!(server.received_requests().await.unwrap().len(), 1);
        assert!(clock.sleeps().is_empty());
        assert_eq!(response.text().await.unwrap(), "deploy rolled back");
    }
}

#[tokio::test]
async fn a_500_the_server_marks_worth_retrying_gets_the_policy_s_attempts_when_safe() {
    let server =
        answering(ResponseTemplate::new(500).insert_header("x-should-retry", "true")).await;
    let (client, clock) = client();

    let get = client.get(server.uri()).send().await.unwrap();
    assert_eq!(support::ended(&get), (3, StopReason::AttemptsExhausted));
    assert_eq!(clock.sleeps().len(), 2);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);

    // An unkeyed POST may have acted: sent once, whatever the server says.
    let (unkeyed, clock) = unkeyed_client();
    let post = unkeyed.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(support::ended(&post), (1, StopReason::NotSafeToRetry));
    assert!(clock.sleeps().is_empty());
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
}

#[tokio::test]
async fn with_the_server_s_verdict_turned_off_the_status_alone_decides() {
    let deaf = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .should_retry_fields(false)
        .build()
        .unwrap();
    let server = support::first_then(
        ResponseTemplate::new(503).insert_header("x-should-retry", "false"),
        1,
        ResponseTemplate::new(500).insert_header("x-should-retry", "true"),
    )
    .await;
    let (client, _clock) = client_with(deaf);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 500);
    assert_eq!(support::ended(&response), (2, StopReason::NotRetryable));
}

#[tokio::test]
async fn hostile_verdicts_are_ignored_and_the_status_decides() {
    for value in [
        "1",
        "yes",
        "",
        "truee",
        "true, false",
        "tru\u{e9}",
        "FALSE true",
    ] {
        let server =
            answering(ResponseTemplate::new(503).insert_header("x-should-retry", value)).await;
        let (client, _clock) = client();
        let response = client.get(server.uri()).send().await.unwrap();
        assert_eq!(
            support::ended(&response),
            (3, StopReason::AttemptsExhausted),
            "{value:?}"
        );
    }
}

#[tokio::test]
async fn a_replayed_503_stops_after_one_attempt_with_its_own_reason_and_its_body() {
    let server = answering(
        ResponseTemplate::new(503)
            .insert_header("idempotent-replayed", "true")
            .insert_header("retry-after", "1")
            .set_body_string("stored under the key"),
    )
    .await;
    let (client, clock) = client();

    // A keyed POST, as a job re-run with a key whose first run got a 503 sends it.
    let response = client
        .post(server.uri())
        .header("idempotency-key", "job-7")
        .body("x")
        .send()
        .await
        .unwrap();

    assert_eq!(support::ended(&response), (1, StopReason::ReplayedFailure));
    assert!(RetryRecord::of(&response).unwrap().replayed());
    assert!(clock.sleeps().is_empty());
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    assert_eq!(response.status(), 503);
    assert_eq!(response.text().await.unwrap(), "stored under the key");
}

#[tokio::test]
async fn a_503_stored_at_the_first_attempt_and_replayed_at_the_second_ends_there() {
    let server = support::first_then(
        ResponseTemplate::new(503),
        1,
        ResponseTemplate::new(503).insert_header("idempotent-replayed", "true"),
    )
    .await;
    let (client, clock) = client();

    let response = client.post(server.uri()).body("x").send().await.unwrap();

    assert_eq!(support::ended(&response), (2, StopReason::ReplayedFailure));
    assert_eq!(clock.sleeps().len(), 1);
    let keys: Vec<_> = server
        .received_requests()
        .await
        .unwrap()
        .iter()
        .map(|r| r.headers["idempotency-key"].clone())
        .collect();
    assert_eq!(keys.len(), 2);
    assert_eq!(keys[0], keys[1]);
}

/// A success is final whatever the server's verdict says, with a classifier that delegates to
/// the default rules as without one: `x-should-retry: true` speaks of failures.
#[tokio::test]
async fn a_success_marked_should_retry_is_a_success_under_a_delegating_classifier() {
    use reqwest_middleware::ClientBuilder;
    use reqwest_safe_retry::{Dependency, FakeClock, RetryMiddleware};
    let server =
        answering(ResponseTemplate::new(200).insert_header("x-should-retry", "true")).await;
    let delegating = Dependency::new("default", support::policy())
        .with_classifier(|attempt| attempt.default_verdict());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(delegating).with_clock(FakeClock::new()))
        .build();
    let response = client.get(server.uri()).send().await.unwrap();
    assert_eq!(support::ended(&response), (1, StopReason::Succeeded));
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

/// `retry_after_fields(false)`: the backoff alone sets the wait, whatever `Retry-After` or
/// `retry-after-ms` asks, and nothing is counted as honoured. On (the default), the field is a
/// floor. It is read on answers that are retried only: a 413 asking to wait stays final.
#[tokio::test]
async fn wait_fields_can_be_turned_off_and_are_read_on_retried_answers_only() {
    for (field, value) in [("retry-after", "5"), ("retry-after-ms", "5000")] {
        for on in [true, false] {
            let busy = ResponseTemplate::new(503).insert_header(field, value);
            let server = support::first_then(busy, 1, ResponseTemplate::new(200)).await;
            let policy = RetryPolicy::builder()
                .retry_after_fields(on)
                .build()
                .unwrap();
            let dependency = Dependency::new("waits", policy);
            let clock = FakeClock::new();
            let client = ClientBuilder::new(reqwest::Client::new())
                .with(
                    RetryMiddleware::new(dependency.clone())
                        .with_clock(clock.clone())
                        .with_rng(SeededRng::new(1)),
                )
                .build();
            let response = client.get(server.uri()).send().await.unwrap();
            assert_eq!(support::ended(&response), (2, StopReason::Succeeded));
            let waited = clock.sleeps()[0];
            if on {
                assert!(waited >= Duration::from_secs(5), "{field} on: {waited:?}");
            } else {
                assert!(
                    waited <= Duration::from_millis(100),
                    "{field} off: {waited:?}"
                );
            }
            let honoured = dependency.counters().retry_after_honoured;
            assert_eq!(honoured, u64::from(on), "{field} {on}");
        }
    }
    let too_large = ResponseTemplate::new(413).insert_header("retry-after", "1");
    let server = support::first_then(too_large, 1, ResponseTemplate::new(200)).await;
    let (client, _clock) = support::client();
    let response = client.get(server.uri()).send().await.unwrap();
    assert_eq!(response.status(), 413);
    assert_eq!(support::ended(&response), (1, StopReason::NotRetryable));
}
