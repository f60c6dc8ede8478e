//! The retry budget: recovery, and charge-before-sleep under concurrency. Its effect on whole
//! traffic (bounded amplification in an outage, no cost when healthy) is tested in the
//! simulator's `tests/budget.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{
    Clock, Dependency, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng, Sleep,
    StopReason,
};
use wiremock::matchers::any;
use wiremock::{Mock, MockServer, ResponseTemplate};

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
