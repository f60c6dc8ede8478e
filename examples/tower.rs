//! The same retries for a tower client: hyper-util's client under `RetryMiddleware` as a tower
//! layer, against a flaky service on loopback.
//!
//! The server answers `POST /orders` with `503 Service Unavailable` twice, then `201 Created`.
//! The client is hyper-util's, with no reqwest client anywhere: the middleware wraps it as a
//! `tower::Layer`, stamps one `Idempotency-Key` on the order, and sends it again under the same
//! key until the server takes it. The layer's observer prints each attempt's answer and the wait
//! it decides; the random source has a fixed seed, so the waits are the same on every run.
//!
//! Run it with `cargo run --example tower --features tower`.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use reqwest_safe_retry::{RetryMiddleware, RetryPolicy, RetryRecord, SeededRng, body::SendBody};
use tower_layer::Layer;
use tower_service::Service;
use wiremock::matchers::{method, path};
use wiremock::{Mock, MockServer, ResponseTemplate};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
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
        .respond_with(ResponseTemplate::new(201).set_body_string("order 17 placed"))
        .mount(&server)
        .await;

    // hyper-util's client under the middleware as a layer: it takes the layer's `SendBody`, made
    // from whatever body the caller sends (`Full<Bytes>` here).
    let client = Client::builder(TokioExecutor::new()).build_http::<SendBody<Full<Bytes>>>();
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(100))
        .build()?;
    let mut orders = RetryMiddleware::new(policy)
        .with_rng(SeededRng::new(42))
        .with_observer(|event| {
            let answer = event
                .status
                .and_then(|s| http::StatusCode::from_u16(s).ok())
                .map_or("no answer".to_owned(), |s| s.to_string());
            match event.delay {
                Some(delay) => {
                    println!("attempt {}: {answer}, waiting {}", event.attempt, ms(delay))
                }
                None => println!("attempt {}: {answer}", event.attempt),
            }
        })
        .layer(client);

    // A body whole in memory is kept for the retries, its bytes shared by every attempt.
    let order = Bytes::from_static(br#"{"sku":"widget","count":2}"#);
    let request = http::Request::post(format!("{}/orders", server.uri()))
        .header("content-type", "application/json")
        .body(Full::new(order))?;
    std::future::poll_fn(|cx| Service::<http::Request<Full<Bytes>>>::poll_ready(&mut orders, cx))
        .await?;
    let response = orders.call(request).await?;

    let record = RetryRecord::of(&response).expect("the layer's answers carry a record");
    println!(
        "{} after {} attempts ({})",
        response.status(),
        record.attempts(),
        record.stop_reason()
    );
    println!("what the server saw:");
    for (n, seen) in server
        .received_requests()
        .await
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        let key = seen
            .headers
            .get("idempotency-key")
            .map(|k| k.to_str().unwrap_or("?"));
        println!(
            "  attempt {}: {} {} Idempotency-Key: {}",
            n + 1,
            seen.method,
            seen.url.path(),
            key.unwrap_or("(none)")
        );
    }
    Ok(())
}

/// A duration as a person reads it: milliseconds, to a tenth.
fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1000.0)
}
