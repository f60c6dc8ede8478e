//! The charge walk-through of the README as a route: `POST /orders` claims the key, writes the
//! order row (a local step), charges a payment provider (an external step, through this
//! workspace's client, with the key derived from the record), stages the receipt in the outbox
//! (a step), and answers. A fault can be injected at each recovery point: the tests and the
//! example's walk-through crash there.

use std::sync::{Arc, Mutex};

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use reqwest_middleware::ClientWithMiddleware;
use safe_retry_server::{Execution, IdempotencyLayer, Message, Step, StepError, StoreError};
use tokio::sync::Semaphore;

use crate::charges_app::ChargesDb;

/// The recovery points, in the order a request reaches them.
pub const POINTS: [&str; 5] = [
    "before-order",
    "after-order",
    "after-charge-call",
    "after-charge",
    "after-receipt",
];

/// What an injected fault does when its point is reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Crash {
    /// The handler fails there, as an exception would end it.
    Fail,
    /// The handler stops there for ever: its process is killed, or its future dropped.
    Hang,
    /// The handler waits there for a permit of [`Faults::resume`], then goes on: a holder
    /// that wakes up after another took its record over.
    Pause,
}

/// The fault to inject once, and the permits that tell a test a point was reached.
pub struct Faults {
    armed: Mutex<Option<(String, Crash)>>,
    /// A permit each time an armed point is reached.
    pub reached: Semaphore,
    /// The permits a [`Crash::Pause`] waits for.
    pub resume: Semaphore,
    /// Print `reached POINT` on stdout when the armed point is reached (the example does).
    pub announce: bool,
}

impl Default for Faults {
    fn default() -> Faults {
        Faults {
            armed: Mutex::new(None),
            reached: Semaphore::new(0),
            resume: Semaphore::new(0),
            announce: false,
        }
    }
}

impl Faults {
    /// Faults that print the point they stop at.
    pub fn announced() -> Faults {
        Faults {
            announce: true,
            ..Faults::default()
        }
    }

    /// Arms a fault at `point`, for the next request that reaches it.
    pub fn arm(&self, point: &str, crash: Crash) {
        *self.armed.lock().unwrap() = Some((point.to_owned(), crash));
    }

    /// Disarms the fault, if one is armed.
    pub fn disarm(&self) {
        *self.armed.lock().unwrap() = None;
    }

    async fn reach(&self, point: &str) -> Result<(), StepError> {
        let crash = {
            let mut armed = self.armed.lock().unwrap();
            match armed.as_ref() {
                Some((at, _)) if at == point => armed.take().map(|(_, crash)| crash),
                _ => None,
            }
        };
        let Some(crash) = crash else { return Ok(()) };
        if self.announce {
            use std::io::Write;
            println!("reached {point}");
            let _ = std::io::stdout().flush();
        }
        self.reached.add_permits(1);
        match crash {
            Crash::Fail => Err(StepError::Store(StoreError::new(format!(
                "a fault injected at {point}"
            )))),
            Crash::Hang => std::future::pending().await,
            Crash::Pause => {
                self.resume.acquire().await.expect("never closed").forget();
                Ok(())
            }
        }
    }
}

/// Where the order's dependencies are, and the client that reaches them.
#[derive(Clone)]
pub struct Orders {
    /// This workspace's client.
    pub client: ClientWithMiddleware,
    /// The payment provider's base URL.
    pub payments: String,
    /// The receipt service's base URL.
    pub receipts: String,
    /// The faults to inject.
    pub faults: Arc<Faults>,
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
    orders.faults.reach("before-order").await?;

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
    orders.faults.reach("after-order").await?;

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
            orders.faults.reach("after-charge-call").await?;
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
    orders.faults.reach("after-charge").await?;
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
            &Message::post("receipt", format!("{}/receipts", orders.receipts))
                .json(&serde_json::json!({ "order": order, "charge": charge.id })),
        )
        .await?;
        // Not a recovery point: the receipt is staged in the step's open transaction.
        orders.faults.reach("receipt-staged").await?;
        step.commit(()).await?;
    }
    orders.faults.reach("after-receipt").await?;

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
