//! Method safety: what may be repeated, and when.

use reqwest_safe_retry::{RetryError, RetryRecord, StopReason};

use crate::support::{self, always};

#[tokio::test]
async fn a_post_without_a_key_that_gets_503_is_not_retried() {
    let server = always(503).await;
    let (client, clock) = support::unkeyed_client();

    let response = client
        .post(server.uri())
        .body("charge 10 EUR")
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 503);
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.stop_reason(), StopReason::NotSafeToRetry);
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn a_patch_without_a_key_that_gets_503_is_not_retried() {
    let server = always(503).await;
    let (client, _) = support::unkeyed_client();

    let response = client.patch(server.uri()).body("x").send().await.unwrap();

    assert_eq!(response.status(), 503);
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

#[tokio::test]
async fn idempotent_methods_that_get_503_are_retried() {
    for method in ["GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"] {
        let server = always(503).await;
        let (client, _) = support::client();
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap();

        let response = client
            .request(method.clone(), server.uri())
            .send()
            .await
            .unwrap();

        assert_eq!(response.status(), 503, "{method}");
        assert_eq!(
            server.received_requests().await.unwrap().len(),
            3,
            "{method}"
        );
    }
}

#[tokio::test]
async fn a_post_without_a_key_that_hits_a_refused_port_is_retried() {
    let port = support::refused_port().await;
    let (client, clock) = support::unkeyed_client();

    let err = client
        .post(format!("http://127.0.0.1:{port}/orders"))
        .body("charge 10 EUR")
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).expect("a RetryError");
    assert!(retry.failed_to_connect(), "{retry}");
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
    assert_eq!(clock.sleeps().len(), 2);
}
