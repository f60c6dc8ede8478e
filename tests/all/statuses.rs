//! One test per status code: the number of attempts the server received.

use reqwest_safe_retry::{RetryRecord, StopReason};
use wiremock::ResponseTemplate;

use crate::support;

/// Sends one GET to a server that always answers `code`; checks the attempts it received, the
/// status the caller got and the record's stop reason.
async fn assert_attempts(code: u16, attempts: usize, stop: StopReason) {
    let server = support::always(code).await;
    let (client, clock) = support::client();

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status().as_u16(), code);
    assert_eq!(server.received_requests().await.unwrap().len(), attempts);
    let record = RetryRecord::of(&response).expect("the response carries a record");
    assert_eq!(record.attempts() as usize, attempts);
    assert_eq!(record.stop_reason(), stop);
    assert_eq!(clock.sleeps().len(), attempts - 1);
}

macro_rules! status_tests {
    ($($name:ident: $code:expr => $attempts:expr, $stop:ident;)*) => {
        $(
            #[tokio::test]
            async fn $name() {
                assert_attempts($code, $attempts, StopReason::$stop).await;
            }
        )*
    };
}

status_tests! {
    ok_200_is_sent_once: 200 => 1, Succeeded;
    created_201_is_sent_once: 201 => 1, Succeeded;
    no_content_204_is_sent_once: 204 => 1, Succeeded;
    bad_request_400_is_not_retried: 400 => 1, NotRetryable;
    unauthorized_401_is_not_retried: 401 => 1, NotRetryable;
    forbidden_403_is_not_retried: 403 => 1, NotRetryable;
    not_found_404_is_not_retried: 404 => 1, NotRetryable;
    request_timeout_408_is_retried: 408 => 3, AttemptsExhausted;
    conflict_409_without_a_key_is_not_retried: 409 => 1, NotRetryable;
    unprocessable_422_is_not_retried: 422 => 1, NotRetryable;
    too_many_requests_429_is_retried: 429 => 3, AttemptsExhausted;
    internal_error_500_is_not_retried: 500 => 1, NotRetryable;
    not_implemented_501_is_not_retried: 501 => 1, NotRetryable;
    bad_gateway_502_is_retried: 502 => 3, AttemptsExhausted;
    unavailable_503_is_retried: 503 => 3, AttemptsExhausted;
    gateway_timeout_504_is_retried: 504 => 3, AttemptsExhausted;
    version_505_is_not_retried: 505 => 1, NotRetryable;
}

/// RFC 9110 (15.5.9): a server that timed out waiting for the request lets the client repeat
/// it, within the safety rules: an unkeyed POST may have been acted on, and goes once.
#[tokio::test]
async fn a_408_is_retried_where_repeating_is_safe_and_not_on_an_unkeyed_post() {
    let server = support::always(408).await;
    let (client, _clock) = support::unkeyed_client();

    let read = client.get(server.uri()).send().await.unwrap();
    let record = RetryRecord::of(&read).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 3);

    let write = client.post(server.uri()).body("x").send().await.unwrap();
    assert_eq!(write.status(), 408);
    let record = RetryRecord::of(&write).unwrap();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (1, StopReason::NotSafeToRetry)
    );
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
}

#[tokio::test]
async fn a_configured_status_set_replaces_the_default() {
    let server = support::always(500).await;
    let policy = reqwest_safe_retry::RetryPolicy::builder()
        .retryable_statuses([500])
        .max_attempts(4)
        .build()
        .unwrap();
    let (client, _) = support::client_with(policy);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 500);
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
}

#[tokio::test]
async fn recovers_when_the_server_does() {
    let server = support::first_then(
        ResponseTemplate::new(503),
        2,
        ResponseTemplate::new(200).set_body_string("finally"),
    )
    .await;
    let (client, clock) = support::client();

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200);
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.attempts(), 3);
    assert_eq!(record.stop_reason(), StopReason::Succeeded);
    assert_eq!(record.waited(), clock.sleeps().iter().sum());
    assert_eq!(response.text().await.unwrap(), "finally");
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
}

/// A response that never passed through the middleware: a failure has no record at all, and a
/// success reads as one attempt (which it was), since a first-attempt success carries none.
#[tokio::test]
async fn a_response_from_outside_the_middleware_has_a_record_only_if_it_succeeded() {
    let plain = reqwest::Client::new();
    for (code, record) in [(200, true), (399, true), (400, false), (503, false)] {
        let server = support::always(code).await;
        let response = plain.get(server.uri()).send().await.unwrap();
        let found = RetryRecord::of(&response);
        assert_eq!(found.is_some(), record, "status {code}");
        if let Some(found) = found {
            assert_eq!(found.attempts(), 1);
            assert_eq!(found.stop_reason(), StopReason::Succeeded);
            assert_eq!(found.idempotency_key(), None);
        }
    }
}

/// The record is left off only where `RetryRecord::of` can infer it: a success at the first
/// attempt without a key. A retried success, a failure, and a keyed success carry one.
#[tokio::test]
async fn only_a_first_attempt_success_without_a_key_is_left_without_a_record() {
    let carried =
        |response: &reqwest::Response| response.extensions().get::<RetryRecord>().cloned();
    let (client, _clock) = support::client();

    let ok = support::always(200).await;
    let plain = client.get(ok.uri()).send().await.unwrap();
    assert_eq!(carried(&plain), None);
    assert_eq!(RetryRecord::of(&plain).unwrap().attempts(), 1);

    let flaky =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    let retried = client.get(flaky.uri()).send().await.unwrap();
    assert_eq!(carried(&retried).unwrap().attempts(), 2);

    let missing = support::always(404).await;
    let failed = client.get(missing.uri()).send().await.unwrap();
    assert_eq!(
        carried(&failed).unwrap().stop_reason(),
        StopReason::NotRetryable
    );

    let keyed = client
        .get(ok.uri())
        .header("idempotency-key", "\"k-1\"")
        .send()
        .await;
    let keyed = keyed.unwrap();
    assert_eq!(
        carried(&keyed).unwrap().idempotency_key().unwrap(),
        "\"k-1\""
    );
}
