//! The charge walk-through of the README as a route: `POST /orders` claims the key, writes the
//! order row (a local step), charges a payment provider (an external step, through this
//! workspace's client, with the key derived from the record), stages the receipt in the outbox
//! (a step), and answers. A fault can be injected at each recovery point: the tests and the
//! example's walk-through crash there.

use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use reqwest_middleware::ClientWithMiddleware;
use safe_retry_server::{Execution, IdempotencyLayer, Message, Step, StepError, StoreError};

use crate::charges_app::ChargesDb;

/// The recovery points, in the order a request reaches them.
pub const POINTS: [&str; 5] = [
    "before-order",
    "after-order",
    "after-charge-call",
    "after-charge",
    "after-receipt",
];

/// The crash points of the order, as a user's own tests arm them: the crate's test helper.
pub use safe_retry_server::testing::{Crash, Crashes as Faults};

/// Where the order's dependencies are, and the client that reaches them.
#[derive(Clone)]
pub struct Orders {
    /// This workspace's client.
    pub client: ClientWithMiddleware,
    /// The payment provider's base URL.
    pub payments: String,
    /// The receipt service's base URL, or a broker's queue (`rabbitmq:<queue>`) or subject
    /// (`nats:<subject>`).
    pub receipts: String,
    /// The faults to inject.
    pub faults: Arc<Faults>,
}

/// This workspace's client, as the service and its relay reach their dependencies: 3
/// attempts a call, 20 ms apart at first, each at most `timeout`.
pub fn dependencies(timeout: std::time::Duration) -> ClientWithMiddleware {
    use reqwest_safe_retry::{Dependency, RetryMiddleware, RetryPolicy};
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .base_delay(std::time::Duration::from_millis(20))
        .build()
        .expect("a valid policy");
    let client = reqwest::Client::builder()
        .timeout(timeout)
        .build()
        .expect("a client on this machine's TLS");
    reqwest_middleware::ClientBuilder::new(client)
        .with(RetryMiddleware::new(Dependency::new(
            "dependencies",
            policy,
        )))
        .build()
}

/// What the charge step keeps of the provider's answer.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Charge {
    status: u16,
    id: Option<String>,
    /// The provider replayed an earlier answer: a resumed call whose first try reached it.
    replayed: bool,
}

/// `POST /orders` behind `layer`.
pub fn orders_app<S: ChargesDb>(layer: IdempotencyLayer<S>, orders: Orders) -> Router {
    Router::new()
        .route("/orders", post(order::<S>))
        .layer(layer)
        .with_state(orders)
}

/// The order for every path, without a layer: a consumer's handler (and its reconciler's),
/// whose messages come as `POST`s to their source's path.
pub fn orders_handler<S: ChargesDb>(orders: Orders) -> Router {
    Router::new().fallback(post(order::<S>)).with_state(orders)
}

/// The receipt's message: to a RabbitMQ queue (`rabbitmq:<queue>`), a JetStream subject
/// (`nats:<subject>`), or `POST <receipts>/receipts`.
fn receipt(receipts: &str) -> Message {
    if let Some(queue) = receipts.strip_prefix("rabbitmq:") {
        Message::rabbitmq("receipt", "", queue)
    } else if let Some(subject) = receipts.strip_prefix("nats:") {
        Message::nats("receipt", subject)
    } else {
        Message::post("receipt", format!("{receipts}/receipts"))
    }
}

async fn order<S: ChargesDb>(
    State(orders): State<Orders>,
    Extension(execution): Extension<Execution<S>>,
    body: String,
) -> Response {
    match run(&orders, &execution, &body).await {
        Ok(answer) => answer,
        Err(error) => error.into_response(),
    }
}

async fn run<S: ChargesDb>(
    orders: &Orders,
    execution: &Execution<S>,
    body: &str,
) -> Result<Response, StepError> {
    orders.faults.point("before-order").await?;

    // A local step: the order row commits with the step.
    let order: i64 = match execution.step("order").await? {
        Step::Done(order) => order,
        Step::Todo(mut step) => {
            let tx = step.tx().await?;
            let order = S::record_effect(tx, execution.key(), body)
                .await
                .map_err(StoreError::new)?;
            step.commit(order).await?
        }
    };
    orders.faults.point("after-order").await?;

    // An external step: the provider is called with the key derived from (scope, key,
    // "charge"), on this attempt and every resumption.
    let charge: Charge = match execution.step("charge").await? {
        Step::Done(charge) => charge,
        Step::Todo(mut step) => {
            let answer = step
                .call(
                    orders
                        .client
                        .post(format!("{}/charges", orders.payments))
                        .body(format!("{{\"order\":{order},\"amount\":1000}}")),
                )
                .await?;
            orders.faults.point("after-charge-call").await?;
            let id = serde_json::from_slice::<serde_json::Value>(&answer.body)
                .ok()
                .and_then(|v| v["id"].as_str().map(str::to_owned));
            step.commit(Charge {
                status: answer.status.as_u16(),
                id,
                replayed: answer.replayed,
            })
            .await?
        }
    };
    orders.faults.point("after-charge").await?;
    if charge.status >= 400 {
        return Ok((
            StatusCode::PAYMENT_REQUIRED,
            Json(serde_json::json!({ "order": order, "declined": charge.status })),
        )
            .into_response());
    }

    // The receipt leaves through the outbox, staged in the step's transaction.
    if let Step::Todo(mut step) = execution.step::<()>("receipt").await? {
        step.stage(
            &receipt(&orders.receipts)
                .json(&serde_json::json!({ "order": order, "charge": charge.id })),
        )
        .await?;
        // Not a recovery point: the receipt is staged in the step's open transaction.
        orders.faults.point("receipt-staged").await?;
        step.commit(()).await?;
    }
    orders.faults.point("after-receipt").await?;

    Ok((
        StatusCode::CREATED,
        Json(serde_json::json!({
            "order": order,
            "charge": charge.id,
            "charge_replayed": charge.replayed,
        })),
    )
        .into_response())
}
