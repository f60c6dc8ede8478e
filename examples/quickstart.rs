//! The main job in one screen: a flaky service on loopback, and a client that rides it out.
//!
//! The server answers `503 Service Unavailable` twice, then `200 OK`. The client sends one GET
//! through `RetryMiddleware`; a small middleware placed after it prints every attempt as it
//! leaves, so you can watch the retries and the waits between them.
//!
//! Run it with `cargo run --example quickstart`.

use std::time::{Duration, Instant};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{ClientBuilder, Middleware, Next};
use reqwest_safe_retry::{RetryMiddleware, RetryPolicy, RetryRecord};
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // A server on 127.0.0.1 that fails twice, then recovers.
    let server = MockServer::start().await;
    Mock::given(method("GET"))
        .and(path("/inventory"))
        .respond_with(ResponseTemplate::new(503))
        .up_to_n_times(2)
        .mount(&server)
        .await;
    Mock::given(method("GET"))
        .and(path("/inventory"))
        .respond_with(ResponseTemplate::new(200).set_body_string("42 widgets in stock"))
        .mount(&server)
        .await;

    // Up to 3 attempts; waits drawn from [0, 200 ms], then [0, 400 ms] (capped full jitter).
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(200))
        .build()?;
    let client = ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(policy))
        .with(PrintAttempts::default())
        .build();

    println!(
        "GET {}/inventory: the server fails twice, then answers.\n",
        server.uri()
    );
    let response = client
        .get(format!("{}/inventory", server.uri()))
        .send()
        .await?;

    let record = RetryRecord::of(&response).expect("the retry middleware records every request");
    println!(
        "\nfinal status: {} after {} attempts ({} waiting between them; stopped because: {})",
        response.status(),
        record.attempts(),
        fmt_ms(record.waited()),
        record.stop_reason(),
    );
    println!("body: {:?}", response.text().await?);
    Ok(())
}

/// Prints each attempt that the retry middleware sends down the chain.
#[derive(Debug, Default)]
struct PrintAttempts {
    state: std::sync::Mutex<(u32, Option<Instant>)>,
}

#[async_trait::async_trait]
impl Middleware for PrintAttempts {
    async fn handle(
        &self,
        request: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let (attempt, waited) = {
            let mut state = self.state.lock().unwrap();
            state.0 += 1;
            (state.0, state.1.map(|ended| ended.elapsed()))
        };
        if let Some(waited) = waited {
            println!("  ... waited {} (backoff with jitter)", fmt_ms(waited));
        }
        let label = format!(
            "attempt {attempt}: {} {}",
            request.method(),
            request.url().path()
        );
        let outcome = next.run(request, extensions).await;
        match &outcome {
            Ok(response) => println!("{label} -> {}", response.status()),
            Err(err) => println!("{label} -> error: {err}"),
        }
        self.state.lock().unwrap().1 = Some(Instant::now());
        outcome
    }
}

fn fmt_ms(d: Duration) -> String {
    format!("{} ms", d.as_millis())
}
