//! The rules the decision core owns, through the real chain against loopback servers: quotas
//! per origin, believed a minute at a time and held inside the deadline with jitter; a retry
//! that waits for the quota its own answer spent; the throttle's count of attempts whose callers
//! gave up; counters that count every `send()`; the whole answer after a wait; a per-request
//! deadline that moves `max_retry_after` with it. Each of these once went wrong.

use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    AdaptiveThrottle, Clock, Dependency, FakeClock, RetryError, RetryMiddleware, RetryOverride,
    RetryPolicy, RetryRecord, StopReason,
};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support::{Action, RawServer, ok};

const DAY: &str = r#""d";r=0;t=86400"#;

fn client(middleware: RetryMiddleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

/// The default policy on a fake clock, with every jitter draw at its lowest (the exact floor).
fn on(clock: &FakeClock, dependency: impl Into<Dependency>) -> RetryMiddleware {
    RetryMiddleware::new(dependency)
        .with_clock(clock.clone())
        .with_rng(|| 0u64)
}

/// A server that answers `first` once, then `then` for ever.
async fn answers(first: ResponseTemplate, then: ResponseTemplate) -> MockServer {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(first)
        .up_to_n_times(1)
        .mount(&server)
        .await;
    Mock::given(any()).respond_with(then).mount(&server).await;
    server
}

async fn received(server: &MockServer) -> usize {
    server.received_requests().await.unwrap().len()
}

fn stop_of(err: &reqwest_middleware::Error) -> StopReason {
    RetryError::of(err)
        .expect("the middleware's error")
        .stop_reason()
}

#[tokio::test]
async fn one_origin_s_spent_quota_does_not_hold_another_origin() {
    let a = answers(
        ResponseTemplate::new(200).insert_header("ratelimit", DAY),
        ResponseTemplate::new(200),
    )
    .await;
    let b = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&b)
        .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));

    client.get(a.uri()).send().await.unwrap();
    // Same host, another port: another origin, another quota.
    let answer = client.get(b.uri()).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(received(&b).await, 1);
    assert!(clock.sleeps().is_empty(), "nothing held");
    // A held on its own origin: a day is longer than the request may wait.
    let err = client.get(a.uri()).send().await.unwrap_err();
    assert_eq!(stop_of(&err), StopReason::QuotaExhausted);
    assert_eq!(received(&a).await, 1);
}

#[tokio::test]
async fn a_quota_a_redirect_target_spent_holds_that_origin_not_the_one_redirected_from() {
    let target = answers(
        ResponseTemplate::new(200).insert_header("ratelimit", DAY),
        ResponseTemplate::new(200),
    )
    .await;
    let front = MockServer::start().await;
    Mock::given(wiremock::matchers::path("/moved"))
        .respond_with(
            ResponseTemplate::new(307).insert_header("location", format!("{}/", target.uri())),
        )
        .mount(&front)
        .await;
    Mock::given(wiremock::matchers::path("/here"))
        .respond_with(ResponseTemplate::new(200))
        .mount(&front)
        .await;
    let clock = FakeClock::new();
    let middleware = on(&clock, RetryPolicy::default())
        .route(
            "127.0.0.1",
            Dependency::new("routed", RetryPolicy::default()),
        )
        .unwrap();
    let client = client(middleware);

    client
        .get(format!("{}/moved", front.uri()))
        .send()
        .await
        .unwrap();
    let answer = client
        .get(format!("{}/here", front.uri()))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(received(&front).await, 2);
    let err = client.get(target.uri()).send().await.unwrap_err();
    assert_eq!(stop_of(&err), StopReason::QuotaExhausted);
}

#[tokio::test]
async fn a_day_long_reset_is_believed_a_minute_then_a_probe_finds_the_server_recovered() {
    let server = answers(
        ResponseTemplate::new(200).insert_header("ratelimit", DAY),
        ResponseTemplate::new(200),
    )
    .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));
    client.get(server.uri()).send().await.unwrap();

    let mut reached = 0;
    for _hour in 0..25 {
        clock.advance(Duration::from_secs(3_600));
        if client.get(server.uri()).send().await.is_ok() {
            reached += 1;
        }
    }
    assert_eq!(
        reached, 25,
        "the first hourly request probes and clears the quota"
    );
    assert_eq!(received(&server).await, 26);
}

#[tokio::test]
async fn a_quota_hold_counts_against_the_deadline() {
    let server = answers(
        ResponseTemplate::new(200).insert_header("ratelimit", r#""d";r=0;t=9"#),
        ResponseTemplate::new(503),
    )
    .await;
    let policy = RetryPolicy::builder()
        .deadline(Duration::from_secs(10))
        .max_attempts(10)
        .base_delay(Duration::from_secs(1))
        .max_delay(Duration::from_secs(1))
        .jitter(reqwest_safe_retry::Jitter::None)
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let client = client(on(&clock, policy));
    client.get(server.uri()).send().await.unwrap();
    let start = clock.elapsed();

    let answer = client.get(server.uri()).send().await.unwrap();
    assert_eq!(answer.status(), 503);
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(record.stop_reason(), StopReason::DeadlineReached);
    // 9 s held, one attempt, and a 1 s wait would end at the deadline: nothing more.
    assert_eq!(clock.sleeps(), [Duration::from_secs(9)]);
    assert!(clock.elapsed() - start < Duration::from_secs(10));
    assert_eq!(
        (record.attempts(), record.waited()),
        (1, Duration::from_secs(9))
    );
}

/// Under tokio's paused clock, so that 50 concurrent holds pass as they would in real time.
#[tokio::test(start_paused = true)]
async fn requests_held_by_one_quota_come_back_spread_not_as_one_herd() {
    let spent = "HTTP/1.1 200 OK\r\nratelimit: \"d\";r=0;t=5\r\ncontent-length: 0\r\n\
                 connection: close\r\n\r\n";
    let server =
        RawServer::start(vec![Action::Respond(spent.into()), Action::Respond(ok(""))]).await;
    let middleware = RetryMiddleware::new(RetryPolicy::default())
        .with_rng(reqwest_safe_retry::SeededRng::new(3));
    let client = client(middleware);
    client.get(server.url("/")).send().await.unwrap();

    let held = (0..50).map(|_| client.get(server.url("/")).send());
    let answers = futures_join_all(held).await;
    assert!(
        answers
            .iter()
            .all(|a| a.as_ref().is_ok_and(|r| r.status() == 200))
    );
    let arrivals = &server.arrivals()[1..];
    assert_eq!(arrivals.len(), 50);
    let first = *arrivals.iter().min().unwrap();
    let last = *arrivals.iter().max().unwrap();
    let mut distinct = arrivals.to_vec();
    distinct.sort();
    distinct.dedup();
    // Spread over the first backoff's window above the reset (100 ms; tokio's timer ticks in
    // milliseconds, so some land on one tick).
    assert!(distinct.len() >= 25, "{} distinct instants", distinct.len());
    assert!(
        last - first >= Duration::from_millis(50),
        "{:?}",
        last - first
    );
    assert!(first - server.arrivals()[0] >= Duration::from_secs(5));
}

/// Polls every future to its end in one task.
async fn futures_join_all<F: std::future::Future>(
    futures: impl Iterator<Item = F>,
) -> Vec<F::Output> {
    let mut tasks: Vec<_> = futures.map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = tasks.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (task, out) in tasks.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match task.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(Option::unwrap).collect()
}

fn throttle() -> AdaptiveThrottle {
    AdaptiveThrottle::builder()
        .window(Duration::from_secs(3_600))
        .build()
        .unwrap()
}

#[tokio::test]
async fn callers_that_give_up_on_a_slow_dependency_turn_the_throttle_on() {
    let server = RawServer::start(vec![Action::Delay(Duration::from_secs(2), ok("late"))]).await;
    let throttle = throttle();
    let clock = FakeClock::new();
    let client = client(on(
        &clock,
        Dependency::from(RetryPolicy::default()).with_throttle(throttle.clone()),
    ));

    let given_up = (0..10).map(|_| {
        tokio::time::timeout(
            Duration::from_millis(150),
            client.get(server.url("/")).send(),
        )
    });
    let given_up = futures_join_all(given_up).await;
    assert!(given_up.iter().all(Result::is_err));
    assert_eq!(server.requests(), 10);
    assert_eq!(throttle.counts(clock.now()), (10, 0));
    assert!(throttle.rejection_probability(clock.now()) > 0.9);
}

#[tokio::test]
async fn an_attempt_whose_classifier_panicked_counts_for_the_throttle() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(200))
        .mount(&server)
        .await;
    let throttle = throttle();
    let clock = FakeClock::new();
    let middleware = on(
        &clock,
        Dependency::from(RetryPolicy::default())
            .with_throttle(throttle.clone())
            .with_classifier(|_| -> reqwest_safe_retry::classify::Retryable {
                panic!("a classifier's bug")
            }),
    );
    let client = client(middleware);

    let url = server.uri();
    let run = tokio::spawn(async move { client.get(url).send().await.map(|_| ()) });
    assert!(run.await.unwrap_err().is_panic());
    assert_eq!(received(&server).await, 1);
    assert_eq!(
        throttle.counts(clock.now()),
        (1, 0),
        "on the wire, no outcome"
    );
}

#[tokio::test]
async fn every_call_to_send_counts_as_a_request_held_or_refused_and_holds_count_as_waited() {
    let server = answers(
        ResponseTemplate::new(200).insert_header("ratelimit", r#""d";r=0;t=12"#),
        ResponseTemplate::new(200).insert_header("ratelimit", r#""d";r=0;t=3600"#),
    )
    .await;
    let clock = FakeClock::new();
    let dependency = Dependency::from(RetryPolicy::default());
    let middleware = on(&clock, dependency.clone());
    let client = client(middleware);

    client.get(server.uri()).send().await.unwrap();
    let held = client.get(server.uri()).send().await.unwrap();
    let record = RetryRecord::of(&held).unwrap();
    assert_eq!(record.waited(), Duration::from_secs(12));
    assert!(!record.replayed(), "no Idempotent-Replayed on the answer");
    for _ in 0..3 {
        let err = client.get(server.uri()).send().await.unwrap_err();
        assert_eq!(stop_of(&err), StopReason::QuotaExhausted);
    }
    let err = client
        .get(server.uri())
        .with_extension(RetryOverride::new().max_attempts(0))
        .send()
        .await
        .unwrap_err();
    assert_eq!(stop_of(&err), StopReason::InvalidOverride);
    let counts = dependency.counters();
    assert_eq!((counts.requests, counts.attempts), (6, 2));
}

#[tokio::test]
async fn a_retry_waits_for_the_quota_its_own_answer_spent() {
    let server = answers(
        ResponseTemplate::new(429).insert_header("ratelimit", r#""d";r=0;t=5"#),
        ResponseTemplate::new(200),
    )
    .await;
    let clock = FakeClock::new();
    let dependency = Dependency::from(RetryPolicy::default());
    let middleware = on(&clock, dependency.clone());
    let client = client(middleware);

    let answer = client.get(server.uri()).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(clock.sleeps(), [Duration::from_secs(5)]);
    assert_eq!(dependency.counters().retry_after_honoured, 1);
}

#[tokio::test]
async fn a_retry_whose_quota_resets_past_the_deadline_returns_the_answer_at_once() {
    let server = answers(
        ResponseTemplate::new(429).insert_header("ratelimit", r#""d";r=0;t=40"#),
        ResponseTemplate::new(200),
    )
    .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));

    let answer = client.get(server.uri()).send().await.unwrap();
    assert_eq!(answer.status(), 429);
    assert_eq!(
        RetryRecord::of(&answer).unwrap().stop_reason(),
        StopReason::QuotaExhausted
    );
    assert!(clock.sleeps().is_empty());
    assert_eq!(received(&server).await, 1);
}

#[tokio::test]
async fn a_spent_quota_on_a_second_field_line_holds() {
    let server = answers(
        ResponseTemplate::new(200)
            .append_header("ratelimit", r#""burst";r=5;t=1"#)
            .append_header("ratelimit", r#""daily";r=0;t=7"#),
        ResponseTemplate::new(200),
    )
    .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));

    client.get(server.uri()).send().await.unwrap();
    client.get(server.uri()).send().await.unwrap();
    assert_eq!(clock.sleeps(), [Duration::from_secs(7)]);
}

/// The default policy on `clock`, whose retry the throttle refuses after the wait: with K = 1,
/// once one attempt was turned away, the lowest draw rejects the next.
///
/// The wait is drawn at half its range (50 ms): the body is read while the wait runs, and on
/// the fake clock the wait's end comes only when the request sleeps, after the read.
fn refusing_the_retry(clock: &FakeClock) -> RetryMiddleware {
    let throttle = AdaptiveThrottle::builder().k(1.0).build().unwrap();
    let dependency = Dependency::from(RetryPolicy::default()).with_throttle(throttle);
    on(clock, dependency).with_rng(|| u64::MAX / 2)
}

/// A 503 with `body`, retried once and refused by the throttle after the wait: what the caller
/// gets back.
async fn after_a_wait_with(body: &str) -> reqwest::Response {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(503).set_body_string(body))
        .mount(&server)
        .await;
    let clock = FakeClock::new();
    let answer = client(refusing_the_retry(&clock))
        .get(server.uri())
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 503);
    let record = RetryRecord::of(&answer).unwrap();
    assert_eq!(record.stop_reason(), StopReason::Throttled);
    assert_eq!(
        clock.sleeps().len(),
        1,
        "it waited before the throttle refused"
    );
    answer
}

#[tokio::test]
async fn a_stop_after_the_wait_returns_the_transient_answer_whole() {
    let body = "the service is draining; come back in a little while.\n";
    let answer = after_a_wait_with(body).await;
    assert_eq!(answer.content_length(), Some(body.len() as u64));
    assert_eq!(
        answer.headers()["content-length"],
        body.len().to_string().as_str()
    );
    assert_eq!(answer.text().await.unwrap(), body);
}

#[tokio::test]
async fn a_body_of_64_kib_is_kept_through_the_wait_and_a_longer_one_is_not_promised() {
    let body = "x".repeat(64 * 1024);
    let kept = after_a_wait_with(&body).await;
    assert_eq!(kept.headers()["content-length"], "65536");
    assert_eq!(kept.text().await.unwrap(), body);

    let dropped = after_a_wait_with(&"x".repeat(64 * 1024 + 1)).await;
    assert!(dropped.headers().get("content-length").is_none());
    assert_eq!(dropped.text().await.unwrap(), "");
}

#[tokio::test]
async fn a_per_request_deadline_moves_max_retry_after_with_it() {
    let server = answers(
        ResponseTemplate::new(503).insert_header("retry-after", "60"),
        ResponseTemplate::new(200),
    )
    .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));

    let answer = client
        .get(server.uri())
        .with_extension(RetryOverride::new().deadline(Duration::from_secs(120)))
        .send()
        .await
        .unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(clock.sleeps(), [Duration::from_secs(60)]);
}

#[tokio::test]
async fn a_request_dropped_during_its_probe_gives_the_probe_back() {
    let spent = "HTTP/1.1 200 OK\r\nratelimit: \"d\";r=0;t=86400\r\ncontent-length: 0\r\n\
                 connection: close\r\n\r\n";
    let server = RawServer::start(vec![
        Action::Respond(spent.into()),
        Action::Delay(Duration::from_secs(2), ok("late")),
        Action::Respond(ok("")),
    ])
    .await;
    let clock = FakeClock::new();
    let client = client(on(&clock, RetryPolicy::default()));
    client.get(server.url("/")).send().await.unwrap();
    clock.advance(Duration::from_secs(61));

    let dropped = tokio::time::timeout(
        Duration::from_millis(150),
        client.get(server.url("/")).send(),
    )
    .await;
    assert!(dropped.is_err());
    assert_eq!(server.requests(), 2, "the probe was sent");
    // The probe got no answer and was given back: the next request probes at once.
    let answer = client.get(server.url("/")).send().await.unwrap();
    assert_eq!(answer.status(), 200);
    assert_eq!(server.requests(), 3);
    assert!(clock.sleeps().is_empty());
}

#[tokio::test]
async fn a_key_is_counted_as_stamped_only_for_a_request_that_is_sent() {
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(503))
        .mount(&server)
        .await;
    // K = 1: after one attempt turned away, the lowest draw rejects the next.
    let throttle = AdaptiveThrottle::builder().k(1.0).build().unwrap();
    let clock = FakeClock::new();
    let once = RetryPolicy::builder().max_attempts(1).build().unwrap();
    let dependency = Dependency::from(once).with_throttle(throttle);
    let middleware = on(&clock, dependency.clone());
    let client = client(middleware);

    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 503);
    let err = client
        .post(server.uri())
        .body("x")
        .send()
        .await
        .unwrap_err();
    assert_eq!(stop_of(&err), StopReason::Throttled);
    assert_eq!(received(&server).await, 1);
    let counts = dependency.counters();
    assert_eq!((counts.keys_stamped, counts.throttled), (0, 1));
}

#[tokio::test]
async fn a_body_without_a_declared_length_is_kept_up_to_64_kib_too() {
    for (len, kept) in [(1_000, true), (64 * 1024 + 1, false)] {
        // Delimited by the connection's close: nothing says the length before the bytes come.
        let mut answer = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\n\r\n".to_vec();
        answer.extend(std::iter::repeat_n(b'x', len));
        let server = RawServer::start(vec![Action::Respond(answer)]).await;
        let answer = client(refusing_the_retry(&FakeClock::new()))
            .get(server.url("/"))
            .send()
            .await
            .unwrap();
        assert_eq!(answer.status(), 503);
        assert_eq!(server.requests(), 1);
        let body = answer.bytes().await.unwrap();
        assert_eq!(body.len(), if kept { len } else { 0 }, "{len} bytes");
    }
}
