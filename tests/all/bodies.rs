//! Request bodies that cannot be cloned, and response bodies cut off mid-way.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::Frame;
use reqwest_safe_retry::{RetryPolicy, RetryRecord, StopReason};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::{self, Action, RawServer};

/// A request body that arrives in chunks and cannot be replayed: its first chunk is at hand,
/// the next ones come after a wait (it wakes its reader at once), as a stream's do.
struct Chunks(VecDeque<Bytes>, bool);

impl http_body::Body for Chunks {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if self.0.len() == 2 && !std::mem::replace(&mut self.1, true) {
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        Poll::Ready(self.0.pop_front().map(|b| Ok(Frame::data(b))))
    }
}

/// A body of three chunks, as a stream: the first at hand when the request is sent, the rest
/// later.
pub fn streaming_body() -> reqwest::Body {
    reqwest::Body::wrap(Chunks(
        [&b"first chunk, "[..], b"second chunk, ", b"last chunk"]
            .into_iter()
            .map(Bytes::from_static)
            .collect(),
        false,
    ))
}

#[tokio::test]
async fn a_streaming_body_is_sent_once_whole_and_not_retried() {
    let server = support::always(503).await;
    let (client, clock) = support::client();

    let response = client
        .put(server.uri())
        .body(streaming_body())
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 503);
    let received = server.received_requests().await.unwrap();
    assert_eq!(received.len(), 1);
    assert_eq!(received[0].body, b"first chunk, second chunk, last chunk");
    let record = RetryRecord::of(&response).unwrap();
    assert_eq!(record.stop_reason(), StopReason::BodyNotCloneable);
    assert_eq!(record.attempts(), 1);
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn a_streaming_body_that_succeeds_reports_success() {
    let server = RawServer::start(vec![Action::Respond(support::ok("stored"))]).await;
    let (client, _) = support::client();

    let response = client
        .put(server.url("/blob"))
        .body(streaming_body())
        .send()
        .await
        .unwrap();

    assert_eq!(
        RetryRecord::of(&response).unwrap().stop_reason(),
        StopReason::Succeeded
    );
    assert_eq!(
        server.bodies(),
        vec![b"first chunk, second chunk, last chunk".to_vec()]
    );
}

fn cut_body() -> Action {
    Action::WriteThenReset(
        b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly the first part".to_vec(),
    )
}

#[tokio::test]
async fn a_reset_mid_body_is_never_read_as_a_success() {
    let server = RawServer::start(vec![cut_body(), Action::Respond(support::ok("whole"))]).await;
    let (client, _) = support::client();

    // Without buffering, the head arrives whole and the cut shows in the body read.
    let response = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.bytes().await;

    assert!(
        body.is_err(),
        "a cut body must not read as complete: {body:?}"
    );
    assert_eq!(server.requests(), 1);
}

#[tokio::test]
async fn with_buffer_body_a_reset_mid_body_is_retried() {
    let server = RawServer::start(vec![cut_body(), Action::Respond(support::ok("whole"))]).await;
    let policy = RetryPolicy::builder().buffer_body(1 << 20).build().unwrap();
    let (client, clock) = support::client_with(policy);

    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(server.requests(), 2);
    assert_eq!(clock.sleeps().len(), 1);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    assert_eq!(response.url().as_str(), server.url("/"));
    assert_eq!(response.text().await.unwrap(), "whole");
}

#[tokio::test]
async fn with_buffer_body_a_body_over_the_limit_streams_back_whole() {
    let big = "x".repeat(10_000);
    let chunked = format!(
        "HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n\
         {:x}\r\n{}\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        5_000,
        &big[..5_000],
        5_000,
        &big[5_000..]
    );
    let server = RawServer::start(vec![Action::Respond(chunked.into_bytes())]).await;
    let policy = RetryPolicy::builder().buffer_body(100).build().unwrap();
    let (client, _) = support::client_with(policy);

    let response = client.get(server.url("/big")).send().await.unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(response.url().as_str(), server.url("/big"));
    assert_eq!(response.text().await.unwrap(), big);
    assert_eq!(server.requests(), 1);
}

#[tokio::test]
async fn with_buffer_body_headers_and_status_survive() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(
            ResponseTemplate::new(201)
                .insert_header("x-order", "42")
                .set_body_string("created"),
        )
        .mount(&server)
        .await;
    let policy = RetryPolicy::builder().buffer_body(1024).build().unwrap();
    let (client, _) = support::client_with(policy);

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 201);
    assert_eq!(response.headers()["x-order"], "42");
    assert!(RetryRecord::of(&response).is_some());
    assert_eq!(response.text().await.unwrap(), "created");
}
