//! Attempts that follow measured latency, through the whole chain on loopback, in virtual time:
//! an inner middleware stands in for the network's delay by moving the `FakeClock` before the
//! request reaches the real server, so the attempt's timer sees exactly that latency.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{
    Dependency, FakeClock, RetryError, RetryMiddleware, RetryPolicy, SeededRng, StopReason,
};

use crate::support::{self, Before};

/// The latency the next attempts take, in microseconds of virtual time.
#[derive(Clone, Default)]
struct Latency(Arc<AtomicU64>);

impl Latency {
    fn set(&self, d: Duration) {
        self.0.store(d.as_micros() as u64, Ordering::SeqCst);
    }
}

/// A client of `policy` whose attempts each take the current `latency` on `clock`.
fn client(policy: RetryPolicy, clock: &FakeClock, latency: &Latency) -> ClientWithMiddleware {
    let (moved, took) = (clock.clone(), latency.clone());
    ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(Dependency::new("search", policy).without_budget())
                .with_clock(clock.clone())
                .with_rng(SeededRng::new(3)),
        )
        .with(Before(move |_: &mut http::Extensions| {
            moved.advance(Duration::from_micros(took.0.load(Ordering::SeqCst)));
            None
        }))
        .build()
}

/// 2 x p99.9 with a 5 ms floor, under a fixed 100 ms attempt timeout.
fn measured() -> RetryPolicy {
    RetryPolicy::builder()
        .attempt_timeout(Duration::from_millis(100))
        .timeout_from_latency(2.0, Duration::from_millis(5))
        .build()
        .unwrap()
}

/// The time limit of the last attempt of a request that timed out on every attempt, as its
/// error says it ("attempt timed out after 40.96ms").
async fn limits_of_a_request_that_never_answers_in_time(
    client: &ClientWithMiddleware,
    url: &str,
) -> String {
    let err = client.get(url).send().await.unwrap_err();
    let retry = RetryError::of(&err).unwrap();
    assert_eq!(
        (retry.attempts(), retry.stop_reason()),
        (3, StopReason::AttemptsExhausted)
    );
    assert!(retry.timed_out());
    retry.last_error().to_string()
}

#[tokio::test]
async fn the_timeout_follows_20_ms_answers_to_twice_their_p99_9_doubling_after_a_timeout() {
    let server = support::always(200).await;
    let clock = FakeClock::new();
    let latency = Latency::default();
    let client = client(measured(), &clock, &latency);

    // Empty: the fixed timeout, 100 ms, cuts a 150 ms attempt and lets a 90 ms one through.
    latency.set(Duration::from_millis(150));
    let last = limits_of_a_request_that_never_answers_in_time(&client, &server.uri()).await;
    assert_eq!(last, "attempt timed out after 100ms");
    latency.set(Duration::from_millis(90));
    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 200);

    // A window of 20 ms answers (and the one of 90 ms): the p99.9 is read as the upper edge of
    // 20 ms's bucket, 20.48 ms, and the timeout is twice that.
    latency.set(Duration::from_millis(20));
    for _ in 0..1_200 {
        client.get(server.uri()).send().await.unwrap();
    }
    latency.set(Duration::from_millis(40));
    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 200);
    latency.set(Duration::from_millis(200));
    let last = limits_of_a_request_that_never_answers_in_time(&client, &server.uri()).await;
    // 40.96 ms, then twice that after each timeout, capped by the fixed 100 ms.
    assert_eq!(last, "attempt timed out after 100ms");
    let policy = RetryPolicy::builder()
        .max_attempts(2)
        .attempt_timeout(Duration::from_millis(100))
        .timeout_from_latency(2.0, Duration::from_millis(5))
        .build()
        .unwrap();
    let two = self::client(policy, &clock, &latency);
    latency.set(Duration::from_millis(20));
    for _ in 0..150 {
        two.get(server.uri()).send().await.unwrap();
    }
    clock.advance(Duration::from_secs(1));
    // 40.96 ms cuts the first attempt, 81.92 ms the second.
    latency.set(Duration::from_millis(90));
    let err = two.get(server.uri()).send().await.unwrap_err();
    assert_eq!(
        RetryError::of(&err).unwrap().last_error().to_string(),
        "attempt timed out after 81.92ms"
    );
}

#[tokio::test]
async fn the_measured_timeout_never_goes_below_its_floor() {
    let server = support::always(200).await;
    let clock = FakeClock::new();
    let latency = Latency::default();
    let client = client(measured(), &clock, &latency);
    latency.set(Duration::from_millis(1));
    for _ in 0..150 {
        client.get(server.uri()).send().await.unwrap();
    }
    // The percentiles are read at most once a second.
    clock.advance(Duration::from_secs(1));
    // Twice 1 ms's bucket would be 2.048 ms: the floor, 5 ms, lets a 4 ms answer through.
    latency.set(Duration::from_millis(4));
    assert_eq!(client.get(server.uri()).send().await.unwrap().status(), 200);
    // 5 ms cuts a 6 ms attempt; its retry gets 10 ms and answers.
    latency.set(Duration::from_millis(6));
    let response = client.get(server.uri()).send().await.unwrap();
    assert_eq!(support::ended(&response), (2, StopReason::Succeeded));
}

/// Under tokio's paused clock an attempt to a real server takes no time on the clock: the
/// window counts nothing, so the fixed timeout serves and no read is hedged. Counted, its
/// zeros would put every attempt's timeout at the floor (1 us here, in real time) and hedge
/// every read at once.
#[tokio::test(start_paused = true)]
async fn under_tokio_s_paused_clock_the_window_counts_nothing_and_the_fixed_timeout_serves() {
    let server = support::always(200).await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(5))
        .timeout_from_latency(2.0, Duration::from_micros(1))
        .hedge_reads(0.05, Duration::from_secs(1))
        .build()
        .unwrap();
    let reads = Dependency::new("reads", policy);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(reads.clone()))
        .build();
    for round in 0..3 {
        for _ in 0..120 {
            let response = client.get(server.uri()).send().await.unwrap();
            assert_eq!(support::ended(&response), (1, StopReason::Succeeded));
        }
        // Past the next reading of the window.
        tokio::time::advance(Duration::from_secs(2)).await;
        assert_eq!(reads.counters().hedges, 0, "round {round}");
    }
    assert_eq!(reads.counters().attempts, 360);
}

#[tokio::test]
async fn past_the_cut_allowance_an_attempt_runs_on_to_the_fixed_timeout() {
    let server = support::always(200).await;
    let clock = FakeClock::new();
    let latency = Latency::default();
    let client = client(measured(), &clock, &latency);
    latency.set(Duration::from_millis(20));
    for _ in 0..150 {
        client.get(server.uri()).send().await.unwrap();
    }
    clock.advance(Duration::from_secs(1));
    // 60 ms answers: the first two attempts this second are cut at 40.96 ms (the allowance)
    // and retried within twice that; after them, an attempt runs on to the fixed 100 ms and
    // is answered.
    latency.set(Duration::from_millis(60));
    for expected in [2, 2, 1] {
        let response = client.get(server.uri()).send().await.unwrap();
        assert_eq!(support::ended(&response), (expected, StopReason::Succeeded));
    }
    // One slower than the fixed timeout is cut there, and the error says so.
    latency.set(Duration::from_millis(150));
    let last = limits_of_a_request_that_never_answers_in_time(&client, &server.uri()).await;
    assert_eq!(last, "attempt timed out after 100ms");
}

/// A server on 127.0.0.1 that answers each request with 200 after the current `delay` of real
/// time, and counts the requests that arrived.
#[derive(Clone, Default)]
struct Slowing {
    delay: Latency,
    arrived: Arc<AtomicU64>,
}

impl Slowing {
    async fn start(&self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/", listener.local_addr().unwrap());
        let shared = self.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let shared = shared.clone();
                tokio::spawn(async move {
                    if support::read_request(&mut stream).await.is_none() {
                        return;
                    }
                    shared.arrived.fetch_add(1, Ordering::SeqCst);
                    let delay = shared.delay.0.load(Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_micros(delay)).await;
                    let _ =
                        tokio::io::AsyncWriteExt::write_all(&mut stream, &support::ok("x")).await;
                    let _ = tokio::io::AsyncWriteExt::shutdown(&mut stream).await;
                });
            }
        });
        url
    }

    fn arrived(&self) -> u64 {
        self.arrived.load(Ordering::SeqCst)
    }
}

/// Real time: the window measures what loopback answers take. Warm at 5 ms, then every answer
/// twelve times slower with 16 requests in flight and a 10-token budget: the measured limit
/// cuts a few (the window's allowance), the rest run on to the fixed timeout, so no request
/// fails that the fixed timeout serves and the brownout costs few extra arrivals. (Before,
/// every attempt was cut at the measured limit at once, and again at twice it: two retries a
/// request, which the budget could pay for ten of.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_brownout_under_the_timeout_from_latency_fails_no_request_the_fixed_timeout_serves() {
    let server = Slowing::default();
    server.delay.set(Duration::from_millis(5));
    let url = server.start().await;
    let policy = RetryPolicy::builder()
        .attempt_timeout(Duration::from_secs(2))
        .timeout_from_latency(2.0, Duration::from_millis(10))
        .base_delay(Duration::from_millis(1))
        .max_delay(Duration::from_millis(5))
        .build()
        .unwrap();
    let budget = reqwest_safe_retry::RetryBudget::builder()
        .capacity(10.0)
        .initial(10.0)
        .build()
        .unwrap();
    let search = Dependency::new("search", policy).with_budget(budget);
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(search.clone()).with_rng(SeededRng::new(3)))
        .build();
    // Warm for a little over a second (the window is read at most once a second), four at a
    // time: a few hundred answers of about 5 ms.
    let warm_until = std::time::Instant::now() + Duration::from_millis(1_100);
    let warming: Vec<_> = (0..4)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move {
                let mut sent = 0;
                while std::time::Instant::now() < warm_until && sent < 1_000 {
                    client.get(&url).send().await.unwrap();
                    sent += 1;
                }
            })
        })
        .collect();
    for warm in warming {
        warm.await.unwrap();
    }
    assert!(search.counters().requests >= 100, "{:?}", search.counters());

    server.delay.set(Duration::from_millis(60));
    let before = server.arrived();
    let batch: Vec<_> = (0..16)
        .map(|_| {
            let (client, url) = (client.clone(), url.clone());
            tokio::spawn(async move { client.get(&url).send().await.map(|r| r.status()) })
        })
        .collect();
    let mut failed = 0;
    for request in batch {
        match request.await.unwrap() {
            Ok(status) if status == 200 => {}
            _ => failed += 1,
        }
    }
    let arrivals = server.arrived() - before;
    eprintln!("brownout: {arrivals} arrivals for 16 requests, {failed} failed");
    assert_eq!(failed, 0, "arrivals {arrivals}, {:?}", search.counters());
    // At most 1.25 arrivals a request: 16 first attempts and at most 4 retries (the allowance
    // of 2 cuts a second, over at most two seconds of the window's time).
    assert!(arrivals <= 20, "{arrivals} arrivals for 16 requests");
}
