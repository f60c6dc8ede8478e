//! Crash recovery on PostgreSQL, in time: how fast the reconciler resumes stalled records, and
//! how fast the outbox relay delivers staged messages.
//!
//! - **Reconciler**: 64 orders stalled after their first step (the order row committed, the
//!   charge not made, the lease ended); one tick of a reconciler with a batch of 64 resumes
//!   them all: each is claimed, its saved request read, the charge made through this
//!   workspace's client at a receiver on loopback, its step committed and its answer stored.
//!   Beside it, the floor: 64 new orders sent through the layer at once (the same handler and
//!   call, from the start), so the figure reads as the price of resuming instead of running.
//! - **Relay**: 256 messages staged, then relay ticks (batch 64) until every one is delivered to
//!   the receiver on loopback and marked sent.
//!
//! Run with `cargo bench -p safe-retry-server --all-features --bench recovery`; the database is
//! `SAFE_RETRY_POSTGRES_URL` [postgres://postgres@127.0.0.1:5432/test], in a schema of its own
//! that the bench drops at the end. `ROUNDS` [10] changes the run. Each figure is the mean of
//! the rounds, with the lowest and highest round.

#[allow(dead_code)]
#[path = "../examples/support/receiver.rs"]
mod receiver;

#[path = "common/pg_schema.rs"]
mod pg_schema;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use axum::Extension;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use http_body_util::BodyExt;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware};
use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
use safe_retry_server::store::{Outbox, Outcomes};
use safe_retry_server::{
    Execution, IdempotencyLayer, PostgresStore, Relay, Step, StepError, StoreError,
};
use tower_service::Service;

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The bench's order: a local step, then a charge at the receiver. While `stall` is set it
/// stops after the first step (the record waits for the reconciler).
#[derive(Clone)]
struct Order {
    client: ClientWithMiddleware,
    charges: String,
    stall: Arc<AtomicBool>,
}

async fn order(
    Extension(order): Extension<Order>,
    Extension(execution): Extension<Execution<PostgresStore>>,
    body: String,
) -> Response {
    let run = async {
        if let Step::Todo(mut step) = execution.step::<i64>("order").await? {
            let id: i64 = sqlx::query_scalar(
                "INSERT INTO bench_orders (key, body) VALUES ($1, $2) RETURNING id",
            )
            .bind(execution.key())
            .bind(&body)
            .fetch_one(&mut **step.tx().await?)
            .await
            .map_err(StoreError::from)?;
            step.commit(id).await?;
        }
        if order.stall.load(Ordering::Relaxed) {
            return Err(StepError::Misuse("stalled for the bench"));
        }
        if let Step::Todo(mut step) = execution.step::<u16>("charge").await? {
            let answer = step
                .call(order.client.post(&order.charges).body(body.clone()))
                .await?;
            step.commit(answer.status.as_u16()).await?;
        }
        Ok::<_, StepError>((StatusCode::CREATED, "ordered").into_response())
    };
    run.await.unwrap_or_else(|error| error.into_response())
}

fn client() -> ClientWithMiddleware {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(Duration::from_millis(5))
        .build()
        .unwrap();
    ClientBuilder::new(reqwest::Client::new())
        .with(RetryMiddleware::new(Dependency::new("receiver", policy)))
        .build()
}

async fn send(router: &mut axum::Router, key: &str) -> StatusCode {
    let request = http::Request::post("/orders")
        .header("idempotency-key", key)
        .body(axum::body::Body::from("{\"amount\":1000}"))
        .unwrap();
    let response = router.call(request).await.unwrap();
    let status = response.status();
    let _ = response.into_body().collect().await;
    status
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

fn spread(values: &[f64]) -> String {
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    format!("{:.0} [{:.0}–{:.0}]", mean(values), low, high)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let schema = pg_schema::PgSchema::create("bench_recovery").await;
    let store = PostgresStore::from_pool(schema.pool.clone());
    store.migrate().await.unwrap();
    sqlx::query("CREATE TABLE bench_orders (id BIGSERIAL PRIMARY KEY, key TEXT NOT NULL, body TEXT NOT NULL)")
        .execute(store.pool())
        .await
        .unwrap();
    let version: String = sqlx::query_scalar("SHOW server_version")
        .fetch_one(store.pool())
        .await
        .unwrap();
    let (receiver_addr, receiver) = receiver::Receiver::start("ch").await;
    let rounds = env("ROUNDS", 10);
    println!(
        "PostgreSQL {version}, pool of 16, {rounds} rounds; figures are mean [lowest, highest round]\n"
    );

    let layer = IdempotencyLayer::builder(store.clone())
        .shared_scope()
        .build()
        .unwrap();
    let stall = Arc::new(AtomicBool::new(false));
    let app = axum::Router::new()
        .route("/orders", post(order))
        .layer(layer.clone())
        .layer(Extension(Order {
            client: client(),
            charges: format!("http://{receiver_addr}/charges"),
            stall: stall.clone(),
        }));
    let reconciler = layer.reconciler(app.clone()).batch(64);

    // Resumptions: 64 stalled records, one tick.
    let mut resumed = Vec::new();
    let mut fresh = Vec::new();
    for round in 0..rounds {
        stall.store(true, Ordering::Relaxed);
        let mut stalling = tokio::task::JoinSet::new();
        for i in 0..64 {
            let mut app = app.clone();
            stalling.spawn(async move { send(&mut app, &format!("stall-{round}-{i}")).await });
        }
        for status in stalling.join_all().await {
            assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        }
        stall.store(false, Ordering::Relaxed);
        let start = Instant::now();
        let report = reconciler.tick().await.unwrap();
        let elapsed = start.elapsed();
        assert_eq!((report.found, report.completed), (64, 64), "{report:?}");
        resumed.push(64.0 / elapsed.as_secs_f64());

        let start = Instant::now();
        let mut running = tokio::task::JoinSet::new();
        for i in 0..64 {
            let mut app = app.clone();
            running.spawn(async move { send(&mut app, &format!("fresh-{round}-{i}")).await });
        }
        for status in running.join_all().await {
            assert_eq!(status, StatusCode::CREATED);
        }
        fresh.push(64.0 / start.elapsed().as_secs_f64());
    }
    assert_eq!(receiver.effects().len(), 128 * rounds as usize);
    println!("{:<58} {:>22}", "64 orders", "records/s");
    println!(
        "{:<58} {:>22}",
        "(r) stalled after their first step, resumed by one tick",
        spread(&resumed)
    );
    println!(
        "{:<58} {:>22}",
        "(n) new, sent through the layer at once (the floor)",
        spread(&fresh)
    );
    println!(
        "{:<58} {:>21.2}×",
        "(r) / (n)",
        mean(&resumed) / mean(&fresh)
    );

    // The relay: 256 staged messages, ticks of 64 until all are sent.
    let relay = Relay::new(store.clone(), client()).batch(64);
    let mut rates = Vec::new();
    for round in 0..rounds {
        let mut tx = store.begin().await.unwrap();
        for i in 0..256 {
            let id = format!("bench/{round}/{i}");
            let headers = [];
            store
                .stage(
                    &mut tx,
                    &safe_retry_server::store::StagedMessage {
                        id: &id,
                        method: "POST",
                        url: &format!("http://{receiver_addr}/receipts"),
                        headers: &headers,
                        body: b"{\"receipt\":true}",
                    },
                )
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
        let start = Instant::now();
        let mut sent = 0;
        for _ in 0..64 {
            sent += relay.tick().await.unwrap().sent;
            if sent == 256 {
                break;
            }
        }
        assert_eq!(sent, 256);
        rates.push(256.0 / start.elapsed().as_secs_f64());
    }
    println!(
        "\n{:<58} {:>22}",
        "outbox relay, 256 messages, batches of 64", "messages/s"
    );
    println!(
        "{:<58} {:>22}",
        "staged, delivered, marked sent",
        spread(&rates)
    );

    schema.drop().await;
}
