//! HTTP/2 on loopback, each failure classified by what the protocol says was processed, with
//! reqwest's own retries (beneath any middleware) off and on.
//!
//! - REFUSED_STREAM and a graceful GOAWAY above the stream say the request was not processed:
//!   safe to send again, an unkeyed POST included. With reqwest's own retries on, reqwest
//!   re-sends it itself, below the middleware, which then counts one attempt for two sends.
//! - A stream reset mid-response, or a connection dropped mid-stream, came after processing:
//!   retried for a GET (with `buffer_body`, which reads the body inside the attempt), never for
//!   an unkeyed POST. reqwest does not re-send those itself.

use std::time::Duration;

use protocol_tests::h2_server::{H2, H2Server, h2_client};
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryError, RetryMiddleware, RetryPolicy, RetryRecord, StopReason,
};

/// Without idempotency keys: whether a POST may be repeated rests on the protocol alone.
fn client(own_retries: bool) -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .buffer_body(64 * 1024)
        .build()
        .unwrap();
    ClientBuilder::new(h2_client(own_retries))
        .with(
            RetryMiddleware::new(Dependency::new("default", policy).without_idempotency_keys())
                .with_clock(FakeClock::new()),
        )
        .build()
}

/// An unkeyed POST whose first stream the server did not process: (the middleware's attempts,
/// the streams the server received, the requests it processed).
async fn post_after(refusal: H2, own_retries: bool) -> (u32, usize, usize) {
    let server = H2Server::start(vec![refusal, H2::Answer(200)]).await;
    let response = client(own_retries)
        .post(server.url())
        .body("charge 10 EUR")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200, "{refusal:?}");
    let attempts = RetryRecord::of(&response).unwrap().attempts();
    assert_eq!(response.text().await.unwrap(), "ok");
    (attempts, server.streams(), server.processed())
}

#[tokio::test]
async fn a_refused_stream_is_sent_again_even_for_an_unkeyed_post() {
    // reqwest's own retries off: the middleware retries.
    assert_eq!(post_after(H2::Refuse, false).await, (2, 2, 1));
    // On: reqwest re-sends beneath the middleware, which sees one attempt.
    assert_eq!(post_after(H2::Refuse, true).await, (1, 2, 1));
}

#[tokio::test]
async fn a_graceful_goaway_before_processing_is_sent_again_even_for_an_unkeyed_post() {
    assert_eq!(post_after(H2::GoAway, false).await, (2, 2, 1));
    assert_eq!(post_after(H2::GoAway, true).await, (1, 2, 1));
}

/// A GOAWAY(NO_ERROR, last stream 0) before any stream: nothing was processed, whether the
/// request was still waiting for the connection (hyper's "channel closed") or its stream had
/// gone out above the last stream id. A GET and an unkeyed POST are both sent again, through
/// each door. On loopback the client's first stream nearly always leaves before the GOAWAY
/// arrives (the h2 error then says so); hyper's "channel closed", the other side of the race,
/// is judged in `classify`'s unit test on a connection that closed before the request.
#[tokio::test]
async fn a_goaway_before_any_stream_is_sent_again_through_both_doors() {
    // Each race between the client's first stream and the GOAWAY, many times over.
    for round in 0..3 {
        let server = H2Server::start(vec![H2::GoAwayAtOnce, H2::Answer(200)]).await;
        let response = client(false).get(server.url()).send().await.unwrap();
        assert_eq!(
            support_attempts(&response),
            (2, 200),
            "round {round}: the GET"
        );
        assert_eq!(server.processed(), 1);

        let server = H2Server::start(vec![H2::GoAwayAtOnce, H2::Answer(200)]).await;
        let response = client(false)
            .post(server.url())
            .body("x")
            .send()
            .await
            .unwrap();
        assert_eq!(
            support_attempts(&response),
            (2, 200),
            "round {round}: the POST"
        );

        for method in [http::Method::GET, http::Method::POST] {
            let server = H2Server::start(vec![H2::GoAwayAtOnce, H2::Answer(200)]).await;
            let end = through_tower(method.clone(), &server.url(), "").await;
            assert_eq!(
                end,
                Ok((2, "ok".to_owned())),
                "round {round}: {method} via tower"
            );
            assert_eq!(server.processed(), 1);
        }
    }
}

/// The attempts a response's record counts, and its status.
fn support_attempts(response: &reqwest::Response) -> (u32, u16) {
    let record = RetryRecord::of(response).unwrap();
    (record.attempts(), response.status().as_u16())
}

/// After processing: a GET is retried, an unkeyed POST is not; reqwest's own retries make no
/// difference.
async fn after_processing(failure: H2) {
    for own_retries in [false, true] {
        let server = H2Server::start(vec![failure, H2::Answer(200)]).await;
        let response = client(own_retries).get(server.url()).send().await.unwrap();
        assert_eq!(
            RetryRecord::of(&response).unwrap().attempts(),
            2,
            "{failure:?}"
        );
        assert_eq!(response.text().await.unwrap(), "ok");
        assert_eq!(
            (server.streams(), server.processed()),
            (2, 2),
            "{failure:?}"
        );

        let server = H2Server::start(vec![failure, H2::Answer(200)]).await;
        let err = client(own_retries)
            .post(server.url())
            .body("charge 10 EUR")
            .send()
            .await
            .unwrap_err();
        let retry = RetryError::of(&err).unwrap();
        assert_eq!(retry.attempts(), 1, "{failure:?}: {err}");
        assert_eq!(
            retry.stop_reason(),
            StopReason::NotSafeToRetry,
            "{failure:?}"
        );
        assert_eq!(
            (server.streams(), server.processed()),
            (1, 1),
            "{failure:?}"
        );
    }
}

#[tokio::test]
async fn a_stream_reset_mid_response_is_retried_only_when_repeating_is_safe() {
    after_processing(H2::ResetMidBody).await;
}

#[tokio::test]
async fn a_connection_dropped_mid_stream_is_retried_only_when_repeating_is_safe() {
    after_processing(H2::DropMidBody).await;
}

/// The tower front door: the same middleware, as a layer over hyper-util's client speaking
/// HTTP/2 with prior knowledge (its own re-sending of requests canceled before they went out
/// off, so every send is the layer's). Sends one request of `method` with `body` and reads how
/// it ended: the attempts and the answer's body, or the attempts and why retrying stopped.
async fn through_tower(
    method: http::Method,
    url: &str,
    body: &'static str,
) -> Result<(u32, String), (u32, StopReason)> {
    use http_body_util::BodyExt;
    use tower_layer::Layer;
    use tower_service::Service;

    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .buffer_body(64 * 1024)
        .build()
        .unwrap();
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .retry_canceled_requests(false)
        .build_http::<reqwest_safe_retry::body::SendBody<String>>();
    let mut service =
        RetryMiddleware::new(Dependency::new("default", policy).without_idempotency_keys())
            .with_clock(FakeClock::new())
            .layer(client);
    let request = http::Request::builder()
        .method(method)
        .uri(url)
        .body(body.to_owned())
        .unwrap();
    std::future::poll_fn(|cx| Service::<http::Request<String>>::poll_ready(&mut service, cx))
        .await
        .unwrap();
    // Real time, as a guard: the layer's own timeout runs on the fake clock.
    let answer = tokio::time::timeout(Duration::from_secs(10), service.call(request));
    match answer.await.expect("an answer within 10 s") {
        Ok(response) => {
            let attempts = RetryRecord::of(&response).unwrap().attempts();
            let body = response.into_body().collect().await.unwrap().to_bytes();
            Ok((attempts, String::from_utf8_lossy(&body).into_owned()))
        }
        Err(err) => {
            let retry = RetryError::of_boxed(&err).unwrap();
            Err((retry.attempts(), retry.stop_reason()))
        }
    }
}

/// Through the tower door, hyper-util's errors (hyper's and h2's beneath) are judged as
/// reqwest's are: a refusal before processing is sent again even for an unkeyed POST; a
/// failure after processing is retried for a GET and never for an unkeyed POST.
///
/// The POSTs carry no body: with one, hyper-util's client (0.1.21 over hyper 1.12) did not end
/// a stream the server refused (bare, and beneath the layer) or reset mid-answer (beneath the
/// layer) after reading the body: its response, or its body, never came, where reqwest's
/// client ends it with the reset. The layer's attempt timeout ends such a stream, as a timeout.
#[tokio::test]
async fn through_the_tower_door_each_failure_is_classified_by_what_was_processed() {
    for refusal in [H2::Refuse, H2::GoAway] {
        let server = H2Server::start(vec![refusal, H2::Answer(200)]).await;
        let end = through_tower(http::Method::POST, &server.url(), "").await;
        assert_eq!(end, Ok((2, "ok".to_owned())), "{refusal:?}");
        assert_eq!(
            (server.streams(), server.processed()),
            (2, 1),
            "{refusal:?}"
        );
    }
    for failure in [H2::ResetMidBody, H2::DropMidBody] {
        let server = H2Server::start(vec![failure, H2::Answer(200)]).await;
        let end = through_tower(http::Method::GET, &server.url(), "").await;
        assert_eq!(end, Ok((2, "ok".to_owned())), "{failure:?}");
        assert_eq!(
            (server.streams(), server.processed()),
            (2, 2),
            "{failure:?}"
        );

        let server = H2Server::start(vec![failure, H2::Answer(200)]).await;
        let end = through_tower(http::Method::POST, &server.url(), "").await;
        assert_eq!(end, Err((1, StopReason::NotSafeToRetry)), "{failure:?}");
        assert_eq!(
            (server.streams(), server.processed()),
            (1, 1),
            "{failure:?}"
        );
    }
}
