//! Two dependencies behind one client, each with its own policy, budget and counters.
//!
//! A payment API on one loopback port is slow to warm up (its first answer is a 503) and wants
//! idempotency keys and patience; a cache on another port is down hard and gets one quick retry
//! and a small budget, so its outage cannot multiply the load on it. At the end the counters of
//! each dependency are printed.
//!
//! The middleware logs through `tracing`: this example prints what a subscriber at INFO shows (a
//! retry at INFO, a give-up at WARN), as your application's subscriber would. The random source
//! has a fixed seed, so the waits are the same on every run.
//!
//! Run it with `cargo run --example dependencies`.

use std::time::Duration;

use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{
    Dependency, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord, SeededRng,
};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Your application's subscriber: here tracing-subscriber's plain one, at INFO, on stdout,
    // without colours or timestamps.
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::INFO)
        .without_time()
        .with_ansi(false)
        .init();

    let payments_server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/charges"))
        .respond_with(ResponseTemplate::new(503))
        .up_to_n_times(1)
        .mount(&payments_server)
        .await;
    Mock::given(method("POST"))
        .and(path("/charges"))
        .respond_with(ResponseTemplate::new(201).set_body_string("{\"charged\":true}"))
        .mount(&payments_server)
        .await;
    let cache_server = MockServer::start().await;
    Mock::given(method("GET"))
        .respond_with(ResponseTemplate::new(503))
        .mount(&cache_server)
        .await;

    let payments = Dependency::new(
        "payments",
        RetryPolicy::builder()
            .max_attempts(5)
            .deadline(Duration::from_secs(60))
            .base_delay(Duration::from_millis(20))
            .build()?,
    );
    let cache = Dependency::new(
        "cache",
        RetryPolicy::builder()
            .max_attempts(2)
            .base_delay(Duration::from_millis(1))
            .deadline(Duration::from_millis(200))
            .build()?,
    )
    .with_budget(
        RetryBudget::builder()
            .capacity(3.0)
            .floor_per_sec(0.0)
            .build()?,
    );
    // Clones share the counts: these are read after the middleware has the originals.
    let (payments_counters, cache_counters) = (payments.clone(), cache.clone());

    let client = ClientBuilder::new(reqwest::Client::new())
        .with(
            RetryMiddleware::new(RetryPolicy::default())
                .route(&payments_server.address().to_string(), payments)?
                .route(&cache_server.address().to_string(), cache)?
                .with_rng(SeededRng::new(7)),
        )
        .build();

    println!(
        "payments ({}): 3 charges, the first meets a 503",
        payments_server.uri()
    );
    for i in 1..=3 {
        let response = client
            .post(format!("{}/charges", payments_server.uri()))
            .body(format!("{{\"amount\":{i}0}}"))
            .send()
            .await?;
        let attempts = RetryRecord::of(&response).map_or(1, |r| r.attempts());
        println!(
            "  charge {i}: {} after {attempts} attempt(s)",
            response.status()
        );
    }
    println!(
        "cache ({}): 10 lookups against a dead cache",
        cache_server.uri()
    );
    for i in 1..=10 {
        let response = client
            .get(format!("{}/item/{i}", cache_server.uri()))
            .send()
            .await?;
        let attempts = RetryRecord::of(&response).map_or(1, |r| r.attempts());
        println!(
            "  lookup {i}: {} after {attempts} attempt(s)",
            response.status()
        );
    }
    println!();

    for (name, counters) in [("payments", &payments_counters), ("cache", &cache_counters)] {
        let c = counters.counters();
        println!(
            "{name:<9} requests {:>3}  attempts {:>3}  retries {:>3}  budget refusals {:>3}  \
             deadline stops {:>2}  keys stamped {:>2}",
            c.requests, c.attempts, c.retries, c.budget_refusals, c.deadline_stops, c.keys_stamped
        );
    }
    println!(
        "\nThe cache's budget paid for {} retries and refused {}: its outage cost {} attempts for 10 lookups, not 20.",
        cache_counters.counters().retries,
        cache_counters.counters().budget_refusals,
        cache_counters.counters().attempts
    );
    Ok(())
}
