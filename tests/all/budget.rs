//! The retry budget: recovery, charge-before-sleep under concurrency, tokens given back by
//! requests dropped in their backoff, no real time in a fake clock's budget, what earns (answers,
//! not errors) and what refunds. Its effect on whole
//! traffic (bounded amplification in an outage, no cost when healthy) is tested in the
//! simulator's `tests/budget.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{
    Clock, Dependency, FakeClock, RetryBudget, RetryError, RetryMiddleware, RetryPolicy,
    RetryRecord, SeededRng, Sleep, StopReason,
};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

use crate::support;

/// An outage that empties a budget, then a recovered service: the budget admits a retry again
/// after exactly as many good first attempts as its documentation promises (ten, at a ratio of
/// 0.1 and a retry cost of one token).
#[tokio::test]
async fn after_an_outage_ten_good_requests_pay_for_the_next_retry() {
    let server = MockServer::start().await;
    let budget = RetryBudget::builder().floor_per_sec(0.0).build().unwrap();
    let dependency = Dependency::new("default", RetryPolicy::default()).with_budget(budget.clone());
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(dependency.clone())
                .with_clock(reqwest_safe_retry::FakeClock::new())
                .with_rng(SeededRng::new(1)),
        )
        .build();
    let failing = || async {
        server.reset().await;
        Mock::given(any())
            .respond_with(ResponseTemplate::new(503))
            .mount(&server)
            .await;
    };

    // The outage: ten tokens pay for ten retries, then retries are refused.
    failing().await;
    // Bounded: ten tokens pay for ten requests' first retries; a budget that never refuses
    // fails here after twenty requests instead of looping for ever.
    for _ in 0..20 {
        if dependency.counters().budget_refusals > 0 {
            break;
        }
        client.get(server.uri()).send().await.unwrap();
    }
    assert_eq!(
        dependency.counters().budget_refusals,
        1,
        "the eleventh request's retry is refused"
    );
    assert_eq!(dependency.counters().retries, 10);
    assert_eq!(budget.balance(), 0.0);

    for good in 1..=10 {
        server.reset().await;
        Mock::given(any())
            .respond_with(ResponseTemplate::new(200))
            .mount(&server)
            .await;
        client.get(server.uri()).send().await.unwrap();

        failing().await;
        let response = client.get(server.uri()).send().await.unwrap();
        let record = RetryRecord::of(&response).unwrap();
        if good < 10 {
            assert_eq!(
                record.stop_reason(),
                StopReason::BudgetExhausted,
                "after {good}"
            );
            assert_eq!(record.attempts(), 1);
            assert_eq!(server.received_requests().await.unwrap().len(), 1);
        } else {
            // The tenth good request paid for exactly one retry.
            assert_eq!(record.attempts(), 2, "after {good}");
            assert_eq!(record.stop_reason(), StopReason::BudgetExhausted);
        }
    }
}

/// A clock whose sleeps are real but short, and which counts how many are under way at once.
#[derive(Debug, Default)]
struct CountingClock {
    sleeping: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Clock for CountingClock {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn wall_now(&self) -> SystemTime {
        SystemTime::now()
    }

    fn sleep(&self, _: Duration) -> Sleep {
        let (sleeping, most) = (self.sleeping.clone(), self.most.clone());
        Box::pin(async move {
            let now = sleeping.fetch_add(1, Ordering::SeqCst) + 1;
            most.fetch_max(now, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(20)).await;
            sleeping.fetch_sub(1, Ordering::SeqCst);
        })
    }

    fn timeout(&self, duration: Duration) -> Sleep {
        Box::pin(tokio::time::sleep(duration))
    }
}

/// Always 503, counting attempts: the end of the chain, standing in for a dead dependency so
/// a thousand requests can be in flight at once without a thousand sockets.
#[derive(Debug, Default)]
struct Dead {
    attempts: AtomicUsize,
}

#[async_trait::async_trait]
impl Middleware for Dead {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        self.attempts.fetch_add(1, Ordering::SeqCst);
        tokio::task::yield_now().await;
        Ok(Response::from(
            http::Response::builder().status(503).body("").unwrap(),
        ))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_waiting_in_backoff_never_exceed_what_the_bucket_holds() {
    const CAPACITY: usize = 50;
    let budget = RetryBudget::builder()
        .capacity(CAPACITY as f64)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let dependency = Dependency::new(
        "default",
        RetryPolicy::builder().max_attempts(5).build().unwrap(),
    )
    .with_budget(budget.clone());
    let clock = CountingClock::default();
    let (most, dead) = (clock.most.clone(), Arc::new(Dead::default()));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(dependency.clone()).with_clock(clock))
        .with_arc(dead.clone())
        .build();

    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..1_000 {
        let client = client.clone();
        tasks.spawn(async move { client.get("http://127.0.0.1:9/").send().await.unwrap() });
    }
    while let Some(done) = tasks.join_next().await {
        assert_eq!(done.unwrap().status(), 503);
    }

    assert!(
        most.load(Ordering::SeqCst) <= CAPACITY,
        "{} asleep at once",
        most.load(Ordering::SeqCst)
    );
    assert!(most.load(Ordering::SeqCst) > 0);
    assert_eq!(dependency.counters().retries, CAPACITY as u64);
    assert_eq!(dead.attempts.load(Ordering::SeqCst), 1_000 + CAPACITY);
}

/// Twenty-one callers of a dependency with ten tokens: ten get a retry and wait five minutes for
/// it, eleven are refused. The ten are dropped mid-backoff, as callers that give up are. None of
/// their retries happened, so none stays paid for or counted, and the next request's retry is
/// granted. No timer decides when they are dropped (a loaded machine once made a 100 ms caller
/// timeout fire before the first answers): the observer says when each has decided to wait.
#[tokio::test]
async fn requests_dropped_during_their_backoff_give_their_tokens_back() {
    let server = support::always(503).await;
    let budget = RetryBudget::builder()
        .capacity(10.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let slow_backoff = RetryPolicy::builder()
        .base_delay(Duration::from_secs(300))
        .max_delay(Duration::from_secs(300))
        .deadline(Duration::from_secs(600))
        .build()
        .unwrap();
    // The top of every draw (five minutes' wait) until the last request, which draws no wait.
    let draw = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let drawn = draw.clone();
    let waiting = std::sync::Arc::new(tokio::sync::Semaphore::new(0));
    let decided = waiting.clone();
    let counters = Dependency::new("default", slow_backoff).with_budget(budget.clone());
    let middleware = RetryMiddleware::new(counters.clone())
        .with_rng(move || drawn.load(std::sync::atomic::Ordering::Relaxed))
        .with_observer(move |event| {
            if event.delay.is_some() {
                decided.add_permits(1);
            }
        });
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(middleware)
        .build();

    let mut callers = tokio::task::JoinSet::new();
    for _ in 0..21 {
        let (client, url) = (client.clone(), server.uri());
        callers.spawn(async move { client.get(url).send().await });
    }
    // A bound on the wait, not a part of the scenario: every step below takes milliseconds.
    let refused = tokio::time::timeout(Duration::from_secs(30), async {
        waiting.acquire_many(10).await.unwrap().forget();
        let mut refused = 0;
        while refused < 11 {
            let response = callers.join_next().await.unwrap().unwrap().unwrap();
            let record = RetryRecord::of(&response).unwrap();
            assert_eq!(record.stop_reason(), StopReason::BudgetExhausted);
            refused += 1;
        }
        refused
    })
    .await
    .expect("ten callers waiting and eleven refused");
    assert_eq!(refused, 11);
    assert_eq!(budget.balance(), 0.0, "the ten waiting have paid");
    callers.abort_all();
    let mut gave_up = 0;
    while let Some(done) = callers.join_next().await {
        assert!(done.unwrap_err().is_cancelled(), "dropped in its backoff");
        gave_up += 1;
    }

    assert_eq!(gave_up, 10);
    assert_eq!(server.received_requests().await.unwrap().len(), 21);
    assert_eq!(budget.balance(), 10.0);
    let counts = counters.counters();
    assert_eq!((counts.attempts, counts.retries), (21, 0));

    // The next request gets its retry (a fast one: it draws no wait).
    let flaky =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    draw.store(0, std::sync::atomic::Ordering::Relaxed);
    let response = client.get(flaky.uri()).send().await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(RetryRecord::of(&response).unwrap().attempts(), 2);
    assert_eq!(counters.counters().retries, 1);
}

/// What one request does with a budget that starts empty and earns twenty tokens a second, on
/// a fake clock: `gap` of real time passes between building the budget and the clock.
async fn attempts_and_sleeps_after(gap: Duration) -> (u32, Vec<Duration>) {
    let server =
        support::first_then(ResponseTemplate::new(503), 2, ResponseTemplate::new(200)).await;
    let budget = RetryBudget::builder()
        .initial(0.0)
        .floor_per_sec(20.0)
        .build()
        .unwrap();
    tokio::time::sleep(gap).await;
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", RetryPolicy::default()).with_budget(budget),
            )
            .with_clock(clock.clone())
            .with_rng(SeededRng::new(3)),
        )
        .build();
    let response = client.get(server.uri()).send().await.unwrap();
    let attempts = RetryRecord::of(&response).unwrap().attempts();
    (attempts, clock.sleeps())
}

#[tokio::test]
async fn real_time_never_leaks_into_a_budget_on_a_fake_clock() {
    let (without_gap, with_gap) = tokio::join!(
        attempts_and_sleeps_after(Duration::ZERO),
        // Two tokens' worth of real time, had it leaked.
        attempts_and_sleeps_after(Duration::from_millis(110)),
    );
    assert_eq!(without_gap, with_gap);
    // An empty budget on virtual time zero: the first retry is refused.
    assert_eq!(without_gap, (1, vec![]));
}

/// Fails every request before it reaches the network: an error, not an answer.
#[derive(Debug)]
struct Refuses;

#[async_trait::async_trait]
impl Middleware for Refuses {
    async fn handle(
        &self,
        _: Request,
        _: &mut Extensions,
        _: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        Err(reqwest_middleware::Error::middleware(
            std::io::Error::other("refused by policy"),
        ))
    }
}

#[tokio::test]
async fn permanent_errors_earn_the_budget_nothing_and_answers_do() {
    let budget = RetryBudget::builder()
        .initial(0.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let ours = || {
        RetryMiddleware::new(
            Dependency::new("default", support::policy()).with_budget(budget.clone()),
        )
        .with_clock(FakeClock::new())
    };
    // The refusing middleware sits after ours: its error is the attempt's outcome.
    let refusing = ClientBuilder::new(reqwest::Client::new())
        .with(ours())
        .with(Refuses)
        .build();
    let plain = ClientBuilder::new(reqwest::Client::new())
        .with(ours())
        .build();
    let looping = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(302).insert_header("location", "/again"))
        .mount(&looping)
        .await;

    for _ in 0..5 {
        assert!(refusing.get(looping.uri()).send().await.is_err());
        let err = plain.get(looping.uri()).send().await.unwrap_err();
        let last = RetryError::of(&err).unwrap().last_error();
        assert!(last.beneath().unwrap().is_redirect());
    }
    assert_eq!(budget.balance(), 0.0, "ten errors earned something");

    let missing = support::always(404).await;
    for _ in 0..10 {
        plain.get(missing.uri()).send().await.unwrap();
    }
    assert_eq!(budget.balance(), 1.0, "ten answers earn one token");
}

#[tokio::test]
async fn only_a_success_after_retries_refunds_its_retry() {
    let budget = RetryBudget::aws_like();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(
                Dependency::new("default", support::policy()).with_budget(budget.clone()),
            )
            .with_clock(FakeClock::new()),
        )
        .build();
    let then_404 =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(404)).await;
    client.get(then_404.uri()).send().await.unwrap();
    assert_eq!(budget.balance(), 495.0, "a 404 after a retry is no success");
    let then_200 =
        support::first_then(ResponseTemplate::new(503), 1, ResponseTemplate::new(200)).await;
    client.get(then_200.uri()).send().await.unwrap();
    assert_eq!(budget.balance(), 495.0, "paid 5, refunded 5");
}

/// A retry the budget refused says so, and how large the bucket is: a burst that spends it is
/// the budget at work, and the message says what to size.
#[tokio::test]
async fn a_refused_retry_s_message_names_the_bucket_s_size() {
    let empty = reqwest_safe_retry::RetryBudget::builder()
        .capacity(3.0)
        .initial(0.0)
        .floor_per_sec(0.0)
        .build()
        .unwrap();
    let dependency =
        reqwest_safe_retry::Dependency::new("dry", reqwest_safe_retry::RetryPolicy::default())
            .with_budget(empty);
    let client = reqwest_middleware::ClientBuilder::new(reqwest::Client::new())
        .with(
            reqwest_safe_retry::RetryMiddleware::new(dependency)
                .with_clock(reqwest_safe_retry::FakeClock::new()),
        )
        .build();
    let err = client
        .get(crate::support::refused_url().await)
        .send()
        .await
        .unwrap_err();
    let retry = reqwest_safe_retry::RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (1, reqwest_safe_retry::StopReason::BudgetExhausted)
    );
    let message = err.to_string();
    assert!(
        message.contains("the retry budget is exhausted: the dependency's bucket holds 3 tokens"),
        "{message}"
    );
}
