//! The classifier hook: widening and narrowing what is transient, delegating to the default
//! rules, and the safety rule holding whatever the hook says.

use std::sync::{Arc, Mutex};

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryError, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng,
    StopReason,
    classify::{Attempt, Outcome, Retryable},
};
use wiremock::matchers::path;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::{self, Action, RawServer, always};

/// A client whose default dependency classifies with `classifier`, on a fake clock, without a
/// budget, with or without idempotency keys.
fn client<F>(classifier: F, keys: bool) -> ClientWithMiddleware
where
    F: Fn(&Attempt<'_>) -> Retryable + Send + Sync + 'static,
{
    let mut dependency = Dependency::new("default", support::policy())
        .with_classifier(classifier)
        .without_budget();
    if !keys {
        dependency = dependency.without_idempotency_keys();
    }
    let middleware = RetryMiddleware::new(dependency)
        .with_clock(FakeClock::new())
        .with_rng(SeededRng::new(3));
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

fn attempts_of(response: &reqwest::Response) -> (u32, StopReason) {
    let record = RetryRecord::of(response).unwrap();
    (record.attempts(), record.stop_reason())
}

#[tokio::test]
async fn a_classifier_can_make_a_status_transient_for_one_path() {
    let server = always(500).await;
    let client = client(
        |a: &Attempt<'_>| match (a.uri().path(), a.status().map(|s| s.as_u16())) {
            ("/search", Some(500)) => Retryable::Transient,
            _ => a.default_verdict(),
        },
        true,
    );

    let search = client
        .get(format!("{}/search", server.uri()))
        .send()
        .await
        .unwrap();
    let other = client
        .get(format!("{}/orders", server.uri()))
        .send()
        .await
        .unwrap();

    assert_eq!(attempts_of(&search), (3, StopReason::AttemptsExhausted));
    assert_eq!(attempts_of(&other), (1, StopReason::NotRetryable));
    assert_eq!(server.received_requests().await.unwrap().len(), 3 + 1);
}

#[tokio::test]
async fn a_classifier_can_make_a_503_final_for_one_path() {
    let server = always(503).await;
    let client = client(
        |a: &Attempt<'_>| {
            if a.uri().path() == "/reports" {
                Retryable::Fatal
            } else {
                a.default_verdict()
            }
        },
        true,
    );

    let reports = client
        .get(format!("{}/reports", server.uri()))
        .send()
        .await
        .unwrap();
    let other = client.get(server.uri()).send().await.unwrap();

    assert_eq!(attempts_of(&reports), (1, StopReason::NotRetryable));
    assert_eq!(attempts_of(&other), (3, StopReason::AttemptsExhausted));
}

/// A classifier that records what it saw and delegates: the outcome is the default rules', and
/// it saw every attempt, with the request's method, URL, headers and key.
#[tokio::test]
async fn a_delegating_classifier_sees_each_attempt_and_changes_nothing() {
    let server = MockServer::start().await;
    Mock::given(path("/busy"))
        .respond_with(ResponseTemplate::new(503))
        .mount(&server)
        .await;
    Mock::given(path("/gone"))
        .respond_with(ResponseTemplate::new(404))
        .mount(&server)
        .await;
    type Seen = (
        String,
        String,
        Option<String>,
        bool,
        u32,
        Option<u16>,
        Retryable,
    );
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let record = seen.clone();
    let client = client(
        move |a: &Attempt<'_>| {
            record.lock().unwrap().push((
                a.method().to_string(),
                a.uri().path().to_owned(),
                a.headers()
                    .get("x-tenant")
                    .map(|v| v.to_str().unwrap().to_owned()),
                a.idempotency_key().is_some(),
                a.number(),
                a.status().map(|s| s.as_u16()),
                a.default_verdict(),
            ));
            a.default_verdict()
        },
        true,
    );

    let busy = client
        .post(format!("{}/busy", server.uri()))
        .header("x-tenant", "7")
        .body("x")
        .send()
        .await
        .unwrap();
    let gone = client
        .get(format!("{}/gone", server.uri()))
        .send()
        .await
        .unwrap();

    assert_eq!(attempts_of(&busy), (3, StopReason::AttemptsExhausted));
    assert_eq!(attempts_of(&gone), (1, StopReason::NotRetryable));
    let post = |n| {
        (
            "POST".to_owned(),
            "/busy".to_owned(),
            Some("7".to_owned()),
            true,
            n,
            Some(503),
            Retryable::Transient,
        )
    };
    assert_eq!(
        *seen.lock().unwrap(),
        [
            post(1),
            post(2),
            post(3),
            (
                "GET".to_owned(),
                "/gone".to_owned(),
                None,
                false,
                1,
                Some(404),
                Retryable::Fatal
            ),
        ]
    );
}

fn everything(_: &Attempt<'_>) -> Retryable {
    Retryable::Transient
}

/// A hook that calls everything transient cannot make an unkeyed POST repeat once bytes may
/// have reached the server: not after a response, not after a reset mid-request.
#[tokio::test]
async fn retry_everything_cannot_repeat_an_unkeyed_post_that_may_have_arrived() {
    let client = client(everything, false);

    let answered = always(500).await;
    let response = client.post(answered.uri()).body("x").send().await.unwrap();
    assert_eq!(attempts_of(&response), (1, StopReason::NotSafeToRetry));
    assert_eq!(answered.received_requests().await.unwrap().len(), 1);
    // A success too: the hook may call it transient, the POST still goes once.
    let fine = always(201).await;
    let response = client.post(fine.uri()).body("x").send().await.unwrap();
    assert_eq!(attempts_of(&response), (1, StopReason::NotSafeToRetry));
    assert_eq!(fine.received_requests().await.unwrap().len(), 1);

    let reset = RawServer::start(vec![Action::WriteThenReset(Vec::new())]).await;
    let err = client
        .post(reset.url("/charge"))
        .body("x")
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (1, StopReason::NotSafeToRetry)
    );
    assert_eq!(reset.requests(), 1);
}

/// What the same hook may widen: a success of an idempotent request (a poll), and a connect
/// error of an unkeyed POST, of which nothing reached the server.
#[tokio::test]
async fn retry_everything_still_repeats_what_is_safe() {
    let client = client(everything, false);

    let server = always(200).await;
    let polled = client.get(server.uri()).send().await.unwrap();
    assert_eq!(attempts_of(&polled), (3, StopReason::AttemptsExhausted));
    assert_eq!(server.received_requests().await.unwrap().len(), 3);

    let err = client
        .post(support::refused_url().await)
        .body("x")
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
}

/// An inner middleware's own error, final by default, made transient for a GET; the hook sees
/// it as an error outcome.
#[tokio::test]
async fn a_classifier_can_make_another_middleware_s_error_transient() {
    // Fails the first two requests that reach it, as a middleware of its own would.
    let fails_twice = |calls: Arc<Mutex<u32>>| {
        support::Before(move |_: &mut http::Extensions| {
            let mut calls = calls.lock().unwrap();
            *calls += 1;
            (*calls <= 2).then(|| {
                reqwest_middleware::Error::middleware(std::io::Error::other("token service busy"))
            })
        })
    };
    let server = always(200).await;
    let build = |hook: bool, calls: Arc<Mutex<u32>>| {
        let mut dependency = Dependency::new("default", support::policy()).without_budget();
        if hook {
            dependency = dependency.with_classifier(|a| match a.outcome() {
                Outcome::Error(e) if e.to_string().contains("token service busy") => {
                    Retryable::Transient
                }
                _ => a.default_verdict(),
            });
        }
        ClientBuilder::new(reqwest::Client::new())
            .with(RetryMiddleware::new(dependency).with_clock(FakeClock::new()))
            .with(fails_twice(calls))
            .build()
    };

    let calls = Arc::new(Mutex::new(0));
    let response = build(true, calls.clone())
        .get(server.uri())
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(attempts_of(&response), (3, StopReason::Succeeded));
    assert_eq!(*calls.lock().unwrap(), 3);

    let calls = Arc::new(Mutex::new(0));
    let err = build(false, calls.clone())
        .get(server.uri())
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (1, StopReason::NotRetryable)
    );
    assert_eq!(*calls.lock().unwrap(), 1);
}

/// Each dependency has its own classifier.
#[tokio::test]
async fn a_classifier_belongs_to_its_dependency() {
    let (a, b) = (always(503).await, always(503).await);
    let strict = Dependency::new("strict", support::policy())
        .with_classifier(|_: &Attempt<'_>| Retryable::Fatal)
        .without_budget();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("default", support::policy()).without_budget())
                .with_clock(FakeClock::new())
                .route(&a.address().to_string(), strict)
                .unwrap(),
        )
        .build();

    let first = client.get(a.uri()).send().await.unwrap();
    let second = client.get(b.uri()).send().await.unwrap();

    assert_eq!(attempts_of(&first), (1, StopReason::NotRetryable));
    assert_eq!(attempts_of(&second), (3, StopReason::AttemptsExhausted));
}

/// With `buffer_body`, the answer is judged before its body is read (a 503's body is never
/// read) and not again after: the classifier is asked once per attempt.
#[tokio::test]
async fn with_buffer_body_the_classifier_is_asked_once_per_attempt() {
    let server = always(200).await;
    let asked = Arc::new(Mutex::new(0u32));
    let count = asked.clone();
    let policy = RetryPolicy::builder().buffer_body(1024).build().unwrap();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("default", policy).with_classifier(
                move |a: &Attempt<'_>| {
                    *count.lock().unwrap() += 1;
                    a.default_verdict()
                },
            ))
            .with_clock(FakeClock::new()),
        )
        .build();

    let response = client.get(server.uri()).send().await.unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(*asked.lock().unwrap(), 1);
}

/// With `buffer_body` and a classifier, an attempt that ends in an error (a refused
/// connection) has no body to read: the classifier is shown the error itself, with no body,
/// on every attempt, and the request ends in that error.
#[tokio::test]
async fn with_buffer_body_an_attempt_that_failed_is_judged_without_a_body() {
    let (client, shown) = body_reader(true);

    let err = client
        .get(support::refused_url().await)
        .send()
        .await
        .unwrap_err();

    let retry = RetryError::of(&err).expect("the middleware's error");
    assert_eq!(retry.attempts(), 3, "{err}");
    assert!(retry.failed_to_connect(), "{err:?}");
    assert_eq!(*shown.lock().unwrap(), [None, None, None]);
}

/// A client on a fake clock whose policy buffers bodies (or not), with a classifier that
/// retries a 500 whose body says "maintenance", and records the bodies it was shown.
fn body_reader(buffer: bool) -> (ClientWithMiddleware, Arc<Mutex<Vec<Option<String>>>>) {
    let shown: Arc<Mutex<Vec<Option<String>>>> = Arc::default();
    let seen = shown.clone();
    let mut policy = RetryPolicy::builder();
    if buffer {
        policy = policy.buffer_body(64 * 1024);
    }
    let dependency = Dependency::new("default", policy.build().unwrap())
        .with_classifier(move |attempt| {
            let body = attempt
                .body()
                .map(|b| String::from_utf8_lossy(b).into_owned());
            let maintenance = body.as_deref().is_some_and(|b| b.contains("maintenance"));
            seen.lock().unwrap().push(body);
            match attempt.status().map(|s| s.as_u16()) {
                Some(500) if maintenance => Retryable::Transient,
                _ => attempt.default_verdict(),
            }
        })
        .without_budget();
    let middleware = RetryMiddleware::new(dependency)
        .with_clock(FakeClock::new())
        .with_rng(SeededRng::new(3));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();
    (client, shown)
}

/// With `buffer_body`, the classifier reads the answer's body: a 500 that says "maintenance"
/// is retried, another 500 is not, and the caller gets the very body the classifier saw.
/// Without it, the classifier is told there is no body to read.
#[tokio::test]
async fn a_classifier_retries_a_500_whose_buffered_body_says_maintenance_and_not_another() {
    let server = MockServer::start().await;
    Mock::given(path("/report"))
        .respond_with(ResponseTemplate::new(500).set_body_string("down for maintenance"))
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(path("/report"))
        .respond_with(ResponseTemplate::new(200).set_body_string("the report"))
        .mount(&server)
        .await;
    Mock::given(path("/broken"))
        .respond_with(ResponseTemplate::new(500).set_body_string("null pointer"))
        .mount(&server)
        .await;
    let (client, shown) = body_reader(true);

    let report = client
        .get(format!("{}/report", server.uri()))
        .send()
        .await
        .unwrap();
    assert_eq!(attempts_of(&report), (2, StopReason::Succeeded));
    assert_eq!(report.text().await.unwrap(), "the report");
    let broken = client
        .get(format!("{}/broken", server.uri()))
        .send()
        .await
        .unwrap();
    assert_eq!(attempts_of(&broken), (1, StopReason::NotRetryable));
    assert_eq!(broken.text().await.unwrap(), "null pointer");
    let owned = |s: &str| Some(s.to_owned());
    assert_eq!(
        *shown.lock().unwrap(),
        [
            owned("down for maintenance"),
            owned("the report"),
            owned("null pointer")
        ]
    );

    let (unbuffered, shown) = body_reader(false);
    Mock::given(path("/again"))
        .respond_with(ResponseTemplate::new(500).set_body_string("down for maintenance"))
        .mount(&server)
        .await;
    let again = unbuffered
        .get(format!("{}/again", server.uri()))
        .send()
        .await
        .unwrap();
    assert_eq!(attempts_of(&again), (1, StopReason::NotRetryable));
    assert_eq!(*shown.lock().unwrap(), [None]);
    assert_eq!(
        again.text().await.unwrap(),
        "down for maintenance",
        "still the caller's to read"
    );
}

/// A body cut off while it is read for the classifier makes the attempt's outcome an error:
/// the classifier is asked about that error (no body), and the default rules retry it.
#[tokio::test]
async fn a_body_cut_off_while_read_for_the_classifier_is_judged_as_the_error_it_is() {
    let cut = b"HTTP/1.1 500 X\r\ncontent-length: 100\r\n\r\ndown for maint".to_vec();
    let server = RawServer::start(vec![
        Action::WriteThenReset(cut),
        Action::Respond(support::ok("fine")),
    ])
    .await;
    let outcomes: Arc<Mutex<Vec<(bool, bool)>>> = Arc::default();
    let seen = outcomes.clone();
    let policy = RetryPolicy::builder().buffer_body(1024).build().unwrap();
    let dependency = Dependency::new("default", policy).with_classifier(move |attempt| {
        let answered = matches!(attempt.outcome(), Outcome::Response(_));
        seen.lock()
            .unwrap()
            .push((answered, attempt.body().is_some()));
        attempt.default_verdict()
    });
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(dependency).with_clock(FakeClock::new()))
        .build();

    let response = client.get(server.url("/")).send().await.unwrap();

    assert_eq!(attempts_of(&response), (2, StopReason::Succeeded));
    assert_eq!(*outcomes.lock().unwrap(), [(false, false), (true, true)]);
    assert_eq!(response.text().await.unwrap(), "fine");
}

/// What one classifier saw of one attempt.
#[derive(Debug, Clone, PartialEq)]
struct Looked {
    uri: String,
    status: Option<u16>,
    version: Option<http::Version>,
    error_kind: Option<reqwest_safe_retry::AttemptErrorKind>,
    /// The error downcast to the door's own error type, where the classifier looked for it.
    error_is_reqwest: bool,
    error_is_hyper_util: bool,
}

/// One classifier, written once: it records what it sees and delegates to the default rules.
fn looking(seen: Arc<Mutex<Vec<Looked>>>) -> impl Fn(&Attempt<'_>) -> Retryable + Send + Sync {
    move |a: &Attempt<'_>| {
        let error = a.error();
        seen.lock().unwrap().push(Looked {
            uri: a.uri().to_string(),
            status: a.status().map(|s| s.as_u16()),
            version: a.version(),
            error_kind: a.error_kind(),
            error_is_reqwest: error.is_some_and(|e| e.downcast_ref::<reqwest::Error>().is_some()),
            #[cfg(feature = "tower")]
            error_is_hyper_util: error.is_some_and(|e| {
                e.downcast_ref::<hyper_util::client::legacy::Error>()
                    .is_some()
            }),
            #[cfg(not(feature = "tower"))]
            error_is_hyper_util: false,
        });
        assert_eq!(
            a.error().is_some(),
            matches!(a.outcome(), Outcome::Error(_))
        );
        a.default_verdict()
    }
}

/// A classifier sees an answer's status and version, and an error's kind with the error itself
/// to downcast, behind the reqwest door; and the same head behind the tower door, whose error is
/// the inner service's own.
#[tokio::test]
async fn one_classifier_sees_the_same_attempt_behind_either_door() {
    let server = always(503).await;
    let refused = support::refused_url().await;
    let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
    let reqwest_seen = Arc::new(Mutex::new(Vec::new()));
    let dependency = Dependency::new("default", policy)
        .with_classifier(looking(reqwest_seen.clone()))
        .without_budget();
    let middleware = RetryMiddleware::new(dependency).with_clock(FakeClock::new());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware.clone())
        .build();
    let url = format!("{}/a?b=1", server.uri());
    client.get(&url).send().await.unwrap();
    client.get(&refused).send().await.unwrap_err();
    let reqwest_seen = reqwest_seen.lock().unwrap().clone();
    let answered = Looked {
        uri: url.clone(),
        status: Some(503),
        version: Some(http::Version::HTTP_11),
        error_kind: None,
        error_is_reqwest: false,
        error_is_hyper_util: false,
    };
    let failed = Looked {
        uri: refused.clone(),
        status: None,
        version: None,
        error_kind: Some(reqwest_safe_retry::AttemptErrorKind::Connect),
        error_is_reqwest: true,
        error_is_hyper_util: false,
    };
    assert_eq!(
        reqwest_seen,
        [
            answered.clone(),
            answered.clone(),
            failed.clone(),
            failed.clone()
        ]
    );

    #[cfg(feature = "tower")]
    {
        use tower_layer::Layer;
        use tower_service::Service;

        let tower_seen = Arc::new(Mutex::new(Vec::new()));
        let policy = RetryPolicy::builder().max_attempts(2).build().unwrap();
        let dependency = Dependency::new("default", policy)
            .with_classifier(looking(tower_seen.clone()))
            .without_budget();
        let hyper = crate::support::hyper_client();
        let mut service = RetryMiddleware::new(dependency)
            .with_clock(FakeClock::new())
            .layer(hyper);
        let get = |uri: &str| http::Request::get(uri).body(String::new()).unwrap();
        service.call(get(&url)).await.unwrap();
        service.call(get(&refused)).await.unwrap_err();
        let tower_failed = Looked {
            error_is_reqwest: false,
            error_is_hyper_util: true,
            ..failed
        };
        assert_eq!(
            *tower_seen.lock().unwrap(),
            [
                answered.clone(),
                answered,
                tower_failed.clone(),
                tower_failed
            ]
        );
    }
}
