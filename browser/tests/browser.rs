//! The reqwest door in a real browser: reqwest over `fetch` in headless Chromium, against the
//! scripted server on loopback (`browser_tests`), which `.ci/browser` starts and names in
//! `SAFE_RETRY_BROWSER_SERVER` when it builds these tests. Each test counts what the server
//! got: its attempts and the key each carried.

#![cfg(target_arch = "wasm32")]

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    AttemptErrorKind, BrowserClock, Clock, Dependency, FakeClock, Jitter, RandomSource,
    RetryBudget, RetryError, RetryMiddleware, RetryPolicy, SeededRng, StopReason,
};
use wasm_bindgen_test::{wasm_bindgen_test, wasm_bindgen_test_configure};

wasm_bindgen_test_configure!(run_in_browser);

/// The scripted server's origin, given when these tests were built.
fn server() -> &'static str {
    option_env!("SAFE_RETRY_BROWSER_SERVER").expect(
        "SAFE_RETRY_BROWSER_SERVER is not set: run these tests with .ci/browser, which starts \
         the scripted server on loopback and builds them with its origin",
    )
}

/// The URL of script `id`: its statuses, `Retry-After` seconds and delays in milliseconds.
fn script(id: &str, statuses: &str, retry_after: &str, delays: &str) -> String {
    format!(
        "{}/script/{id}?s={statuses}&ra={retry_after}&d={delays}",
        server()
    )
}

/// What the server got for script `id`: each request's method and key, in order.
async fn seen(id: &str) -> Vec<(String, Option<String>)> {
    let text = reqwest::get(format!("{}/seen/{id}", server()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    text.lines()
        .map(|line| {
            let (method, key) = line.split_once(' ').unwrap();
            let key = (key != "-").then(|| key.to_owned());
            (method.to_owned(), key)
        })
        .collect()
}

fn client(middleware: RetryMiddleware) -> ClientWithMiddleware {
    ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build()
}

/// Full jitter's wait before retry `k`, by `Jitter::Full`'s rule.
fn full_jitter(policy: &RetryPolicy, k: u32, x: u64) -> Duration {
    let ceiling = policy
        .base_delay()
        .saturating_mul(1 << k)
        .min(policy.max_delay());
    let nanos = (u128::from(x) * (ceiling.as_nanos() + 1)) >> 64;
    Duration::from_nanos(nanos as u64)
}

/// A unique script name for this run of this test (the server lives across the run).
fn id(test: &str) -> String {
    format!(
        "{test}-{}",
        SeededRng::new(
            web_time::SystemTime::now()
                .duration_since(web_time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        )
        .next_u64()
    )
}

#[wasm_bindgen_test]
async fn a_post_through_two_503s_carries_one_key_and_waits_the_seeded_schedule() {
    let id = id("post");
    let policy = RetryPolicy::builder().max_attempts(4).build().unwrap();
    let clock = FakeClock::new();
    let retry = RetryMiddleware::new(policy.clone())
        .with_clock(clock.clone())
        .with_rng(SeededRng::new(42));

    let response = client(retry)
        .post(script(&id, "503,503,201", "", "0"))
        .body("{\"order\":17}")
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 201);
    assert_eq!(response.text().await.unwrap(), "request 3");
    let seen = seen(&id).await;
    assert_eq!(seen.len(), 3, "{seen:?}");
    let key = seen[0].1.clone().expect("the first attempt carries a key");
    assert!(!key.is_empty());
    for (method, each) in &seen {
        assert_eq!(
            (method.as_str(), each.as_deref()),
            ("POST", Some(key.as_str()))
        );
    }
    let draws = SeededRng::new(42);
    let expected: Vec<Duration> = (0..2)
        .map(|k| full_jitter(&policy, k, draws.next_u64()))
        .collect();
    assert_eq!(clock.sleeps(), expected);
}

#[wasm_bindgen_test]
async fn retry_after_sets_the_wait_exactly() {
    let id = id("retry-after");
    let policy = RetryPolicy::builder()
        .retry_after_jitter(false)
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let retry = RetryMiddleware::new(policy).with_clock(clock.clone());

    let response = client(retry)
        .get(script(&id, "503,200", "2,", "0"))
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 200);
    assert_eq!(seen(&id).await.len(), 2);
    assert_eq!(clock.sleeps(), [Duration::from_secs(2)]);
}

#[wasm_bindgen_test]
async fn the_budget_pays_for_every_retry_and_stops_them_when_spent() {
    let id = id("budget");
    let budget = RetryBudget::builder()
        .capacity(2.0)
        .initial(2.0)
        .retry_cost(1.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder().max_attempts(3).build().unwrap();
    let payments = Dependency::new("payments", policy).with_budget(budget);
    let clock = FakeClock::new();
    let client = client(RetryMiddleware::new(payments.clone()).with_clock(clock.clone()));

    let mut stops = Vec::new();
    for _ in 0..3 {
        let response = client
            .get(script(&id, "503", "", "0"))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 503);
        stops.push(payments.counters().retries);
    }

    // Two retries paid for by the first request; none left for the others.
    assert_eq!(seen(&id).await.len(), 3 + 1 + 1);
    assert_eq!(stops, [2, 2, 2]);
    assert_eq!(clock.sleeps().len(), 2);
    assert_eq!(payments.budget().unwrap().balance(), 0.0);
}

#[wasm_bindgen_test]
async fn the_deadline_cuts_a_slow_answer_on_the_browser_s_own_timers() {
    let id = id("deadline");
    let policy = RetryPolicy::builder()
        .base_delay(Duration::from_millis(10))
        .attempt_timeout(Duration::from_millis(60))
        .deadline(Duration::from_millis(200))
        .max_attempts(10)
        .build()
        .unwrap();
    let client = client(RetryMiddleware::new(policy).with_clock(BrowserClock::new()));

    let start = web_time::Instant::now();
    let err = client
        .get(script(&id, "200", "", "5000"))
        .send()
        .await
        .unwrap_err();
    let took = start.elapsed();

    let retry = RetryError::of(&err).expect("the middleware's error");
    assert_eq!(retry.stop_reason(), StopReason::DeadlineReached, "{err}");
    assert_eq!(retry.last_error_kind(), Some(AttemptErrorKind::Timeout));
    // Cut at 200 ms, not after the server's 5 s; slack for a loaded machine.
    assert!(took >= Duration::from_millis(190), "{took:?}");
    assert!(took < Duration::from_millis(2500), "{took:?}");
    let seen = seen(&id).await;
    assert!(retry.attempts() >= 2, "{}", retry.attempts());
    assert_eq!(seen.len() as u32, retry.attempts(), "{seen:?}");
}

#[wasm_bindgen_test]
async fn the_browser_clock_waits_the_drawn_backoff_before_the_retry() {
    let id = id("backoff");
    let policy = RetryPolicy::builder()
        .base_delay(Duration::from_millis(80))
        .build()
        .unwrap();
    let waits = Arc::new(Mutex::new(Vec::new()));
    let seen_waits = waits.clone();
    let retry = RetryMiddleware::new(policy.clone())
        .with_clock(BrowserClock::new())
        .with_rng(SeededRng::new(42))
        .with_observer(move |event| seen_waits.lock().unwrap().extend(event.delay));

    let start = web_time::Instant::now();
    let response = client(retry)
        .get(script(&id, "503,200", "", "0"))
        .send()
        .await
        .unwrap();
    let took = start.elapsed();

    assert_eq!(response.status(), 200);
    assert_eq!(seen(&id).await.len(), 2);
    let wait = full_jitter(&policy, 0, SeededRng::new(42).next_u64());
    assert_eq!(*waits.lock().unwrap(), [wait]);
    assert!(took >= wait, "{took:?} < {wait:?}");
}

#[wasm_bindgen_test]
async fn a_request_dropped_in_its_backoff_sends_nothing_more_and_gives_its_token_back() {
    let id = id("dropped");
    let budget = RetryBudget::builder()
        .capacity(3.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let policy = RetryPolicy::builder()
        .base_delay(Duration::from_millis(100))
        .jitter(Jitter::None)
        .build()
        .unwrap();
    let orders = Dependency::new("orders", policy).with_budget(budget.clone());
    let waiting = Arc::new(AtomicBool::new(false));
    let decided = waiting.clone();
    let retry = RetryMiddleware::new(orders.clone())
        .with_clock(BrowserClock::new())
        .with_observer(move |event| {
            if event.delay.is_some() {
                decided.store(true, Ordering::SeqCst);
            }
        });
    let client = client(retry);

    let mut send = Box::pin(client.get(script(&id, "503,200", "", "0")).send());
    // Polled until the middleware has decided to wait its 100 ms, then dropped in that wait.
    let ended = std::future::poll_fn(|cx| match send.as_mut().poll(cx) {
        Poll::Ready(result) => Poll::Ready(Some(result.map(|r| r.status()))),
        Poll::Pending if waiting.load(Ordering::SeqCst) => Poll::Ready(None),
        Poll::Pending => Poll::Pending,
    })
    .await;
    assert!(ended.is_none(), "ended before its backoff: {ended:?}");
    assert_eq!(budget.balance(), 2.0, "the retry paid for");
    drop(send);

    // Past the end of the wait it was dropped in: no second attempt came.
    BrowserClock::new().sleep(Duration::from_millis(300)).await;
    assert_eq!(seen(&id).await.len(), 1);
    assert_eq!(budget.balance(), 3.0, "given back");
    assert_eq!(
        (orders.counters().attempts, orders.counters().retries),
        (1, 0)
    );
}

#[wasm_bindgen_test]
async fn a_failed_fetch_is_retried_only_when_repeating_is_safe() {
    let closed = reqwest::get(format!("{}/closed", server()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let policy = RetryPolicy::builder().max_attempts(3).build().unwrap();

    // A GET may be repeated: every attempt is made.
    let clock = FakeClock::new();
    let err = client(RetryMiddleware::new(policy.clone()).with_clock(clock.clone()))
        .get(format!("{closed}/orders"))
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).expect("the middleware's error");
    assert_eq!(retry.attempts(), 3, "{err}");
    assert_eq!(retry.stop_reason(), StopReason::AttemptsExhausted);
    assert_eq!(retry.last_error_kind(), Some(AttemptErrorKind::Reset));
    assert_eq!(clock.sleeps().len(), 2);

    // A POST without a key may have reached the server before the failure: never repeated.
    let unkeyed = Dependency::new("orders", policy).without_idempotency_keys();
    let clock = FakeClock::new();
    let err = client(RetryMiddleware::new(unkeyed).with_clock(clock.clone()))
        .post(format!("{closed}/orders"))
        .body("{}")
        .send()
        .await
        .unwrap_err();
    let retry = RetryError::of(&err).expect("the middleware's error");
    assert_eq!(retry.attempts(), 1, "{err}");
    assert_eq!(retry.stop_reason(), StopReason::NotSafeToRetry);
    assert!(clock.sleeps().is_empty());
}

#[wasm_bindgen_test]
fn buffer_body_is_refused_in_the_browser_when_the_policy_is_built() {
    let err = RetryPolicy::builder()
        .buffer_body(1024)
        .build()
        .unwrap_err();
    assert!(err.to_string().contains("browser"), "{err}");
}
