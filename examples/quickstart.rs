//! The README's quick start, against an embedded flaky server: an order POSTed through
//! `RetryMiddleware` rides out two `503`s under one `Idempotency-Key`.
//!
//! The server, on 127.0.0.1, answers `POST /orders` with `503 Service Unavailable` twice, then
//! `201 Created`. A small middleware placed after the retry middleware prints every attempt as it
//! leaves, with the key it carries; the retry middleware's observer prints each wait it decides.
//! The random source has a fixed seed, so the waits are the same on every run.
//!
//! Run it with `cargo run --example quickstart`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{RetryMiddleware, RetryPolicy, RetryRecord, SeededRng};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A server on 127.0.0.1 that fails twice, then takes the order.
    let server = MockServer::start().await;
    Mock::given(method("POST"))
        .and(path("/orders"))
        .respond_with(ResponseTemplate::new(503))
        .up_to_n_times(2)
        .mount(&server)
        .await;
    Mock::given(method("POST"))
        .and(path("/orders"))
        .respond_with(ResponseTemplate::new(201).set_body_string("{\"order\":17}"))
        .mount(&server)
        .await;

    // The quick start's client: the default policy (3 attempts, waits drawn from [0, 100 ms],
    // then [0, 200 ms]). The seed makes this run's draws the same on every run; leave it out in
    // your code, where each process draws its own.
    let waits = Arc::new(Mutex::new(Vec::new()));
    let seen = waits.clone();
    let retry = RetryMiddleware::new(RetryPolicy::default())
        .with_rng(SeededRng::new(42))
        .with_observer(move |event| {
            if let Some(delay) = event.delay {
                println!("  waiting {}", ms(tenths(delay)));
                seen.lock().unwrap().push(delay);
            }
        });
    let keys = Arc::new(Mutex::new(Vec::new()));
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(retry)
        .with(PrintAttempts { keys: keys.clone() })
        .build();

    println!("POST /orders to a server on 127.0.0.1 that fails twice, then takes the order:");
    let response = client
        .post(format!("{}/orders", server.uri()))
        .body("{}")
        .send()
        .await?;

    let record = RetryRecord::of(&response).expect("a response of the middleware");
    let waits = waits.lock().unwrap().clone();
    let keys = keys.lock().unwrap().clone();
    println!(
        "{} after {} attempts ({}), {} waiting in all",
        response.status(),
        record.attempts(),
        record.stop_reason(),
        // The sum of the waits as printed, so the lines add up.
        ms(waits.iter().map(|w| tenths(*w)).sum::<u64>()),
    );
    let one_key = keys.windows(2).all(|pair| pair[0] == pair[1]);
    println!(
        "{} Idempotency-Key on all {} attempts, so the server can make the order once",
        if one_key { "one" } else { "NOT ONE" },
        keys.len(),
    );
    println!("body: {}", response.text().await?);
    Ok(())
}

/// Prints each attempt the retry middleware sends down the chain, and keeps its key.
#[derive(Debug)]
struct PrintAttempts {
    keys: Arc<Mutex<Vec<String>>>,
}

#[async_trait::async_trait]
impl Middleware for PrintAttempts {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let key = request
            .headers()
            .get("idempotency-key")
            .and_then(|k| k.to_str().ok())
            .unwrap_or("(none)")
            .to_owned();
        let attempt = {
            let mut keys = self.keys.lock().unwrap();
            keys.push(key.clone());
            keys.len()
        };
        let label = format!(
            "attempt {attempt}: {} {} Idempotency-Key: {key}",
            request.method(),
            request.url().path(),
        );
        let outcome = next.run(request, extensions).await;
        match &outcome {
            Ok(response) => println!("{label} -> {}", response.status()),
            Err(err) => println!("{label} -> error: {err}"),
        }
        outcome
    }
}

/// A duration in tenths of a millisecond, rounded.
fn tenths(d: Duration) -> u64 {
    ((d.as_micros() + 50) / 100) as u64
}

/// Tenths of a millisecond as a person reads them.
fn ms(tenths: u64) -> String {
    format!("{}.{} ms", tenths / 10, tenths % 10)
}
