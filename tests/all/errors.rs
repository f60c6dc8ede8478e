//! What code written against plain reqwest can ask of the middleware's errors, the
//! middleware's own timeout included.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, FakeClock, IdempotencyKeys, KeySource, RetryError, RetryErrorExt, RetryMiddleware,
    RetryPolicy, SeededKeys, StopReason, error::LastError,
};

use crate::support::{self, Action, RawServer};

#[tokio::test]
async fn the_extension_answers_what_reqwest_middleware_cannot_see() {
    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow]).await;
    let client = support::real_time_client(Duration::from_millis(20));

    let timed_out = client.get(server.url("/")).send().await.unwrap_err();
    // The trap the extension exists for: the generic checks are blind to a middleware's error.
    assert!(!timed_out.is_timeout());
    assert!(timed_out.timed_out());
    assert!(!timed_out.failed_to_connect());
    assert_eq!(timed_out.attempts(), Some(3));
    assert_eq!(timed_out.stop_reason(), Some(StopReason::AttemptsExhausted));

    let refused = client
        .get(support::refused_url().await)
        .send()
        .await
        .unwrap_err();
    assert!(!refused.is_connect());
    assert!(refused.failed_to_connect());
    assert!(!refused.timed_out());
    assert_eq!(refused.last_status(), None);
}

#[tokio::test]
async fn for_errors_that_are_not_the_middleware_s_it_answers_as_reqwest_does() {
    let response = reqwest::Response::from(http::Response::builder().status(503).body("").unwrap());
    let err: reqwest_middleware::Error = response.error_for_status().unwrap_err().into();
    assert_eq!(err.last_status(), err.status());
    assert_eq!(
        err.last_status(),
        Some(reqwest::StatusCode::SERVICE_UNAVAILABLE)
    );
    assert_eq!((err.timed_out(), err.failed_to_connect()), (false, false));
    assert_eq!((err.attempts(), err.stop_reason()), (None, None));
    let other = reqwest_middleware::Error::middleware(std::io::Error::other("another middleware"));
    assert_eq!(other.attempts(), None);
    assert!(other.strip_url().to_string().contains("another middleware"));
}

#[tokio::test]
async fn the_message_names_the_root_cause_once() {
    let (client, _) = support::client();
    let err = client
        .get(support::refused_url().await)
        .send()
        .await
        .unwrap_err();
    let message = err.to_string();
    assert!(
        message.starts_with("request failed after 3 attempts (attempts exhausted): "),
        "{message}"
    );
    assert_eq!(
        message.matches("Connection refused").count(),
        1,
        "{message}"
    );

    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow]).await;
    let client = support::real_time_client(Duration::from_millis(20));
    let err = client.get(server.url("/")).send().await.unwrap_err();
    assert_eq!(
        err.to_string(),
        "request failed after 3 attempts (attempts exhausted): attempt timed out after 20ms"
    );
}

#[tokio::test]
async fn strip_url_removes_the_url_and_its_query_everywhere() {
    let (client, _) = support::client();
    let url = format!("{}?token=s3cr3t", support::refused_url().await);
    let err = client.get(&url).send().await.unwrap_err();
    // The message never shows the query; the URL is there to begin with.
    assert!(!err.to_string().contains("s3cr3t"), "{err}");
    assert!(err.to_string().contains("127.0.0.1"), "{err}");
    assert!(RetryError::of(&err).unwrap().url().is_some());

    // reqwest-middleware's own without_url cannot reach inside a middleware's error...
    let still = err.without_url();
    assert!(still.to_string().contains("127.0.0.1"));
    // ...the extension's can.
    let stripped = still.strip_url();
    let message = stripped.to_string();
    assert!(
        !message.contains("s3cr3t") && !message.contains("127.0.0.1"),
        "{message}"
    );
    let retry = RetryError::of(&stripped).unwrap();
    assert_eq!(retry.url(), None);
    assert_eq!(retry.attempts(), 3);
    assert!(stripped.failed_to_connect());
}

#[tokio::test]
async fn a_retry_error_strips_its_own_url() {
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(
            RetryPolicy::builder().max_attempts(1).build().unwrap(),
        ))
        .build();
    let err = client
        .get(format!("{}?k=v", support::refused_url().await))
        .send()
        .await
        .unwrap_err();
    let reqwest_middleware::Error::Middleware(inner) = err else {
        panic!("the middleware's error");
    };
    let retry = inner.downcast::<RetryError>().unwrap().strip_url();
    assert_eq!(retry.url(), None);
    assert!(!retry.to_string().contains("k=v"), "{retry}");
}

/// Turns every response into reqwest's status error, as a middleware calling
/// `error_for_status` would.
#[derive(Debug)]
struct StatusAsError;

#[async_trait::async_trait]
impl reqwest_middleware::Middleware for StatusAsError {
    async fn handle(
        &self,
        request: reqwest::Request,
        extensions: &mut http::Extensions,
        next: reqwest_middleware::Next<'_>,
    ) -> reqwest_middleware::Result<reqwest::Response> {
        let response = next.run(request, extensions).await?;
        Ok(response.error_for_status()?)
    }
}

#[tokio::test]
async fn a_status_error_from_further_in_is_final_and_keeps_its_status() {
    let server = support::always(503).await;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(support::policy())
                .with_clock(reqwest_safe_retry::FakeClock::new()),
        )
        .with(StatusAsError)
        .build();

    let err = client.get(server.uri()).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        retry.last_status(),
        Some(reqwest::StatusCode::SERVICE_UNAVAILABLE)
    );
    assert_eq!(err.last_status(), retry.last_status());
    assert_eq!(retry.stop_reason(), StopReason::NotRetryable);
    assert_eq!(server.received_requests().await.unwrap().len(), 1);
}

/// The error of a keyed request names the key every attempt carried, as the record of a
/// response does: the caller can look the effect up on the server under it.
#[tokio::test]
async fn a_keyed_request_s_error_carries_its_key() {
    let keys = IdempotencyKeys::builder()
        .key_source(SeededKeys::new(9))
        .build()
        .unwrap();
    let expected = SeededKeys::new(9).next_key();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", support::policy())
                    .with_idempotency_keys(keys)
                    .unwrap(),
            )
            .with_clock(FakeClock::new()),
        )
        .build();

    let err = client
        .post(support::refused_url().await)
        .body("{}")
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.idempotency_key().unwrap(), expected.as_str());
    // An unkeyed request's error has none.
    let unkeyed = client
        .get(support::refused_url().await)
        .send()
        .await
        .unwrap_err();
    assert_eq!(RetryError::of(&unkeyed).unwrap().idempotency_key(), None);
}

/// The question generic code asks of any error: is there a timeout somewhere in its sources?
fn timed_out_somewhere(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(err);
    // Bounded: no real chain is this deep.
    for _ in 0..32 {
        let Some(cause) = source else {
            return false;
        };
        if let Some(io) = cause.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::TimedOut {
                return true;
            }
        }
        source = cause.source();
    }
    false
}

#[tokio::test]
async fn the_middleware_s_own_timeout_is_a_timeout_to_generic_checks() {
    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow]).await;
    let client = support::real_time_client(Duration::from_millis(20));

    let err = client.get(server.url("/")).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.timed_out());
    assert!(timed_out_somewhere(&err), "{err:?}");
    assert_eq!(server.requests(), 3);
    // The last attempt's error is the middleware's own, and says how long the attempt had.
    let LastError::TimedOut(last) = retry.last_error() else {
        panic!("not the middleware's timeout: {:?}", retry.last_error());
    };
    assert_eq!(last.after(), Duration::from_millis(20));
    assert_eq!(last.to_string(), "attempt timed out after 20ms");
}

/// The whole record on an error, as on a response: how long the request waited, and the URL of
/// its last attempt, though the policy's own timeout cut it (that error carries no URL of its
/// own) and the last attempt sent the request itself, not a copy.
#[tokio::test]
async fn an_error_says_how_long_it_waited_and_its_url_after_an_attempt_timeout() {
    let slow = Action::Delay(Duration::from_millis(300), support::ok("late"));
    let server = RawServer::start(vec![slow]).await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(20))
        .base_delay(Duration::from_millis(4))
        .max_delay(Duration::from_millis(6))
        .build()
        .unwrap();
    // The top of every draw: waits of 4 ms, then 6 ms (8 ms capped).
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy).with_rng(|| u64::MAX))
        .build();
    let url = server.url("/report?page=2");

    let err = client.get(&url).send().await.unwrap_err();

    let retry = RetryError::of(&err).unwrap();
    assert!(retry.timed_out());
    assert_eq!(retry.attempts(), 3);
    assert_eq!(retry.url().map(|u| u.as_str()), Some(url.as_str()));
    assert_eq!(err.last_url().map(|u| u.as_str()), Some(url.as_str()));
    assert_eq!(retry.waited(), Duration::from_millis(10));
    assert_eq!(err.waited(), Some(Duration::from_millis(10)));
    assert_eq!(err.strip_url().last_url(), None);
}

/// Another error than the middleware's answers by its own lights.
#[tokio::test]
async fn the_extension_s_record_questions_of_another_error_answer_as_it_does() {
    let plain = ClientBuilder::new(reqwest::Client::new()).build();
    let url = support::refused_url().await;
    let err = plain.get(&url).send().await.unwrap_err();
    assert_eq!(err.waited(), None);
    assert_eq!(err.last_url(), err.url());
    assert!(err.last_url().is_some());
}

/// The error says what went wrong at the last attempt (its kind, as the rules read it), keeps
/// the whole URL for the caller, prints no query string, gives a URL for logs without it, and
/// its record reads as a response's does.
#[tokio::test]
async fn the_error_names_the_last_kind_and_never_prints_the_query() {
    let (client, _clock) = support::unkeyed_client();
    let refused = format!("{}orders?token=secret-17", support::refused_url().await);
    let err = client.get(&refused).send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        retry.last_error_kind(),
        Some(reqwest_safe_retry::AttemptErrorKind::Connect)
    );
    let printed = format!("{err} / {retry} / {} / {retry:?}", retry.last_error());
    assert!(!printed.contains("secret-17"), "{printed}");
    let debug = format!("{retry:?}");
    assert!(debug.starts_with("RetryError { attempts: 3"), "{debug}");
    assert!(debug.contains("/orders"), "{debug}");
    assert!(printed.contains("/orders"), "{printed}");
    assert_eq!(retry.url().unwrap().as_str(), refused);
    let for_logs = retry.url_without_query().unwrap();
    assert_eq!(for_logs.query(), None);
    assert_eq!(for_logs.path(), "/orders");
    let record = retry.record();
    assert_eq!(
        (record.attempts(), record.stop_reason()),
        (retry.attempts(), retry.stop_reason())
    );
    assert_eq!(record.attempts(), 3);

    // Nothing sent (an override that contradicts itself): no kind, the reason says why.
    let contradiction = reqwest_safe_retry::RetryOverride::new()
        .no_retries()
        .max_attempts(4);
    let err = client
        .get(&refused)
        .with_extension(contradiction)
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (0, StopReason::InvalidOverride)
    );
    assert_eq!(retry.last_error_kind(), None);

    let reset = RawServer::start(vec![Action::WriteThenReset(
        b"HTTP/1.1 200 OK\r\n".to_vec(),
    )])
    .await;
    let err = client.get(reset.url("/?token=x")).send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert!(
        matches!(
            retry.last_error_kind(),
            Some(
                reqwest_safe_retry::AttemptErrorKind::Reset
                    | reqwest_safe_retry::AttemptErrorKind::Incomplete
            )
        ),
        "{:?}",
        retry.last_error_kind()
    );
}

/// Behind the tower door, a give-up's sources lead to the inner service's own error: a caller
/// can downcast to hyper-util's client error and ask it what it asks it without the layer.
#[cfg(feature = "tower")]
#[tokio::test]
async fn behind_the_tower_door_the_inner_service_s_error_is_reachable() {
    use tower_layer::Layer;
    use tower_service::Service;

    let client = crate::support::hyper_client();
    let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
    let mut service = RetryMiddleware::new(policy)
        .with_clock(FakeClock::new())
        .layer(client);
    let url = format!("{}orders?id=7", support::refused_url().await);
    let request = http::Request::get(&url).body(String::new()).unwrap();
    let err = service.call(request).await.unwrap_err();
    let retry = RetryError::of_boxed(&err).expect("the layer's error");
    assert_eq!(retry.attempts(), 2, "{retry}");
    assert!(retry.failed_to_connect(), "{retry}");
    // The request's URL, as on the reqwest side, though no URL was made while it ran.
    assert_eq!(retry.url().map(|u| u.as_str()), Some(url.as_str()));
    let mut cause = std::error::Error::source(retry);
    let mut found = None;
    for _ in 0..16 {
        let Some(at) = cause else { break };
        if let Some(client) = at.downcast_ref::<hyper_util::client::legacy::Error>() {
            found = Some(client);
            break;
        }
        cause = at.source();
    }
    let client = found.unwrap_or_else(|| panic!("hyper-util's error is not a source of {retry:?}"));
    assert!(client.is_connect(), "{client:?}");
}

/// A user name and password written in the URL are never printed, through either door: not in
/// the message, not in `Debug` (the last error's included), not in `url_without_query`.
#[tokio::test]
async fn no_message_or_debug_shows_the_user_name_and_password() {
    let refused = support::refused_url().await;
    let url = refused.replacen("http://", "http://user-9:hunter2@", 1) + "orders?token=t-5";
    let check = |printed: String, for_logs: Option<reqwest::Url>| {
        for secret in ["hunter2", "user-9", "t-5"] {
            assert!(!printed.contains(secret), "{secret} in {printed}");
        }
        let for_logs = for_logs.expect("a URL for the logs");
        assert_eq!(for_logs.as_str(), format!("{refused}orders"));
    };
    // The reqwest door, with a request made whole (`Request::new`): reqwest keeps the userinfo
    // in its URL, and its error prints it.
    let (client, _clock) = support::unkeyed_client();
    let request = reqwest::Request::new(http::Method::GET, url.parse().unwrap());
    let err = client.execute(request).await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert!(retry.failed_to_connect(), "{retry}");
    let printed = format!(
        "{err} / {err:?} / {retry} / {retry:?} / {:?}",
        retry.last_error()
    );
    check(printed, retry.url_without_query());
    assert_eq!(retry.url().map(|u| u.password()), Some(Some("hunter2")));

    #[cfg(feature = "tower")]
    {
        use tower_layer::Layer;
        use tower_service::Service;
        let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
        let mut service = RetryMiddleware::new(policy)
            .with_clock(FakeClock::new())
            .layer(crate::support::hyper_client());
        let request = http::Request::get(&url).body(String::new()).unwrap();
        let err = service.call(request).await.unwrap_err();
        let retry = RetryError::of_boxed(&err).expect("the layer's error");
        let printed = format!("{err} / {err:?} / {retry} / {retry:?}");
        check(printed, retry.url_without_query());
    }
}
