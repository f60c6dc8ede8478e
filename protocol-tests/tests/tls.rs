//! TLS on loopback: a certificate the client does not trust is permanent (one attempt, and the
//! error says why), a trusted one succeeds, and a reset in the middle of the handshake is a
//! transient connect failure, retried.

use protocol_tests::{Identity, Tls, TlsServer, tls_client};
use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryError, RetryErrorExt, RetryMiddleware, RetryPolicy, RetryRecord,
    StopReason,
};

fn with_retries(client: reqwest::Client) -> reqwest_middleware::ClientWithMiddleware {
    ClientBuilder::new(client)
        .with(RetryMiddleware::new(RetryPolicy::default()).with_clock(FakeClock::new()))
        .build()
}

#[tokio::test]
async fn an_untrusted_certificate_is_not_retried_and_the_error_says_so() {
    let identity = Identity::generate();
    let server = TlsServer::start(&identity, vec![Tls::Answer]).await;
    // Trusts another certificate, not the server's.
    let client = with_retries(tls_client(&[Identity::generate().cert]));

    let err = client.get(server.url()).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 1, "{err}");
    assert_eq!(retry.stop_reason(), StopReason::NotRetryable);
    assert!(err.failed_to_connect());
    assert_eq!(server.connections(), 1);
    assert_eq!(server.handshakes(), 0);
    let message = format!("{err}");
    assert!(message.contains("certificate"), "{message}");
}

#[tokio::test]
async fn a_trusted_certificate_succeeds_in_one_attempt() {
    let identity = Identity::generate();
    let server = TlsServer::start(&identity, vec![Tls::Answer]).await;
    let client = with_retries(tls_client(std::slice::from_ref(&identity.cert)));

    let response = client.get(server.url()).send().await.unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 1);
    assert_eq!(response.text().await.unwrap(), "ok");
    assert_eq!(server.handshakes(), 1);
}

#[tokio::test]
async fn a_reset_during_the_handshake_is_retried() {
    let identity = Identity::generate();
    let server = TlsServer::start(&identity, vec![Tls::ResetInHandshake, Tls::Answer]).await;
    let client = with_retries(tls_client(std::slice::from_ref(&identity.cert)));

    // A POST without a key: a failure before the handshake completed sent no byte of the
    // request, so even a non-idempotent method is retried.
    let response = client
        .post(server.url())
        .header("Idempotency-Key", "\"tls-reset-1\"")
        .body("x")
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    assert_eq!(server.connections(), 2);
    assert_eq!(server.handshakes(), 1);
}

#[tokio::test]
async fn a_reset_during_the_handshake_is_retried_for_an_unkeyed_post_too() {
    let identity = Identity::generate();
    let server = TlsServer::start(&identity, vec![Tls::ResetInHandshake, Tls::Answer]).await;
    let client = ClientBuilder::new(tls_client(std::slice::from_ref(&identity.cert)))
        .with(
            RetryMiddleware::new(
                Dependency::new("default", RetryPolicy::default()).without_idempotency_keys(),
            )
            .with_clock(FakeClock::new()),
        )
        .build();

    let response = client.post(server.url()).body("x").send().await.unwrap();

    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    assert_eq!(server.handshakes(), 1);
}
