//! Both halves on one screen: the charges service on SQLite, a link in front of it that resets
//! or cuts one connection in two, and this workspace's client sending ten charges through it.
//! Each charge is retried with its one key until an answer comes back; the server performs each
//! once.
//!
//! Run it with `cargo run -p safe-retry-server --example both_halves`.

#[path = "support/charges_app.rs"]
mod charges_app;
// The example reads the link's address only; the tests read the fates it drew too.
#[allow(dead_code)]
#[path = "support/lossy_link.rs"]
mod lossy_link;

use std::time::Duration;

use charges_app::ChargesDb;
use reqwest_middleware::ClientBuilder;
use reqwest_safe_retry::{Dependency, RetryBudget, RetryMiddleware, RetryPolicy, RetryRecord};
use safe_retry_server::{IdempotencyLayer, SqliteStore};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    // The server half: the charges service on a SQLite file in a new temporary directory.
    let dir = std::env::temp_dir().join(format!("safe-retry-both-halves-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let store =
        SqliteStore::open(&format!("sqlite://{}", dir.join("charges.db").display())).await?;
    store.prepare().await?;
    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build()?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let server = listener.local_addr()?;
    let app = charges_app::app(layer.clone(), Duration::from_millis(20));
    tokio::spawn(async move { axum::serve(listener, app).await });

    // The network: half the connections reset before the server sees the request, or lose
    // the answer after the server did the work.
    let link = lossy_link::LossyLink::start(server, 42).await;

    // The client half: a new connection per attempt (so the link draws for each), up to 20
    // attempts, and a budget that covers a link this bad.
    let policy = RetryPolicy::builder()
        .max_attempts(20)
        .base_delay(Duration::from_millis(10))
        .max_delay(Duration::from_millis(100))
        .build()?;
    let budget = RetryBudget::builder()
        .capacity(500.0)
        .initial(500.0)
        .build()?;
    let client = ClientBuilder::new(
        reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()?,
    )
    .with(RetryMiddleware::new(
        Dependency::new("charges", policy).with_budget(budget),
    ))
    .build();

    println!(
        "10 charges to http://{}/charges through a lossy link\n",
        link.addr
    );
    for i in 1..=10 {
        let response = client
            .post(format!("http://{}/charges", link.addr))
            .body(format!("charge {i}: 1000 EUR"))
            .send()
            .await?;
        let record = RetryRecord::of(&response).expect("the middleware records every request");
        let key = record
            .idempotency_key()
            .and_then(|k| k.to_str().ok())
            .unwrap_or("-")
            .to_owned();
        let replayed = response.headers().contains_key("idempotent-replayed");
        let status = response.status();
        let body = response.text().await?;
        let effects = store
            .effects()
            .await?
            .iter()
            .filter(|e| e.key == key)
            .count();
        println!(
            "charge {i:>2}: {status} {body} after {} attempt(s){}; effects under key {key}: {effects}",
            record.attempts(),
            if replayed {
                " (a replay: an earlier attempt's answer was lost)"
            } else {
                ""
            },
        );
    }
    let counts = layer.counters().snapshot();
    println!(
        "\n{} effects for 10 charges; the server replayed {} answers and refused {} copies still running",
        store.effects().await?.len(),
        counts.replays,
        counts.in_progress
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}
