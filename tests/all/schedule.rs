//! Backoff schedules in virtual time: bounds, reproducibility, and no real waiting.

use std::time::{Duration, Instant};

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{Dependency, FakeClock, RetryMiddleware, RetryPolicy, SeededRng};
use wiremock::MockServer;

async fn always_503() -> MockServer {
    crate::support::always(503).await
}

/// Runs one logical GET against `server` and returns the sleeps the fake clock recorded.
async fn sleeps_of(
    server: &MockServer,
    policy: RetryPolicy,
    rng: impl reqwest_safe_retry::RandomSource,
) -> Vec<Duration> {
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(policy)
                .with_clock(clock.clone())
                .with_rng(rng),
        )
        .build();
    client.get(server.uri()).send().await.unwrap();
    clock.sleeps()
}

#[tokio::test]
async fn every_delay_lies_within_the_capped_exponential_ceiling() {
    let server = always_503().await;
    let policy = RetryPolicy::builder()
        .max_attempts(12)
        .base_delay(Duration::from_millis(100))
        .max_delay(Duration::from_secs(10))
        .deadline(Duration::from_secs(600))
        .build()
        .unwrap();
    for seed in 0..8 {
        let sleeps = sleeps_of(&server, policy, SeededRng::new(seed)).await;
        assert_eq!(sleeps.len(), 11);
        for (k, d) in sleeps.iter().enumerate() {
            let ceiling = Duration::from_millis(100)
                .saturating_mul(1 << k)
                .min(Duration::from_secs(10));
            assert!(*d <= ceiling, "seed {seed}, retry {k}: {d:?} > {ceiling:?}");
        }
    }
}

#[tokio::test]
async fn the_same_seed_records_identical_delays() {
    let server = always_503().await;
    let policy = RetryPolicy::builder().max_attempts(6).build().unwrap();

    let first = sleeps_of(&server, policy, SeededRng::new(2026)).await;
    let second = sleeps_of(&server, policy, SeededRng::new(2026)).await;
    let other = sleeps_of(&server, policy, SeededRng::new(2027)).await;

    assert_eq!(first.len(), 5);
    assert_eq!(first, second);
    assert_ne!(first, other);
}

#[tokio::test]
async fn minutes_of_backoff_take_milliseconds_of_real_time() {
    let server = always_503().await;
    let policy = RetryPolicy::builder()
        .max_attempts(8)
        .base_delay(Duration::from_secs(1))
        .max_delay(Duration::from_secs(60))
        .deadline(Duration::from_secs(600))
        .build()
        .unwrap();

    let started = Instant::now();
    // The largest draw every time: each wait is its full ceiling.
    let sleeps = sleeps_of(&server, policy, || u64::MAX).await;
    let real = started.elapsed();

    let secs: Vec<u64> = sleeps.iter().map(Duration::as_secs).collect();
    assert_eq!(secs, [1, 2, 4, 8, 16, 32, 60]);
    assert_eq!(sleeps.iter().sum::<Duration>(), Duration::from_secs(123));
    assert!(real < Duration::from_secs(2), "took {real:?} of real time");
}

#[tokio::test]
async fn the_smallest_draw_retries_without_waiting() {
    let server = always_503().await;
    let policy = RetryPolicy::builder().max_attempts(4).build().unwrap();

    let sleeps = sleeps_of(&server, policy, || 0u64).await;

    assert_eq!(sleeps, [Duration::ZERO; 3]);
    assert_eq!(server.received_requests().await.unwrap().len(), 4);
}

#[tokio::test]
async fn limits_at_the_end_of_the_duration_range_do_not_panic() {
    let server = always_503().await;
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        // The base must be below the deadline: the largest that is.
        .base_delay(Duration::MAX - Duration::from_nanos(1))
        .max_delay(Duration::MAX)
        .attempt_timeout(Duration::MAX)
        .deadline(Duration::MAX)
        .max_retry_after(Duration::MAX)
        .build()
        .unwrap();
    let clock = FakeClock::new();
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("default", policy).without_budget())
                .with_clock(clock.clone())
                .with_rng(|| u64::MAX),
        )
        .build();

    let response = client.get(server.uri()).send().await.unwrap();

    // The waits saturate instead of overflowing (the first is the base, the second its double,
    // capped at the largest duration a draw can give), and the attempts run out as configured.
    assert_eq!(response.status(), 503);
    assert_eq!(server.received_requests().await.unwrap().len(), 3);
    assert_eq!(clock.sleeps(), [Duration::from_nanos(u64::MAX); 2]);
}

/// Each jitter strategy's schedule as the fake clock records it, at the ends of its draws: the
/// exact waits, and none over the cap.
#[tokio::test]
async fn each_jitter_strategy_waits_as_documented() {
    use reqwest_safe_retry::Jitter;
    let server = always_503().await;
    let ms = Duration::from_millis;
    let policy = |jitter| {
        RetryPolicy::builder()
            .max_attempts(7)
            .base_delay(ms(100))
            .max_delay(ms(2_000))
            .deadline(Duration::from_secs(600))
            .jitter(jitter)
            .build()
            .unwrap()
    };
    let (low, high) = (|| 0u64, || u64::MAX);
    let cases: [(Jitter, Vec<Duration>, Vec<Duration>); 4] = [
        (
            Jitter::Full,
            vec![ms(0); 6],
            vec![ms(100), ms(200), ms(400), ms(800), ms(1_600), ms(2_000)],
        ),
        (
            Jitter::Equal,
            vec![ms(50), ms(100), ms(200), ms(400), ms(800), ms(1_000)],
            vec![ms(100), ms(200), ms(400), ms(800), ms(1_600), ms(2_000)],
        ),
        (
            // From the base to three times the last wait: the lowest draw stays at the base,
            // the highest triples each time up to the cap.
            Jitter::Decorrelated,
            vec![ms(100); 6],
            vec![ms(300), ms(900), ms(2_000), ms(2_000), ms(2_000), ms(2_000)],
        ),
        (
            Jitter::None,
            vec![ms(100), ms(200), ms(400), ms(800), ms(1_600), ms(2_000)],
            vec![ms(100), ms(200), ms(400), ms(800), ms(1_600), ms(2_000)],
        ),
    ];
    for (jitter, lowest, highest) in cases {
        assert_eq!(
            sleeps_of(&server, policy(jitter), low).await,
            lowest,
            "{jitter:?}"
        );
        assert_eq!(
            sleeps_of(&server, policy(jitter), high).await,
            highest,
            "{jitter:?}"
        );
        // A few seeds between the ends; the unit tests draw each range thousands of times.
        for seed in 0..3 {
            let sleeps = sleeps_of(&server, policy(jitter), SeededRng::new(seed)).await;
            assert_eq!(sleeps.len(), 6);
            assert!(
                sleeps.iter().all(|d| *d <= ms(2_000)),
                "{jitter:?}: {sleeps:?}"
            );
        }
    }
}

/// Without jitter a `Retry-After` is waited exactly, as with `retry_after_jitter(false)`; with
/// any other strategy the spread above it is full jitter.
#[tokio::test]
async fn without_jitter_a_retry_after_is_waited_exactly() {
    use reqwest_safe_retry::Jitter;
    use wiremock::{Mock, ResponseTemplate, matchers::any};
    let server = MockServer::start().await;
    Mock::given(any())
        .respond_with(ResponseTemplate::new(503).insert_header("retry-after", "3"))
        .mount(&server)
        .await;
    let policy = |jitter| {
        RetryPolicy::builder()
            .max_attempts(3)
            .jitter(jitter)
            .build()
            .unwrap()
    };
    let secs = Duration::from_secs;
    assert_eq!(
        sleeps_of(&server, policy(Jitter::None), || u64::MAX).await,
        [secs(3), secs(3)]
    );
    assert_eq!(
        sleeps_of(&server, policy(Jitter::Equal), || u64::MAX).await,
        [
            secs(3) + Duration::from_millis(100),
            secs(3) + Duration::from_millis(200)
        ]
    );
}
